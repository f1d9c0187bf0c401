"""What packing a KV group's query heads into one head's queries (`grouped_sdpa`) buys over SDPA's enable_gqa.

The pool-attention paths (decode, verify trees, draft steps, extends with cached context) call SDPA with a
mask shared by all heads. With enable_gqa, torch reads every K/V block once per query head; packed, the G
heads of a group go in as G*Q queries of one head and each K/V block is read once per group. Times both on
K/V laid out as the pool gather leaves them ([B, L, Hkv, D] transposed), best of --repeats x 10 calls,
interleaved, and checks the outputs agree. Prints ms per call, the enable_gqa/packed ratio, and which one the
model uses at that size (packing from PACK_MIN_KV K/V elements on).

    python scripts/bench_gqa_attention.py --threads 1
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specpipe.models import attention  # noqa: E402
from specpipe.models.attention import grouped_sdpa  # noqa: E402

SHAPES = [  # (name, H, Hkv, D)
    ("shipped tiny (4/2 heads, d64)", 4, 2, 64),
    ("Llama-3-8B layer (32/8 heads, d128)", 32, 8, 128),
]
CASES = [  # (what, B, Q, L)
    (what, B, Q, L) for L in (512, 2048, 8192)
    for what, B, Q in (("decode", 1, 1), ("decode", 8, 1), ("verify tree", 1, 12), ("verify tree", 8, 12),
                       ("draft step", 1, 4), ("draft step", 4, 4))
]


def best(fn, repeats: int) -> float:
    fn()
    out = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(10):
            fn()
        out = min(out, (time.perf_counter() - t) / 10)
    return out * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--big", action="store_true", help="include the Llama-3-8B-sized layer (slower)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    threshold, attention.PACK_MIN_KV = attention.PACK_MIN_KV, 0  # time the packing at every size
    g = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} thread(s); ms per attention call, best of {args.repeats}x10")
    print(f"{'heads':38} {'case':12} {'B':>2} {'Q':>3} {'L':>5} | {'enable_gqa':>10} {'packed':>8} | ratio")
    for name, H, Hkv, D in SHAPES if args.big else SHAPES[:1]:
        for what, B, Q, L in CASES:
            q = torch.randn(B, Q, H, D, generator=g).transpose(1, 2)
            k = torch.randn(B, L, Hkv, D, generator=g).transpose(1, 2)
            v = torch.randn(B, L, Hkv, D, generator=g).transpose(1, 2)
            mask = (torch.rand(B, 1, Q, L, generator=g) > 0.05) | (torch.arange(L) == 0)
            ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            err = (grouped_sdpa(q, k, v, mask) - ref).abs().max().item()
            assert err < 1e-4, err
            ms = [0.0, 0.0]
            for _ in range(2):  # interleaved
                ms[0] = best(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
                             args.repeats)
                ms[1] = best(lambda: grouped_sdpa(q, k, v, mask), args.repeats)
            used = "packed" if B * L * Hkv * D >= threshold else "enable_gqa"
            print(f"{name:38} {what:12} {B:>2} {Q:>3} {L:>5} | {ms[0]:>10.3f} {ms[1]:>8.3f} | {ms[0] / ms[1]:.2f}x"
                  f"  (run() uses {used})")


if __name__ == "__main__":
    main()
