"""Time the sampler's logits processing (`verify_sampling.process_logits`) against a sort-based baseline.

Run: .venv/bin/python scripts/bench_sampling.py              (about 1 min)
     .venv/bin/python scripts/bench_sampling.py --rows 96    (batch 8 x 12 tree nodes)

The baseline is the pre-2026-12-04 processing, rebuilt here: softmax, one stable descending sort of the whole
vocabulary, top-k, top-p and min-p on the sorted copy, scattered back. specpipe now runs only the filters some
request uses: temperature alone is a softmax, top-k a `topk`, top-p a radix select (vocabularies of
RADIX_MIN_VOCAB tokens or more). Both are timed interleaved on the same logits ([1, rows, V], the verify
logits of one request's tree), median of the repeats; the ratio is baseline / specpipe. One torch thread.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specpipe.stages.verify_sampling import Filters, process_logits  # noqa: E402

SETTINGS = {  # name -> (temperature, top_p, top_k, min_p)
    "temperature 0.7": (0.7, 1.0, 0, 0.0),
    "top_k 50": (0.7, 1.0, 50, 0.0),
    "top_p 0.9": (0.7, 0.9, 0, 0.0),
    "top_k 20 + top_p 0.95": (0.6, 0.95, 20, 0.0),
    "min_p 0.05": (0.7, 1.0, 0, 0.05),
}


def sorted_baseline(logits, temperature, top_p, top_k, min_p):
    """Every filter from one stable sort of the vocabulary (the processing specpipe had before)."""
    B, N, V = logits.shape
    probs = torch.softmax(logits.float() / temperature[:, None, None], dim=-1)
    sp, si = probs.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(V)
    k = torch.where(top_k > 0, top_k.clamp(max=V), torch.full_like(top_k, V))
    kth = sp.gather(-1, (k - 1).view(B, 1, 1).expand(B, N, 1))
    keep = sp >= kth
    sp = torch.where(keep, sp, torch.zeros_like(sp))
    sp = sp / sp.sum(-1, keepdim=True)
    before = sp.cumsum(-1) - sp
    keep = keep & ((before < top_p[:, None, None]) | (top_p >= 1)[:, None, None] | (rank == 0))
    keep = keep & (sp >= min_p[:, None, None] * sp[..., :1])
    sp = torch.where(keep, sp, torch.zeros_like(sp))
    out = torch.zeros_like(probs).scatter(-1, si, sp)
    return out / out.sum(-1, keepdim=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, nargs="+", default=[32000, 128256, 151936])
    ap.add_argument("--rows", type=int, default=12, help="tree nodes verified (rows of logits)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), logits [1, {args.rows}, V], median of {args.repeats}")
    print(f"{'V':>7}  {'setting':<24} {'baseline ms':>11} {'specpipe ms':>11} {'ratio':>7}  same tokens kept")
    for V in args.vocab:
        logits = 4 * torch.randn(1, args.rows, V, generator=torch.Generator().manual_seed(V))
        for name, (t, p, k, m) in SETTINGS.items():
            T, P, K, M = torch.tensor([t]), torch.tensor([p]), torch.tensor([k]), torch.tensor([m])
            f = Filters(greedy=False).add(t, p, k, m)  # what SamplingState knows when the request joins
            new = lambda: process_logits(logits, T, P, K, M, f)  # noqa: E731
            old = lambda: sorted_baseline(logits, T, P, K, M)  # noqa: E731
            same = torch.equal(new() > 0, old() > 0)
            times = {"old": [], "new": []}
            for _ in range(args.repeats):
                for key, fn in (("old", old), ("new", new)):
                    t0 = time.perf_counter()
                    fn()
                    times[key].append(time.perf_counter() - t0)
            a, b = (statistics.median(times[x]) * 1e3 for x in ("old", "new"))
            print(f"{V:>7}  {name:<24} {a:>11.1f} {b:>11.1f} {a / b:>6.1f}x  {same}")


if __name__ == "__main__":
    main()
