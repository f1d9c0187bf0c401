"""Host cost of PagedAllocator.alloc_extend with num_new_pages passed vs counted by the allocator.

Why: a caller that already knows the page count (SWA/HiSparse composites, speculative decoding)
skips the host count, which on an accelerator is a device->host sync per call. On CPU the count is
a handful of small tensor ops; this measures what passing it saves. The workload is the EAGLE v1
draft extend: every request grows from its length s to s + steps, and the allocator state is
restored after each call, so every call sees the same free list.

    .venv/bin/python scripts/bench_alloc.py
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specpipe.allocators import PagedAllocator, num_new_pages  # noqa: E402


def setup(batch: int, ps: int, steps: int, seed: int = 0):
    """An allocator holding `batch` requests of random length, and the draft extend's arguments."""
    rng = random.Random(seed)
    lens = [rng.randint(1, 1024) for _ in range(batch)]
    alloc = PagedAllocator(64 * 1024 * ps, ps)
    z = torch.zeros(batch, dtype=torch.int64)
    rows = alloc.alloc_extend(z, torch.tensor(lens), z - 1, extend_num_tokens=sum(lens))  # [Σ lens]
    ends = torch.tensor(lens).cumsum(0) - 1                                            # [B]
    pre = torch.tensor(lens)                                                           # [B]
    return alloc, (pre, pre + steps, rows[ends]), batch * steps


def time_us(alloc, args, tokens: int, pages, iters: int, repeats: int = 5) -> float:
    """Median over repeats of the mean host µs per alloc_extend (state restored after each)."""
    state, best = alloc.backup_state(), []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            alloc.alloc_extend(*args, num_new_pages=pages, extend_num_tokens=tokens)
            alloc.restore_state(state)
        best.append((time.perf_counter() - t0) / iters * 1e6)
    return statistics.median(best)


def prep_step_us(batch: int, ps: int, num_draft_tokens: int, iters: int) -> float:
    """Host µs of one decode-preparation step: reserve the verify tree's slots, then commit a few
    accepted tokens and free whole pages past them (what PrepareDecode does every round)."""
    import numpy as np

    from specpipe.stages.prepare_decode import PrepareDecode

    rng = random.Random(1)
    alloc = PagedAllocator(64 * 1024 * ps, ps)
    prep = PrepareDecode(alloc, batch, 4096, torch.device("cpu"))
    rows = np.asarray([prep.acquire_row() for _ in range(batch)], dtype=np.int64)
    prep.reserve(rows, np.asarray([rng.randint(1, 1024) for _ in range(batch)], dtype=np.int64))
    prep.commit(rows, prep.alloc_len[rows].copy())
    need = np.full(batch, num_draft_tokens, dtype=np.int64)
    accepted = np.asarray([rng.randint(1, 4) for _ in range(batch)], dtype=np.int64)
    t0 = time.perf_counter()
    for _ in range(iters):
        seq = prep.seq_len[rows].copy()
        prep.reserve(rows, need)
        prep.commit(rows, seq + accepted)
        if int(prep.seq_len[rows].max()) > 3000:  # stay inside the table: start the requests over
            prep.release_rows(rows.tolist())
            rows = np.asarray([prep.acquire_row() for _ in range(batch)], dtype=np.int64)
    return (time.perf_counter() - t0) / iters * 1e6


def draft_scratch_us(batch: int, ps: int, topk: int, width: int, iters: int) -> float:
    """Host µs of one round's draft scratch: reserve, mirror, follow per step, build each step's
    attention batch, hand back (flat slots at page size 1, page-aligned branch regions above)."""
    import numpy as np

    from specpipe.allocators import TokenAllocator
    from specpipe.models.attention import KVPool
    from specpipe.stages.prepare_decode import PrepareDecode

    rng = random.Random(2)
    alloc = TokenAllocator(64 * 1024) if ps == 1 else PagedAllocator(64 * 1024, ps)
    prep = PrepareDecode(alloc, batch, 2048, torch.device("cpu"))
    pool = KVPool(1, alloc.pool_slots, 2, 64, torch.float32)  # one draft layer, like an EAGLE head
    rows = np.asarray([prep.acquire_row() for _ in range(batch)], dtype=np.int64)
    L = np.asarray([rng.randint(1, 1000) for _ in range(batch)], dtype=np.int64)
    prep.reserve(rows, L)
    prep.commit(rows, L)
    rows_t, L_t = torch.from_numpy(rows), torch.from_numpy(L)
    anc = torch.ones((batch, topk, width * topk), dtype=torch.bool)
    parent = torch.zeros((batch, topk), dtype=torch.int64)
    t0 = time.perf_counter()
    for _ in range(iters):
        sc = prep.draft_scratch(rows, rows_t, L, L_t, topk, width)
        sc.begin(prep, pool)
        for i in range(width):
            sc.follow(prep, pool, parent, i)
            sc.step_batch(i, anc)
        prep.end_scratch(sc.state)
    return (time.perf_counter() - t0) / iters * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4, help="draft steps per request")
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--draft-tokens", type=int, default=8, help="verify tree size for the decode-prep step")
    opt = ap.parse_args()
    torch.set_num_threads(1)
    print(f"PagedAllocator.alloc_extend, page_size={opt.page_size}, steps={opt.steps}, "
          f"torch kernels, {torch.get_num_threads()} thread")
    print(f"{'batch':>5} | {'computed µs':>11} | {'passed µs':>9} | {'ratio':>5}")
    print("-" * 41)
    for batch in (1, 16, 64):
        alloc, args, tokens = setup(batch, opt.page_size, opt.steps)
        n = num_new_pages(args[0], args[1], opt.page_size)
        time_us(alloc, args, tokens, n, opt.iters // 10)                          # warm-up
        computed = time_us(alloc, args, tokens, None, opt.iters)
        passed = time_us(alloc, args, tokens, n, opt.iters)
        print(f"{batch:>5} | {computed:>11.1f} | {passed:>9.1f} | {computed / passed:>4.2f}x")
    print(f"\nPrepareDecode step (reserve a {opt.draft_tokens}-node verify tree, commit, free pages), "
          f"page_size={opt.page_size}")
    print(f"{'batch':>5} | {'host µs':>8}")
    for batch in (1, 16, 64):
        print(f"{batch:>5} | {prep_step_us(batch, opt.page_size, opt.draft_tokens, opt.iters // 4):>8.1f}")
    w = opt.steps - 1
    print(f"\nDraft scratch per round (topk=4, {w} draft columns per branch): flat slots (page_size=1) vs "
          f"page-aligned branch regions with mirror and parent copies (page_size={opt.page_size})")
    print(f"{'batch':>5} | {'flat µs':>8} | {'regions µs':>10} | {'ratio':>5}")
    for batch in (1, 16, 64):
        flat = draft_scratch_us(batch, 1, 4, w, opt.iters // 8)
        regions = draft_scratch_us(batch, opt.page_size, 4, w, opt.iters // 8)
        print(f"{batch:>5} | {flat:>8.1f} | {regions:>10.1f} | {regions / flat:>4.2f}x")


if __name__ == "__main__":
    main()
