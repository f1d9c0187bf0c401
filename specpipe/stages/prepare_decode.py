"""Decode preparation: the request -> slot table and the KV lengths, without per-step Python churn.

Host-side lengths live in preallocated numpy arrays indexed by table row (no list growth per
step); page counts are computed once, in closed form, and passed to the allocator as
`num_new_pages`, so the allocator does no counting of its own. Each row owns positions
[0, alloc_len); the first seq_len of them hold committed KV.

Allocator-specific views, chosen by capability (never by class):
  window_evict (SWA): batches carry window-pool translations of their slots, accepted-KV moves
    translate too, and every commit frees the window-pool pages of tokens that left the window
    (``evicted`` tracks the freed prefix per row, page-aligned; ``free_swa_page_starts``, and
    ``free_page_starts(window=False)`` for an evicted prefix, so no free reads the device back).
  hisparse: sparse target forwards report their top-k selections to per-row hot buffers
    (:mod:`specpipe.stages.hot_buffers`); once buffers exist, new tokens get logical ids only.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from specpipe.allocators.hisparse import check_sparse_model
from specpipe.allocators.swa import check_window_pool
from specpipe.stages.base import Stage
from specpipe.stages.draft_scratch import BranchRegions, FlatScratch, branch_region_slots
from specpipe.stages.hot_buffers import HotBufferBook
from specpipe.stages.padding import bucket


class OutOfKVMemory(RuntimeError):
    """A step's KV reservation failed after admission had made room for it: a bookkeeping bug, not a
    full pool (a full pool retracts requests before the step starts)."""


def ranges(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flattened (segment, position) pairs of the ranges [starts_i, ends_i), segment-major."""
    counts = np.maximum(ends - starts, 0)
    total = int(counts.sum())
    seg = np.repeat(np.arange(len(counts)), counts)
    offsets = np.cumsum(counts) - counts
    pos = np.arange(total) - np.repeat(offsets, counts) + np.repeat(starts, counts)
    return seg, pos


