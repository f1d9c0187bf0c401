"""The per-round NaN/inf check over the verify logits: `torch.isfinite(x).all(-1)` vs `pipeline.finite_rows`.

Every round reads whether each request's logits are finite (a NaN stops only that request); at a real vocabulary
that check runs over B x N x V values on the host thread of a CPU run.

    python scripts/bench_finite_check.py            # 1 thread; batch 1 and 8, 12 tree nodes, vocab 258 to 128k
"""
from __future__ import annotations

import argparse
import sys
import timeit
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def best_us(fn, number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--nodes", type=int, default=12)
    opt = ap.parse_args()
    torch.set_num_threads(opt.threads)
    from specpipe.stages.finite import finite_rows

    print(f"{torch.get_num_threads()} thread(s), {opt.nodes} tree nodes per request, float32 logits")
    print(f"{'batch':>5} | {'vocab':>6} | {'isfinite.all us':>15} | {'finite_rows us':>14} | ratio")
    for B in (1, 8):
        for V in (258, 32000, 128256):
            x = torch.randn(B, opt.nodes * V)
            assert torch.equal(finite_rows(x), torch.isfinite(x).all(-1))
            n = max(3, int(2e6 // x.numel()))
            old = best_us(lambda: torch.isfinite(x).all(-1), n)
            new = best_us(lambda: finite_rows(x), n)
            print(f"{B:>5} | {V:>6} | {old:>15.1f} | {new:>14.1f} | {old / new:.2f}x")


if __name__ == "__main__":
    main()
