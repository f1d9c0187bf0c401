"""What narrowing a sliding-window layer's key columns (`AttentionBatch.window_view`) buys per target forward.

A random_tiny target (hidden 256, 4 layers, every layer sliding with --window) holds --context cached tokens per
request; one forward of Q new tokens (1: decode, 12: a verify-sized extend) is timed with the view (each windowed
layer gathers window - 1 + Q columns) and without it (every column, masked), best of --repeats x 5 calls,
interleaved. Prints ms per forward and the full/narrowed ratio, and checks the outputs agree.

    python scripts/bench_window_view.py --threads 1
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specpipe.models.attention_batch import AttentionBatch, extend_batch  # noqa: E402
from specpipe.models.random_tiny import build_random_tiny  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    B, L = args.batch, args.context
    pair = build_random_tiny(hidden_size=256, num_layers=4, max_position=L + 64, sliding_window=args.window)
    target = pair.target
    width = L + 16
    target.setup_kv(B * width + 1)
    table = torch.arange(1, B * width + 1).view(B, width)
    narrow = AttentionBatch.window_view

    def forward(Q: int, narrowed: bool) -> torch.Tensor:
        AttentionBatch.window_view = narrow if narrowed else (lambda self, window: self)
        batch = extend_batch(table, torch.arange(B), torch.full((B,), L), torch.full((B,), Q), Q, L + Q)
        with torch.no_grad():
            return target(ids[Q], batch)

    ids = {Q: torch.randint(0, 250, (B, Q)) for Q in (1, 12)}
    print(f"random_tiny 256x4, window {args.window}, batch {B}, {L} cached tokens, {args.threads} thread(s); "
          f"ms per forward, best of {args.repeats}x5")
    print(f"{'Q':>3} | {'all columns':>11} {'window view':>11} | ratio")
    for Q in (1, 12):
        torch.testing.assert_close(forward(Q, True), forward(Q, False), rtol=1e-4, atol=1e-4)
        ms = {True: float("inf"), False: float("inf")}
        for _ in range(args.repeats):
            for narrowed in (False, True):
                t = time.perf_counter()
                for _ in range(5):
                    forward(Q, narrowed)
                ms[narrowed] = min(ms[narrowed], (time.perf_counter() - t) / 5 * 1000)
        print(f"{Q:>3} | {ms[False]:>11.2f} {ms[True]:>11.2f} | {ms[False] / ms[True]:.1f}x")
    AttentionBatch.window_view = narrow


if __name__ == "__main__":
    main()
