"""What the cross-request cache (draft=suffix) costs the proposer per step, by batch and cache size.

Times `NgramDrafter.propose` (draft=suffix's shape: topk 4, 15 deep, 16 nodes, max_n 5) on random
byte histories of --history tokens per request, with a cache of each size filled with random texts
of --text tokens, and prints ms per call and the ratio against no cache in the same run. The
matching is a scan, so the extra cost grows with batch x cache tokens; the acceptance it buys is
measured end to end by scripts/bench_vs_hf.py (draft=suffix vs draft=ngram).

    python scripts/bench_suffix_cache.py
    python scripts/bench_suffix_cache.py --batches 1 8 32 --sizes 0 4096 65536

A second table times the same propose with the other running requests' histories added to each
request's corpus (draft.running_tokens), building that corpus included.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from specpipe.drafters import NgramDrafter, pack_histories  # noqa: E402
from specpipe.drafters.suffix_cache import SuffixCache  # noqa: E402


def time_call(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(10):
            fn()
        best = min(best, (time.perf_counter() - t) / 10)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--sizes", type=int, nargs="+", default=[0, 1024, 4096, 8192, 16384])
    ap.add_argument("--history", type=int, default=320, help="own-context tokens per request")
    ap.add_argument("--text", type=int, default=64, help="tokens per cached text")
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--running", type=int, nargs="+", default=[0, 4096],
                    help="draft.running_tokens values for the second table (batches above 1)")
    ap.add_argument("--running-cache", type=int, default=8192, help="cache tokens in the second table (draft=suffix's)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    drafter = NgramDrafter(num_steps=15, topk=4, num_draft_tokens=16, min_n=1, max_n=5)
    print(f"torch {torch.__version__}, {args.threads} thread(s); own context {args.history} tokens per request, "
          f"cached texts of {args.text} tokens, vocab {args.vocab}; best of {args.repeats} x 10 calls\n")
    print("| batch | cache tokens | ms per propose | vs no cache |")
    print("|---:|---:|---:|---:|")
    for b in args.batches:
        hist = torch.randint(0, args.vocab, (b, args.history), generator=g).tolist()
        ctx, lens = pack_histories(hist)
        base = None
        for size in args.sizes:
            cache = SuffixCache(size)
            while size and len(cache) + args.text + 1 <= size:
                cache.add(torch.randint(0, args.vocab, (args.text,), generator=g).tolist())
            corpus = cache.tokens if size else None
            ms = time_call(lambda: drafter.propose(ctx, lens, lens - 1, corpus), args.repeats)
            base = ms if base is None else base
            print(f"| {b} | {len(cache)} | {ms:.3f} | {ms / base:.2f}x |", flush=True)

    # draft.running_tokens: the other running requests' histories join each request's corpus
    from specpipe.drafters.ngram import NgramProposer

    size = args.running_cache
    print(f"\nWith the running requests' histories (draft.running_tokens), a {size}-token cache:\n")
    print("| batch | running_tokens | corpus tokens per request | ms per propose (corpus built included) | vs 0 |")
    print("|---:|---:|---:|---:|---:|")
    cache = SuffixCache(size)
    while size and len(cache) + args.text + 1 <= size:
        cache.add(torch.randint(0, args.vocab, (args.text,), generator=g).tolist())
    for b in args.batches:
        if b < 2:
            continue
        hist = torch.randint(0, args.vocab, (b, args.history), generator=g).tolist()
        ctx, lens = pack_histories(hist)
        L = (lens - 1).numpy()
        base = None
        for running in args.running:
            prop = NgramProposer(4, 15, 16, 1, 5, b, args.history, "cpu", running_tokens=running)

            def call():
                corpus = prop.running_corpus(ctx, L, cache.tokens) if running else cache.tokens
                drafter.propose(ctx, lens, lens - 1, corpus)
                return corpus

            width = call().shape[-1]
            ms = time_call(call, args.repeats)
            base = ms if base is None else base
            print(f"| {b} | {running} | {width} | {ms:.3f} | {ms / base:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
