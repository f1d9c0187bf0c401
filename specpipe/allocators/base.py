"""The KV-cache allocator interface every allocator implements.

Slots index the KV pools of the target and draft models. Slot 0 (page 0) is reserved as the
padding sink: padded query rows write their K/V there, so it is never handed out. Operations
never mutate the free-list tensor in place, so ``backup_state``/``restore_state`` are O(1) and
exact. Out of memory is signalled by returning ``None`` with the free set unchanged; allocators
never raise on OOM (callers decide: retract, evict or fail).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor


def num_new_pages(prefix_lens: Tensor, seq_lens: Tensor, page_size: int) -> int:
    """Pages an extend from prefix_lens to seq_lens needs: sum(ceil(seq/ps) - ceil(pre/ps)). Host sync."""
    ps = page_size
    return int(((seq_lens + ps - 1) // ps - (prefix_lens + ps - 1) // ps).sum().item())


@dataclass(frozen=True)
class PoolDemand:
    """What a run's workload asks of the KV pools, which a null allocator.num_slots is sized by (the run counts it
    before it builds the allocator: `decode.requests.pool_demand`)."""
    rows: int  # requests decoded together
    row_slots: int  # slots one request holds at full length: its prompt (page-aligned), new tokens, tree and scratch
    context: int  # the model's context: no request holds more
    hot_buffer_slots: int = 0  # device slots of one request's hot buffer (top-k sparse attention's keys, x a factor)

    @property
    def slots(self) -> int:
        """A pool for `rows` of the longest requests at full length."""
        return self.rows * self.row_slots


class KVAllocator:
    """Base class: page-granular free list of page ids 1..num_pages (page size 1 = token slots)."""

    capabilities: frozenset = frozenset()

    # ---- from config, before one is built (each allocator sizes its own pools) -----------------
    @classmethod
    def pool_sizes(cls, cfg, demand: PoolDemand) -> dict:
        """Constructor sizes standing in for null pool settings (allocator.num_slots here): the workload's.

        Sizing from the workload (rather than a fixed large pool) keeps KV memory and the pool's set-up time
        proportional to what the run can use; allocator.num_slots overrides it."""
        return {"num_slots": demand.slots}

    @classmethod
    def fit_model(cls, cfg, pair):
        """cfg with the allocator settings the loaded model decides (none here)."""
        return cfg

    @classmethod
    def check_model(cls, cfg, pair) -> None:
        """ConfigError when the loaded model cannot run under these allocator settings (any model can here)."""

    def __init__(self, num_slots: int, page_size: int = 1, device: str | torch.device = "cpu",
                 debug: bool = False):
        if page_size < 1 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two >= 1, got {page_size}")
        self.page_size = page_size
        self.num_pages = num_slots // page_size
        self.device = torch.device(device)
        self.debug = debug
        self._group: Optional[list] = None
        self.clear()

    # ---- sizes -------------------------------------------------------------------------
    @property
    def size(self) -> int:
        """Usable slots (slot/page 0 excluded)."""
        return self.num_pages * self.page_size

    @property
    def pool_slots(self) -> int:
        """Slots a KV pool indexed by this allocator must have (the reserved page included)."""
        return (self.num_pages + 1) * self.page_size

    def available(self) -> int:
        return int(self.free_pages.numel()) * self.page_size

    @property
    def main_pool(self) -> "KVAllocator":
        """The pool `kv_pool_slots` and `kv_peak_slots` describe (SWA: the full pool, not the window pool)."""
        return self

    # ---- state -------------------------------------------------------------------------
    def clear(self) -> None:
        self.free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64, device=self.device)
        self._group = None

    def backup_state(self):
        return self.free_pages

    def restore_state(self, state) -> None:
        self.free_pages = state

    # ---- alloc / free ------------------------------------------------------------------
    def alloc(self, n: int) -> Optional[Tensor]:
        """n slots (a multiple of page_size), whole pages from the front of the free list."""
        ps = self.page_size
        if n % ps:
            raise ValueError(f"alloc({n}) must be a multiple of page_size={ps}")
        need = n // ps
        if need > self.free_pages.numel():
            return None
        pages, self.free_pages = self.free_pages[:need], self.free_pages[need:]
        if ps == 1:
            return pages
        return (pages[:, None] * ps + torch.arange(ps, device=self.device)).reshape(-1)

    def alloc_extend(self, prefix_lens: Tensor, seq_lens: Tensor, last_loc: Tensor,
                     num_new_pages: Optional[int] = None, extend_num_tokens: Optional[int] = None
                     ) -> Optional[Tensor]:
        """Slots for positions [prefix_b, seq_b) of each request, request-major. See subclasses."""
        raise NotImplementedError

    def alloc_decode(self, seq_lens: Tensor, last_loc: Tensor) -> Optional[Tensor]:
        """One slot per request for position seq_b - 1 (seq_lens include the new token)."""
        return self.alloc_extend(seq_lens - 1, seq_lens, last_loc, extend_num_tokens=int(seq_lens.numel()))

    def free(self, slots: Tensor) -> None:
        if slots.numel() == 0:
            return
        if self._group is not None:
            self._group.append(slots.clone())
            return
        self._free_now(slots)

    def _free_now(self, slots: Tensor) -> None:
        raise NotImplementedError

    def free_group_begin(self) -> None:
        if self._group is not None:
            raise RuntimeError("free_group_begin called twice without free_group_end")
        self._group = []

    def free_group_end(self) -> None:
        group, self._group = self._group, None
        if group:
            self._free_now(torch.cat(group))


def allocator_class(cfg) -> type:
    """The class allocator._target_ names (validated to be a specpipe one); KVAllocator, whose sizing it then takes,
    for a target that is not a KVAllocator."""
    from hydra.utils import get_class

    try:
        cls = get_class(str(cfg.allocator._target_))
    except (ImportError, ValueError):
        return KVAllocator
    return cls if issubclass(cls, KVAllocator) else KVAllocator


def build_allocator(cfg, device, sizes: dict):
    """The configured allocator on `device`; `sizes` (`pool_sizes`) stand in for its null pool settings."""
    from hydra.utils import get_method

    from specpipe.config.build import build

    kwargs = {"device": device.torch_device}
    kwargs.update({k: v for k, v in sizes.items() if cfg.allocator.get(k) is None})
    if "kernels" in inspect.signature(get_method(str(cfg.allocator._target_))).parameters:
        kwargs["kernels"] = device.allocator_kernels
    return build(cfg.allocator, "allocator", **kwargs)
