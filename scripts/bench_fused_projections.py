"""What fusing q|k|v and gate|up (what run() does before decoding) buys per target forward.

Loads the shipped target twice, fuses one copy (`specpipe.models.llama.fuse_projections`), and times
forwards over a warm KV pool: one token per request (decode) and 12 tokens (a verify tree), at batch 1
and 8, best of --repeats x 20 calls, interleaved. Prints ms per forward and the unfused/fused ratio, and
checks that the logits are bitwise equal. Weights are row-major in both copies unless --layout says
otherwise (auto: each copy's layouts are chosen as run() would, per case).

    python scripts/bench_fused_projections.py
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def make_batch(B: int, Q: int, L: int):
    """Request b holds positions [0, L+Q) in slots b*(L+Q)+1 ...; its Q new tokens are the last ones."""
    from specpipe.models.attention_batch import AttentionBatch

    table = torch.arange(B * (L + Q)).view(B, L + Q) + 1
    pos = torch.arange(L, L + Q)[None].expand(B, Q).contiguous()
    mask = torch.ones(B, Q, L + Q, dtype=torch.bool)
    return AttentionBatch(pos, table[:, L:].contiguous(), table, mask, torch.arange(L + Q)[None].expand(B, L + Q))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=256, help="cached tokens per request")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layout", default="row", choices=["row", "column", "auto"],
                    help="device.weight_layout for both copies (auto: timed per shape at the rows of each case)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from specpipe.models.hf.load import load_target
    from specpipe.models.llama import fuse_projections

    path = ROOT / "specpipe" / "assets" / "tiny" / "target"
    models = {"unfused": load_target(path, "float32", "cpu"), "fused": load_target(path, "float32", "cpu")}
    fuse_projections([models["fused"]])
    for m in models.values():
        m.setup_kv(8 * (args.context + 12) + 1)
    print(f"torch {torch.__version__}, {args.threads} thread(s); shipped target, fp32, weight layout {args.layout}, "
          f"{args.context} cached tokens per request; best of {args.repeats} x 20 forwards\n")
    print("| batch | tokens per request | unfused ms | fused ms | unfused / fused | logits bitwise equal |")
    print("|---:|---:|---:|---:|---:|---|")
    from specpipe.devices.weight_layout import lay_out_weights

    for B, Q in ((1, 1), (1, 12), (8, 1), (8, 12)):
        for m in models.values():
            lay_out_weights([m], args.layout, rows=(1, B * Q))
        ids = torch.randint(0, 256, (B, Q), generator=torch.Generator().manual_seed(B * 100 + Q))
        batch = make_batch(B, Q, args.context)
        best, logits = {}, {}
        with torch.no_grad():
            for name, m in models.items():
                logits[name] = m.logits(m(ids, batch))
                best[name] = float("inf")
            for _ in range(args.repeats):
                for name, m in models.items():
                    t = time.perf_counter()
                    for _ in range(20):
                        m.logits(m(ids, batch))
                    best[name] = min(best[name], (time.perf_counter() - t) / 20 * 1e3)
        same = torch.equal(logits["fused"], logits["unfused"])
        print(f"| {B} | {Q} | {best['unfused']:.2f} | {best['fused']:.2f} | {best['unfused'] / best['fused']:.3f}x "
              f"| {'yes' if same else 'no'} |", flush=True)


if __name__ == "__main__":
    main()
