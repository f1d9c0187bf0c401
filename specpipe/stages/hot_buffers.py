"""HiSparse hot-buffer bookkeeping: which logical KV a sparse target step needs on the device.

With allocator=hisparse the target's KV pool is indexed by logical ids (the host pool); each
request owns a bounded device buffer (``HiSparseAllocator.alloc_device_buffer``) with one
``HotBuffer`` LRU per layer (a device slot holds one token of every layer, but layers pick
different keys). Every sparse target forward reports, per layer, the keys its queries selected;
the keys that forward wrote itself are produced on the device and skipped, the rest are fetched:
resident ids are hits, the others are misses that move ``token_bytes`` host -> device. On CPU host
and device are the same memory, so the move is accounting only; the counts are real.

The pipeline sizes the buffers from the model's budget (top_k + local keys per query) before the
first forward (``plan``): every row gets its buffer before it allocates, and new tokens get logical
ids only.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from specpipe.allocators.hisparse import HotBuffer


HOT_FACTOR = 4  # a row's hot buffer holds this many times the sparse attention's keys per query


def buffer_slots(budget: int, page_size: int, factor: int = HOT_FACTOR) -> int:
    """Device slots of one row's hot buffer: factor x (top_k + local) tokens, page-aligned."""
    return -(-factor * budget // page_size) * page_size


class HotBufferBook:
    def __init__(self, allocator, table: Tensor, alloc_len: np.ndarray, factor: int = HOT_FACTOR):
        self.alloc, self.table, self.alloc_len = allocator, table, alloc_len
        self.factor = factor  # buffer = factor x (top_k + local) tokens, page-aligned
        self.capacity = 0  # 0 until the first sparse forward
        self.slots: dict[int, tuple[Tensor, bool]] = {}  # row -> (device slots [C], owned by the allocator)
        self.bufs: dict[int, dict[int, HotBuffer]] = {}  # row -> layer -> LRU
        self.done = [0, 0, 0]  # hits, misses, bytes of released rows
        self.device_peak = 0  # most device-pool slots in use at once (prompts' KV and hot buffers)

    @property
    def ready(self) -> bool:
        return self.capacity > 0

    def plan(self, budget: int) -> None:
        """Size the buffers from the sparse attention's keys per query (top_k + local) before any forward, so
        the first admission, like every later one, takes logical ids bounded by the host pool rather than the
        device pool (it was bounded by num_slots: a prompt past it failed when it came first)."""
        if not self.ready and budget > 0:
            self.capacity = buffer_slots(budget, self.alloc.page_size, self.factor)

    def ensure(self, rows) -> None:
        """Give each row (that lacks one) its device buffer; the row's mapped device slots are reused."""
        ps = self.alloc.page_size
        for r in (int(x) for x in rows):
            if r in self.slots:
                continue
            ids = self.table[r, : int(self.alloc_len[r])]
            dev = self.alloc.alloc_device_buffer(ids, self.capacity)
            owned = dev is not None
            if not owned:  # device pool short: keep counting against a virtual buffer
                dev = torch.arange(ps, ps + self.capacity, device=self.table.device)
            self.slots[r] = (dev, owned)
            self.bufs[r] = {}
        self.note_device()

    def note_device(self) -> None:
        """After a take from the device pool."""
        pool = self.alloc.devpool
        self.device_peak = max(self.device_peak, pool.size - pool.available())

    def observe(self, layer: int, batch, selected: Tensor, token_bytes: int, budget: int) -> None:
        """Fetch the keys ``selected`` [B, Q, Lkv] picks (minus this forward's own) through each row's LRU."""
        self.plan(budget)
        active = np.flatnonzero(self.alloc_len > 0)
        row_of = dict(zip(self.table[torch.from_numpy(active).to(self.table.device), 0].tolist(), active.tolist()))
        own = batch.kv_positions >= batch.positions.min(1).values[:, None]  # [B, Lkv] written by this forward
        need = selected.any(1) & ~own  # [B, Lkv]
        for b, first in enumerate(batch.kv_slots[:, 0].tolist()):
            r = row_of.get(first)
            ids = batch.kv_slots[b][need[b]]
            if r is None or ids.numel() == 0:
                continue
            self.ensure([r])
            buf = self.bufs[r].get(layer)
            if buf is None:
                buf = self.bufs[r][layer] = HotBuffer(self.slots[r][0], token_bytes)
            for chunk in ids.split(buf.capacity):  # a bounded buffer serves an oversized step in parts
                buf.fetch(chunk)

    def release(self, rows) -> None:
        """Fold the rows' counters into the totals and give their device buffers back."""
        for r in (int(x) for x in rows):
            if r not in self.slots:
                continue
            for buf in self.bufs.pop(r).values():
                self.done[0] += buf.hits
                self.done[1] += buf.misses
                self.done[2] += buf.bytes_moved
            dev, owned = self.slots.pop(r)
            if owned:
                self.alloc.free_device(dev)

    def stats(self) -> dict:
        hits, misses, moved = self.done
        for layers in self.bufs.values():
            for buf in layers.values():
                hits, misses, moved = hits + buf.hits, misses + buf.misses, moved + buf.bytes_moved
        total = hits + misses
        return {"hisparse_hit_rate": hits / total if total else None, "hisparse_bytes_moved": int(moved),
                "hisparse_fetches": int(total), "hisparse_buffer_tokens": int(self.capacity),
                "hisparse_device_peak_slots": int(self.device_peak),
                "hisparse_device_pool_slots": int(self.alloc.devpool.size)}
