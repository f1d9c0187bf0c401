"""What the numpy n-gram drafter (host-memory devices: `Device.host_memory`) saves per step against the torch one.

Times one proposal, tree layout included, both ways on the same random histories: draft=ngram's shape (topk 4,
8 deep, 12 nodes, max_n 3) and draft=suffix's (topk 4, 15 deep, 16 nodes, max_n 5, with a cache of --cache
tokens), by batch. Prints ms per call and torch / numpy as a ratio measured in this run. Both give the same trees
(tests/drafters/test_ngram_host.py).

    python scripts/bench_ngram_host.py
    python scripts/bench_ngram_host.py --batches 1 8 32 --history 2048 --threads 1
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from specpipe.drafters import ngram_host  # noqa: E402
from specpipe.drafters.ngram_trie import SEP, NgramDrafter  # noqa: E402


def time_call(fn, repeats: int) -> float:
    for _ in range(5):
        fn()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - t) / repeats)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--history", type=int, default=512, help="tokens of each request's history")
    ap.add_argument("--cache", type=int, default=8192, help="suffix cache tokens (draft=suffix's shape)")
    ap.add_argument("--vocab", type=int, default=64, help="random tokens from this many ids (small: many matches)")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    shapes = [("ngram", NgramDrafter(8, 4, 12, 1, 3), None),
              ("suffix", NgramDrafter(15, 4, 16, 1, 5),
               torch.cat([torch.randint(0, args.vocab, (args.cache - 1,), generator=g), torch.tensor([SEP])]))]
    print(f"history {args.history} tokens, {args.threads} thread(s); ms per proposal (tree layout included)")
    print(f"{'shape':>7} | {'batch':>5} | {'torch ms':>9} | {'numpy ms':>9} | torch/numpy")
    for name, d, corpus in shapes:
        c32 = None if corpus is None else corpus.to(torch.int32)
        for B in args.batches:
            ctx = torch.randint(0, args.vocab, (B, args.history), generator=g)
            lens = torch.full((B,), args.history)
            seq = lens + 7
            ctx_np, lens_np, c_np = ctx.numpy(), lens.numpy(), None if c32 is None else c32.numpy()
            a = time_call(lambda: d.propose(ctx, lens, seq, c32), args.repeats)
            b = time_call(lambda: ngram_host.tree_from_parents(*ngram_host.propose(d, ctx_np, lens_np, c_np), seq, d.S),
                          args.repeats)
            print(f"{name:>7} | {B:>5} | {a:>9.3f} | {b:>9.3f} | {a / b:.2f}x")


if __name__ == "__main__":
    main()
