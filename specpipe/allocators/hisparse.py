"""HiSparse allocator: logical KV ids for a large host pool, a small device pool for hot tokens.

Top-k sparse attention (DSA/NSA) reads only top_k tokens per decode step, so the full KV can live
in a host pool ``host_to_device_ratio``× larger than the device pool; each request keeps a
bounded device hot buffer, refilled host -> device under an LRU (``HotBuffer``). The engine sees
logical ids; device pools translate them through ``mapping`` (kv_allocators.md §4).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Optional

import torch
from torch import Tensor

from specpipe.allocators.base import PoolDemand
from specpipe.allocators.paged import PagedAllocator
from specpipe.allocators.swa import PairedAllocator
from specpipe.errors import ConfigError


def check_sparse_model(pair) -> None:
    """ConfigError unless the target's attention is top-k sparse: HiSparse keeps on the device only what
    the sparse attention reads, so over a dense model it would be a paged pool with a second, unused one."""
    if pair.target.config.sparse_top_k is None:
        name = getattr(pair, "name", "") or "this model"
        raise ConfigError(f"allocator=hisparse keeps the full KV in a host pool and only the tokens that top-k "
                          f"sparse attention reads on the device, but {name!r} has dense attention (its config "
                          "sets no sparse_top_k), so every token would stay on the device; use allocator=paged or "
                          "allocator=token, or a top-k sparse model, e.g. model=random_tiny model.sparse_top_k=64")


class HiSparseAllocator(PairedAllocator):
    """Logical allocator over num_slots*ratio ids + device allocator over num_slots slots."""

    capabilities = frozenset({"alloc_extend", "alloc_decode", "num_new_pages", "backup_state",
                              "hisparse"})

    @classmethod
    def pool_sizes(cls, cfg, demand: PoolDemand) -> dict:
        """num_slots is the *device* pool and the logical (host) pool is num_slots x host_to_device_ratio, which every
        live token holds an id in and which the KV cache is sized by; so the logical pool gets the workload (what
        allocator=token's pool holds) and the device pool 1/ratio of it, but never less than a hot buffer per row."""
        ps, ratio = cfg.allocator.page_size, cfg.allocator.host_to_device_ratio
        return {"num_slots": max(-(-demand.slots // (ratio * ps)) * ps, demand.rows * demand.hot_buffer_slots)}

    @classmethod
    def check_model(cls, cfg, pair) -> None:
        check_sparse_model(pair)

    def __init__(self, num_slots: int, page_size: int = 1, host_to_device_ratio: int = 2,
                 device: str | torch.device = "cpu", debug: bool = False, kernels: str = "torch"):
        if host_to_device_ratio < 1:
            raise ValueError(f"host_to_device_ratio must be >= 1, got {host_to_device_ratio}")
        logical = PagedAllocator(num_slots * host_to_device_ratio, page_size, device, debug, kernels)
        devpool = PagedAllocator(num_slots, page_size, device, debug, kernels)
        super().__init__(logical, devpool, debug)
        self.logical, self.devpool = logical, devpool

    @property
    def device_pool_slots(self) -> int:
        """Slots the device KV pool needs (it is indexed by translated ids)."""
        return self.devpool.pool_slots

    @property
    def main_pool(self) -> PagedAllocator:
        """The logical pool: every token holds a logical id while it lives, so its use is the run's KV use. The
        device pool (`size` and `available()` take the smaller pool) holds prompts and hot buffers only; its peak
        is `hisparse_device_peak_slots`."""
        return self.logical

    # ---- alloc --------------------------------------------------------------------------
    def alloc(self, n: int) -> Optional[Tensor]:
        """n logical ids, each with a device slot; rolls the logical side back if the device fails."""
        backup = self.logical.backup_state()
        ids = self.logical.alloc(n)                  # [n]
        if ids is None:
            return None
        dev = self.devpool.alloc(n)
        if dev is None:
            self.logical.restore_state(backup)       # exact, O(1)
            return None
        self.mapping[ids] = dev
        return ids

    # alloc_extend (prefill: every new token gets a logical id and a device slot) is PairedAllocator's

    def alloc_logical_only(self, prefix_lens: Tensor, seq_lens: Tensor, last_loc: Tensor,
                           num_new_pages: Optional[int] = None,
                           extend_num_tokens: Optional[int] = None) -> Optional[Tensor]:
        """Logical ids only (KV goes straight to the host pool)."""
        return self.logical.alloc_extend(prefix_lens, seq_lens, last_loc, num_new_pages,
                                         extend_num_tokens)

    def alloc_decode(self, seq_lens: Tensor, last_loc: Tensor,
                     num_new_pages: Optional[int] = None) -> Optional[Tensor]:
        """Logical only: the coordinator places the newest token in the request's buffer page."""
        return self.logical.alloc_decode(seq_lens, last_loc, self._decode_pages(seq_lens, num_new_pages))

    def alloc_device_buffer(self, logical_ids: Tensor, need: int) -> Optional[Tensor]:
        """Turns a request's device slots into its hot buffer of exactly ``need`` slots ([need]).

        ``logical_ids`` are the request's ids from position 0 on (so its device slots start on a
        page boundary); ``need`` is page-aligned. Their mapping is cleared: the buffer slots now
        belong to the request's ``HotBuffer``. Extra whole pages are freed; a shortfall is filled
        from the rest of the last partial page, then fresh pages. None (nothing changed) if short.
        """
        ps = self.page_size
        if need % ps:
            raise ValueError(f"need={need} must be a multiple of page_size={ps}")
        dev = self.mapping[logical_ids]                                   # [N]
        dev = dev[dev > 0]                                                # [H] mapped, in order
        have = dev.numel()
        tail = (-have) % ps                                # unused slots of the last partial page
        fresh = max(need - have - tail, 0)
        if fresh > self.devpool.available():
            return None
        self._zero_pages(logical_ids.to(torch.int64) // ps)  # whole pages: no stale scratch entries
        if have >= need:
            if have > need:
                self.devpool.free(dev[need:])
            return dev[:need]
        parts = [dev]
        if tail:
            parts.append(dev[-1] + 1 + torch.arange(tail, device=self.device))
        if fresh:
            parts.append(self.devpool.alloc(fresh))
        return torch.cat(parts)[:need]

    # ---- free ---------------------------------------------------------------------------
    def _free_now(self, slots: Tensor) -> None:
        self._free_peer(slots)
        self.logical.free(slots)

    def free(self, slots: Tensor) -> None:
        """Frees at once even inside a free group: the mapping must clear immediately."""
        if slots.numel():
            self._free_now(slots)

    def free_group_begin(self) -> None:
        """No-op (see ``free``)."""

    def free_group_end(self) -> None:
        """No-op (see ``free``)."""

    def free_hisparse(self, logical_ids: Tensor) -> None:
        """Frees the device pages still mapped from ``logical_ids``; idempotent."""
        self._free_peer(logical_ids)

    def free_device(self, device_slots: Tensor) -> None:
        """Returns a hot buffer's device slots (from ``alloc_device_buffer``) to the device pool."""
        self.devpool.free(device_slots)


class HotBuffer:
    """Per-request LRU over a bounded set of device slots holding logical tokens.

    ``fetch(top_k_ids)`` returns the device slot of each requested logical id. Hits refresh
    recency; misses take a free buffer slot or evict the least recently used id not requested in
    the same call, and are loaded through ``load(logical_ids, device_slots)`` (the host -> device
    copy). Consecutive decode steps' top-k overlap heavily, so most requests are hits.
    """

    def __init__(self, device_slots: Tensor, bytes_per_token: int = 0,
                 load: Optional[Callable[[Tensor, Tensor], None]] = None):
        self.device_slots = device_slots                 # [C] owned device slots
        self.capacity = device_slots.numel()
        self.bytes_per_token = bytes_per_token
        self.load = load
        self.lru: OrderedDict[int, int] = OrderedDict()  # logical id -> buffer index, oldest first
        self.free_idx = list(range(self.capacity))
        self.hits = self.misses = self.bytes_moved = 0

    def fetch(self, logical_ids: Tensor) -> Tensor:
        """Device slots [K] for logical ids [K] (at most ``capacity`` distinct ones)."""
        ids = logical_ids.tolist()
        if len(set(ids)) > self.capacity:
            raise ValueError(f"top-k of {len(ids)} exceeds the hot buffer of {self.capacity}")
        out, missing = [0] * len(ids), []
        for i, lid in enumerate(ids):
            if lid in self.lru:
                self.lru.move_to_end(lid)
                out[i] = self.lru[lid]
            else:
                missing.append(i)
        loaded = []
        for i in missing:  # hits are at the LRU's end now, so evictions never hit this call's ids
            if ids[i] not in self.lru:  # else a duplicate of an earlier miss of this call
                idx = self.free_idx.pop() if self.free_idx else self.lru.popitem(last=False)[1]
                self.lru[ids[i]] = idx
                loaded.append(i)
            out[i] = self.lru[ids[i]]
        self.hits += len(ids) - len(loaded)
        self.misses += len(loaded)
        self.bytes_moved += len(loaded) * self.bytes_per_token
        slots = self.device_slots[torch.tensor(out, dtype=torch.int64, device=self.device_slots.device)]
        if loaded and self.load is not None:
            sel = torch.tensor(loaded, dtype=torch.int64, device=logical_ids.device)
            self.load(logical_ids[sel], slots[sel.to(slots.device)])
        return slots

    def drop(self, logical_ids: Tensor) -> None:
        """Forgets ids (e.g. rejected draft tokens) so their buffer slots are reused first."""
        for lid in logical_ids.tolist():
            idx = self.lru.pop(lid, None)
            if idx is not None:
                self.free_idx.append(idx)
