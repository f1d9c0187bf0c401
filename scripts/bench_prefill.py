"""Prefill forward of the shipped target: the masked pool path vs the fresh-causal path, one process.

A fresh prefill (no cached prefix, right-padded prompts) lets dense layers attend causally over the
forward's own K/V (``AttentionBatch.fresh_causal``, set by ``Pipeline.prefill_target``) instead of
gathering them back from the KV pool under an explicit [B, T, T] mask. Both paths give the same
hidden states (tests/models/test_prefill_fast_path.py); this prints what the shortcut saves.

    python scripts/bench_prefill.py                 # batch 1 and 8, prompts of 224-320 tokens
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def time_ms(model, ids, lens, table, fresh: bool, iters: int) -> float:
    from specpipe.models.attention_batch import extend_batch
    from specpipe.stages.padding import bucket

    B, T = ids.shape

    def forward():
        batch = extend_batch(table, torch.arange(B), torch.zeros_like(lens), lens, T, bucket(T))
        batch.fresh_causal = fresh
        return model(ids, batch)

    with torch.no_grad():
        forward()  # warm-up
        best = float("inf")
        for _ in range(iters):
            t0 = time.perf_counter()
            forward()
            best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--iters", type=int, default=5, help="timed forwards per point; the fastest is kept")
    ap.add_argument("--threads", type=int, default=1)
    opt = ap.parse_args()
    torch.set_num_threads(opt.threads)
    from specpipe.models.hf.load import load_target

    model = load_target(Path(__file__).resolve().parents[1] / "specpipe/assets/tiny/target", "float32", "cpu")
    g = torch.Generator().manual_seed(0)
    print(f"shipped target, float32, {torch.get_num_threads()} thread(s), prompts of 224-320 tokens")
    print(f"{'batch':>5} | {'masked ms':>9} | {'causal ms':>9} | {'ratio':>5}")
    for B in opt.batch:
        lens = torch.randint(224, 321, (B,), generator=g)
        T = int(lens.max())
        ids = torch.randint(0, 256, (B, T), generator=g)
        model.setup_kv(B * 512 + 1)
        table = torch.arange(1, B * 512 + 1).view(B, 512)
        masked = time_ms(model, ids, lens, table, False, opt.iters)
        causal = time_ms(model, ids, lens, table, True, opt.iters)
        print(f"{B:>5} | {masked:>9.1f} | {causal:>9.1f} | {masked / causal:>4.2f}x")


if __name__ == "__main__":
    main()