class PrepareDecode(Stage):
    name = "prepare_decode"

    def __init__(self, allocator, max_requests: int, max_context: int, device: torch.device):
        self.alloc = allocator
        self.ps = allocator.page_size
        self.device = device
        self.table = torch.zeros((max_requests, max_context), dtype=torch.int64, device=device)  # [R, C]
        self.seq_len = np.zeros(max_requests, dtype=np.int64)  # committed KV tokens per row
        self.alloc_len = np.zeros(max_requests, dtype=np.int64)  # owned positions per row
        self.peak_used = 0
        self._free_rows = list(range(max_requests - 1, -1, -1))
        caps = getattr(allocator, "capabilities", frozenset())
        self.window = allocator.window if "window_evict" in caps else None
        self.evicted = np.zeros(max_requests, dtype=np.int64)  # window-pool prefix already freed per row
        self.evicted_tokens = 0
        self.window_peak = 0  # most window-pool slots live at once
        self.chunked = [0, 0, 0]  # prefills run in chunks: requests, target forwards, smallest chunk (tokens)
        self.hot = HotBufferBook(allocator, self.table, self.alloc_len) if "hisparse" in caps else None
        self.free_by_page = "free_page_starts" in caps  # commit names each freed page once (no de-duplication)

    @property
    def max_context(self) -> int:
        return self.table.shape[1]

    def acquire_row(self) -> Optional[int]:
        return self._free_rows.pop() if self._free_rows else None

    def release_rows(self, rows: list[int]) -> None:
        """Free every slot the rows own and hand the rows back."""
        if not rows:
            return
        r = np.asarray(rows, dtype=np.int64)
        if self.window is None:
            self._free_positions(r, np.zeros_like(r), self.alloc_len[r])
        else:  # SWA: positions before `evicted` hold full pages only, the rest window pages too
            self._free_positions(r, np.zeros_like(r), self.evicted[r], window=False)
            self._free_positions(r, self.evicted[r], self.alloc_len[r])
        if self.hot is not None:
            self.hot.release(r)
        self.seq_len[r] = 0
        self.alloc_len[r] = 0
        self.evicted[r] = 0
        self._free_rows.extend(rows)

    def reserve(self, rows: np.ndarray, need: np.ndarray) -> bool:
        """Make each row own positions [0, seq_len + need). False (nothing changed) when out of memory."""
        cur = self.alloc_len[rows]
        nxt = np.maximum(cur, self.seq_len[rows] + need)
        grow = nxt > cur
        if not grow.any():
            return True
        r, c, n = rows[grow], cur[grow], nxt[grow]
        ps = self.ps
        pages = int(((n + ps - 1) // ps - (c + ps - 1) // ps).sum())  # closed form, host ints only
        r_t = torch.from_numpy(r).to(self.device)
        c_t = torch.from_numpy(c).to(self.device)
        slots = self._extend(r)(c_t, torch.from_numpy(n).to(self.device), self._last_loc(r_t, c_t),
                                num_new_pages=pages, extend_num_tokens=int((n - c).sum()))
        if slots is None:
            return False
        seg, pos = ranges(c, n)
        self.table[torch.from_numpy(r[seg]).to(self.device), torch.from_numpy(pos).to(self.device)] = slots
        self.alloc_len[r] = n
        self.note_peak()
        return True

    def window_prefill_pages(self, lens: np.ndarray, chunk: int) -> tuple[np.ndarray, int]:
        """SWA: window-pool pages fresh rows hold while a prefill of `lens` runs `chunk` tokens at a time, freeing
        after each chunk the pages that left the window (``after_commit``'s rule): ([B] each row's peak, the
        group's peak, chunks running in lockstep). Host arithmetic mirroring reserve / commit / after_commit."""
        ps, lens = self.ps, np.asarray(lens, dtype=np.int64)
        starts = np.arange(0, int(lens.max()), chunk, dtype=np.int64)[:, None]  # [K, 1]
        prev, end = np.minimum(lens, starts), np.minimum(lens, starts + chunk)  # [K, B]
        evicted = np.maximum(prev - self.window - ps, 0) // ps
        held = -(-end // ps) - evicted  # a row done with its prompt (prev == end) holds what after_commit left
        return held.max(0), int(held.sum(1).max())

    def note_chunked(self, requests: int, forwards: int, chunk: int) -> None:
        """A prefill ran in chunks (the window pool could not hold it whole): counted for metrics.json and the
        summary's note, since a small chunk means many forwards (a tight swa_num_slots costs prefill time)."""
        self.chunked[0] += requests
        self.chunked[1] += forwards
        self.chunked[2] = min(self.chunked[2] or chunk, chunk)

    def note_peak(self) -> None:
        """After a take from the pool (a reservation, or a draft round's scratch, which holds slots too)."""
        pool = self.alloc.main_pool
        self.peak_used = max(self.peak_used, pool.size - pool.available())
        if self.window is not None:
            self.window_peak = max(self.window_peak, self.alloc.swa.size - self.alloc.swa_available())
        if self.hot is not None:
            self.hot.note_device()

    @property
    def logical_only(self) -> bool:
        """Hot buffers exist (hisparse): rows read through them, so allocations take logical ids only."""
        return self.hot is not None and self.hot.ready

    def available(self) -> int:
        """Slots the next allocations can take: once hot buffers exist (hisparse), `reserve` takes logical ids
        only (a row's device slots are its hot buffer, virtual when the device pool is short), so the device
        pool's free slots do not bound it."""
        if self.logical_only:
            return self.alloc.logical.available()
        return self.alloc.available()

    def _last_loc(self, rows_t: Tensor, lens: Tensor) -> Tensor:
        """[B] slot of each row's position lens_b - 1, or -1 for an empty row (alloc_extend's last_loc)."""
        return torch.where(lens > 0, self.table[rows_t, (lens - 1).clamp(min=0)], torch.full_like(lens, -1))

    def _extend(self, rows: np.ndarray):
        """The allocator's extend for these rows: once hot buffers exist (hisparse), logical ids only."""
        if self.logical_only:
            self.hot.ensure(rows)
            return self.alloc.alloc_logical_only
        return self.alloc.alloc_extend

    def slots(self, rows_t: Tensor, starts: Tensor, width: int) -> Tensor:
        """[B, width] slots of positions starts_b + [0, width)."""
        cols = starts[:, None] + torch.arange(width, device=self.device)
        return self.table[rows_t[:, None], cols.clamp(max=self.max_context - 1)]

    def draft_scratch(self, rows: np.ndarray, rows_t: Tensor, L: np.ndarray, L_t: Tensor, topk: int, width: int,
                      root: bool = False):
        """Throw-away slots for one draft round of `width` columns per branch, or None on OOM.

        Page size 1: a flat block (`FlatScratch`); larger pages: page-aligned per-branch regions with
        the prefix's partial page mirrored (`BranchRegions`). With ``root``, column 0 is a token shared
        by every branch (a standalone draft's root at position L), and the tree starts at column 1.
        The allocator state is saved first; `end_scratch(sc.state)` hands every slot back.
        """
        ps, B, dev = self.ps, len(L), self.device
        first = int(root)
        flat = ps == 1 or width + first == 0  # nothing to hold (one draft step): no pages, as the budget assumed
        extend = None if flat else self._extend(rows)  # before the backup: hot buffers are not scratch
        state = self.alloc.backup_state()
        if flat:
            n = B * width * topk
            take = self.alloc.logical.alloc if self.logical_only else self.alloc.alloc
            slots = take(n) if n else torch.empty(0, dtype=torch.int64, device=dev)  # (hisparse: logical ids)
            if slots is None:
                return None
            self.note_peak()
            Lp = bucket(int(L.max()) + first)
            prefix = self.slots(rows_t, torch.zeros_like(L_t), Lp)
            cols = slots.view(B, width, topk)
            if root:  # the root's slot stands in for table position L
                prefix = prefix.scatter(1, L_t[:, None], cols[:, 0, :1])
            valid = torch.arange(Lp, device=dev)[None, :] < (L_t + first)[:, None]
            return FlatScratch(cols, prefix, valid, L_t + first, first, state)
        last = L % ps
        base = L - last
        P = -(-(last + width) // ps)  # pages per branch
        end = base + topk * P * ps  # virtual end of the last branch's region
        pages = int((topk * P - (last > 0)).sum())  # closed form: Σ ceil(end/ps) - ceil(L/ps)
        slots = extend(L_t, torch.from_numpy(end).to(dev), self._last_loc(rows_t, L_t), num_new_pages=pages,
                       extend_num_tokens=int((end - L).sum()))
        if slots is None:
            return None
        self.note_peak()
        region = branch_region_slots(self.table, rows_t, L, slots, topk, P, ps)
        prefix = self.slots(rows_t, torch.zeros_like(L_t), bucket(int(base.max())))
        return BranchRegions(region, torch.from_numpy(last).to(dev), torch.from_numpy(base).to(dev), prefix,
                             first, state, last + first)

    def batch_view_problem(self) -> str:
        """Why attention batches need host-side views added here (`decorate`), '' when they do not: a function that
        builds its batch inside (a compiled round) cannot run here then."""
        if self.window is not None:
            return "the SWA window pool's slots are translated for every batch"
        if self.hot is not None:
            return "hisparse's hot buffers observe every batch"
        return ""

    def end_scratch(self, state) -> None:
        self.alloc.restore_state(state)

    # ---- allocator-specific views (hooks; plain allocators need none) ---------------------
    def decorate(self, batch):
        """Add allocator-specific views to an AttentionBatch: window-pool slots (SWA), the hot-buffer hook."""
        if self.window is not None:
            tr = self.alloc.translate
            batch = replace(batch, swa_out_slots=tr(batch.out_slots), swa_kv_slots=tr(batch.kv_slots))
        if self.hot is not None:
            batch = replace(batch, observe=self.hot.observe)
        return batch

    def move_kv(self, pool, tgt: Tensor, src: Tensor) -> None:
        """Copy accepted K/V from tree slots to contiguous slots in every pool the allocator feeds."""
        if self.window is not None:
            pool.move(tgt, src, self.alloc.translate(tgt), self.alloc.translate(src))
        else:
            pool.move(tgt, src)

    def after_commit(self, rows: np.ndarray) -> None:
        """SWA: free the window-pool pages of tokens that left the window (never the last window + ps).

        The arithmetic of ``evict_outside_window`` (new = floor_page(seq - window - ps)) runs on the host, which
        names each freed page once by its first position: no mask over the table, no device read-back.
        """
        if self.window is None or len(rows) == 0:
            return
        ps = self.ps
        seq, old = self.seq_len[rows], self.evicted[rows]
        new = np.maximum(seq - self.window - ps, 0) // ps * ps
        go = new > old
        if not go.any():
            return
        r = rows[go]
        seg, pos = ranges(old[go], new[go])
        first = pos % ps == 0
        seg, pos = seg[first], pos[first]
        self.alloc.free_swa_page_starts(self.table[torch.from_numpy(r[seg]).to(self.device),
                                                   torch.from_numpy(pos).to(self.device)])
        self.evicted_tokens += int((new - old)[go].sum())
        self.evicted[r] = new[go]

    def stats(self) -> dict:
        """Allocator-specific counters for metrics.json (merged into the run summary)."""
        out = {}
        if self.window is not None:
            out.update(swa_chunked_prefills=self.chunked[0], swa_prefill_chunk_forwards=self.chunked[1],
                       swa_prefill_chunk_min_tokens=self.chunked[2] or None)
            out.update(swa_window=self.window, swa_window_pool_slots=self.alloc.swa.size,
                       swa_evicted_tokens=self.evicted_tokens, swa_window_peak_slots=self.window_peak,
                       kv_window_leaked_slots=self.alloc.swa.size - self.alloc.swa_available(),
                       kv_full_leaked_slots=self.alloc.full.size - self.alloc.full_available())
        if self.hot is not None:
            out.update(self.hot.stats())
        return out

    def commit(self, rows: np.ndarray, new_seq: np.ndarray) -> None:
        """Record committed lengths; free owned pages that lie wholly past the committed tokens."""
        ps = self.ps
        self.seq_len[rows] = new_seq
        keep = np.minimum(-(-new_seq // ps) * ps, self.alloc_len[rows])
        self._free_positions(rows, keep, self.alloc_len[rows])
        self.alloc_len[rows] = keep

    def _free_positions(self, rows: np.ndarray, start: np.ndarray, end: np.ndarray, **how) -> None:
        """Free the slots of positions [start, end) of each row; `start` is page-aligned, so a paged pool is
        told each page once, by its first position (host arithmetic: no de-duplication on the device).
        `how` goes to ``free_page_starts`` (SWA: ``window=False`` for evicted positions)."""
        seg, pos = ranges(start, end)
        if self.free_by_page:
            first = pos % self.ps == 0
            seg, pos = seg[first], pos[first]
        if len(pos):
            slots = self.table[torch.from_numpy(rows[seg]).to(self.device), torch.from_numpy(pos).to(self.device)]
            if self.free_by_page:
                self.alloc.free_page_starts(slots, **how)
            else:
                self.alloc.free(slots)


def target_kv_layout(pair, allocator) -> dict:
    """``setup_kv`` keyword arguments for the target under ``allocator``; ConfigError when they don't fit.

    Called where the model pair and the allocator meet (``run.run``, right after ``build_allocator``).
    SWA: the target's sliding layers get a window pool of ``swa_pool_slots``; a model without sliding
    layers, or an allocator window smaller than the model's (the pool would free keys the model still
    reads), is an error. HiSparse: the target reports its sparse selections to the hot buffers (a dense
    target is an error).
    """
    caps = getattr(allocator, "capabilities", frozenset())
    if "window_evict" in caps:
        check_window_pool(pair, allocator.window)
        return {"window_slots": allocator.swa_pool_slots}
    if "hisparse" in caps:
        check_sparse_model(pair)
        return {"track_selection": True}
    return {}
