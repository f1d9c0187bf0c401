"""Sliding-window (SWA) hybrid allocator: full-attention layers keep every token, SWA layers only
the last ``window`` tokens, in a second (smaller) pool.

The engine only ever sees *full* slots; SWA layers translate them with ``translate`` through
``mapping`` (0 = no SWA slot, 0 being the padding slot in both pools; a trailing -1 makes
``mapping[-1] == -1`` so a fresh request's ``last_loc = -1`` translates to -1). Both pools are
allocated with identical lengths, so the page count is computed once and passed to both as
``num_new_pages``, and capacity is checked on *both* before either allocates: unlike sglang, a
failed ``alloc_decode`` leaks nothing (kv_allocators.md §3, §6 item 5).
"""
from __future__ import annotations

from typing import Optional

import torch
from omegaconf import OmegaConf
from torch import Tensor

from specpipe.allocators.base import KVAllocator, PoolDemand, num_new_pages as count_new_pages
from specpipe.allocators.paged import PagedAllocator, count_decode_pages
from specpipe.config.validate import window_problems, window_row_slots
from specpipe.errors import ConfigError

SWA_PREFILL_TOKENS = 2048  # prompt tokens a null swa_num_slots leaves each row beyond its window (sglang's chunk)


def check_window_pool(pair, window: Optional[int]) -> int:
    """The window the pool keeps: `window`, or the model's sliding window (the largest of its layers') when None.
    ConfigError unless the target has sliding-window layers that it covers."""
    cfg = pair.target.config
    windows = [w for w in (cfg.window_of(i) for i in range(cfg.num_hidden_layers)) if w is not None]
    name = getattr(pair, "name", "") or "this model"
    if not windows:
        raise ConfigError(f"allocator=swa keeps a window pool for sliding-window layers, but {name!r} has no "
                          "sliding-window layers (its config sets no sliding_window, or for Qwen2/Qwen3 no "
                          "use_sliding_window with max_window_layers below num_hidden_layers); use a model with "
                          "sliding window attention, e.g. model=random_tiny model.sliding_window=64, or another "
                          "allocator (allocator=token or allocator=paged)")
    if window is not None and window < max(windows):
        raise ConfigError(f"allocator.window={window} is smaller than the model's sliding window of "
                          f"{max(windows)} tokens: the window pool would drop keys the model still attends to; "
                          f"use allocator.window>={max(windows)}, or leave it null (the model's)")
    return max(windows) if window is None else window


class PairedAllocator(KVAllocator):
    """A primary paged allocator whose slots map to slots of a peer allocator (same page size).

    Shared by SWA (full -> window pool) and HiSparse (logical -> device pool). A primary page maps
    to one peer page with equal in-page offsets, so peer frees stay page-granular.
    """

    def __init__(self, primary: PagedAllocator, peer: PagedAllocator, debug: bool = False):
        self.primary, self.peer = primary, peer
        self.page_size = primary.page_size
        self.num_pages = primary.num_pages
        self.device = primary.device
        self.debug = debug
        self.mapping = torch.zeros(primary.pool_slots + 1, dtype=torch.int64,
                                   device=self.device)  # [pool_slots + 1] primary -> peer slot
        self.clear()

    # ---- sizes / state ------------------------------------------------------------------
    @property
    def size(self) -> int:
        return min(self.primary.size, self.peer.size)

    @property
    def pool_slots(self) -> int:
        return self.primary.pool_slots

    def available(self) -> int:
        return min(self.primary.available(), self.peer.available())

    def clear(self) -> None:
        self.primary.clear()
        self.peer.clear()
        self.mapping.zero_()
        self.mapping[-1] = -1
        self._group = None

    def backup_state(self):
        return self.primary.backup_state(), self.peer.backup_state()

    def restore_state(self, state) -> None:
        """O(1) rebind of both free lists. The mapping is not rolled back; instead the pages the
        restore hands back (the front of the restored primary list) get their entries zeroed, which
        is exact for the scratch pattern backup -> allocs -> restore (EAGLE v1 draft slots)."""
        primary_state, peer_state = state
        k = primary_state.numel() - self.primary.free_pages.numel()
        if k > 0:
            self._zero_pages(primary_state[:k])
        self.primary.restore_state(primary_state)
        self.peer.restore_state(peer_state)

    def translate(self, slots: Tensor) -> Tensor:
        """Peer slots of primary slots ([N] -> [N]); 0 = none, -1 -> -1."""
        return self.mapping[slots]

    def alloc_extend(self, prefix_lens: Tensor, seq_lens: Tensor, last_loc: Tensor,
                     num_new_pages: Optional[int] = None, extend_num_tokens: Optional[int] = None
                     ) -> Optional[Tensor]:
        """Same contract as PagedAllocator.alloc_extend, on both sides; the pages are counted once
        and passed to both (identical lengths, so identical page counts)."""
        n, t = self._counts(prefix_lens, seq_lens, num_new_pages, extend_num_tokens)
        if not self._fits(n):
            return None
        peer_last = self.mapping[last_loc]           # [B]
        ids = self.primary.alloc_extend(prefix_lens, seq_lens, last_loc, n, t)      # [T]
        self.mapping[ids] = self.peer.alloc_extend(prefix_lens, seq_lens, peer_last, n, t)
        return ids

    # ---- helpers for subclasses -----------------------------------------------------------
    def _fits(self, pages: int, on_peer: bool = True) -> bool:
        """Capacity of both sides, checked before either side allocates."""
        fits = pages <= self.primary.free_pages.numel()
        return fits and (not on_peer or pages <= self.peer.free_pages.numel())

    def _counts(self, prefix_lens: Tensor, seq_lens: Tensor, num_new_pages: Optional[int],
                extend_num_tokens: Optional[int]) -> tuple[int, int]:
        """(pages, tokens) of an extend, counted once here (one host sync each at most)."""
        if extend_num_tokens is None:
            extend_num_tokens = int((seq_lens - prefix_lens).sum().item())
        if num_new_pages is None:
            ps = self.page_size
            num_new_pages = extend_num_tokens if ps == 1 else count_new_pages(prefix_lens, seq_lens, ps)
        return num_new_pages, extend_num_tokens

    def _decode_pages(self, seq_lens: Tensor, num_new_pages: Optional[int]) -> int:
        if num_new_pages is not None:
            return num_new_pages
        ps = self.page_size
        return seq_lens.numel() if ps == 1 else count_decode_pages(seq_lens, ps)

    def _zero_pages(self, pages: Tensor) -> None:
        """Clears the mapping of every slot of the given primary pages ([P])."""
        ps = self.page_size
        slots = pages[:, None] * ps + torch.arange(ps, device=self.device)  # [P, ps]
        self.mapping[slots.reshape(-1)] = 0

    def _free_peer(self, slots: Tensor) -> None:
        """Frees the peer pages of ``slots`` and zeroes their whole pages' mapping (idempotent)."""
        if slots.numel() == 0:
            return
        slots = slots.to(torch.int64)                                     # [N]
        peer = self.mapping[slots]                                        # [N]
        peer = peer[peer > 0]
        self._zero_pages(slots // self.page_size)
        if peer.numel():
            self.peer.free(peer)
        if self.debug and self.peer.available() > self.peer.size:
            raise AssertionError("peer pool over-freed: available > size")


class SWAAllocator(PairedAllocator):
    """Full pool + window pool. Hands out full slots; ``translate`` gives the window-pool slots.

    Example (ps 4, window 8): a request at seq_len 30 keeps window slots for positions >= 22;
    ``evict_outside_window`` frees positions [0, 16) (30 - 8 - 4 = 18, floored to a page).
    """

    capabilities = frozenset({"alloc_extend", "alloc_decode", "num_new_pages", "backup_state",
                              "window_evict", "free_page_starts"})

    @classmethod
    def pool_sizes(cls, cfg, demand: PoolDemand) -> dict:
        """The full pool as any allocator's; the window pool, when `swa_num_slots` is null, `demand.rows` rows of what
        one keeps there (its window, one step's draft and verify space) plus SWA_PREFILL_TOKENS of prompt; never more
        than the full pool.

        A window pool as large as the full pool saves nothing; this one stops growing with the context, so a long
        context costs sliding layers a window, not its length. A prompt up to window + 2048 tokens still prefills in
        one forward, a longer one in chunks of about 2048 (each frees what left the window before the next)."""
        ps = cfg.allocator.page_size
        row = window_row_slots(cfg, cfg.allocator.window, demand.context) + -(-SWA_PREFILL_TOKENS // ps) * ps
        full = cfg.allocator.num_slots or demand.slots
        return {"num_slots": demand.slots, "swa_num_slots": min(full, demand.rows * row)}

    @classmethod
    def fit_model(cls, cfg, pair):
        """cfg with allocator.window set to the model's sliding window where it is null (and to the model's context
        where it is larger)."""
        if cfg.allocator.window is not None:  # a request never holds more than the context: a larger window keeps the
            ctx = pair.target.config.max_position_embeddings  # same (and one past int64 overflowed numpy mid-run)
            return cfg if cfg.allocator.window <= ctx else OmegaConf.merge(cfg, {"allocator": {"window": ctx}})
        return OmegaConf.merge(cfg, {"allocator": {"window": check_window_pool(pair, None)}})

    @classmethod
    def check_model(cls, cfg, pair) -> None:
        """The model has sliding-window layers the window covers, and the window pool holds a step."""
        window = check_window_pool(pair, cfg.allocator.window)
        problems = window_problems(cfg, window, model_window=cfg.allocator.window is None,
                                   context=pair.target.config.max_position_embeddings)
        if problems:
            raise ConfigError(problems)

    def __init__(self, num_slots: int, page_size: int = 1, window: int = 4096,
                 swa_num_slots: Optional[int] = None, device: str | torch.device = "cpu",
                 debug: bool = False, kernels: str = "torch"):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        full = PagedAllocator(num_slots, page_size, device, debug, kernels)
        swa = PagedAllocator(num_slots if swa_num_slots is None else swa_num_slots, page_size,
                             device, debug, kernels)
        super().__init__(full, swa, debug)
        self.full, self.swa = full, swa

    @property
    def swa_pool_slots(self) -> int:
        return self.swa.pool_slots

    def full_available(self) -> int:
        return self.full.available()

    def swa_available(self) -> int:
        return self.swa.available()

    @property
    def main_pool(self) -> PagedAllocator:
        """The full pool: `size` and `available()` take the smaller of the two pools, and the window pool, freed as
        tokens leave the window, has its own peak (`swa_window_peak_slots`)."""
        return self.full

    # ---- alloc --------------------------------------------------------------------------
    def alloc(self, n: int) -> Optional[Tensor]:
        """n slots (a multiple of page_size) in both pools; returns the full ones ([n])."""
        if n % self.page_size:
            raise ValueError(f"alloc({n}) must be a multiple of page_size={self.page_size}")
        if not self._fits(n // self.page_size):
            return None
        full = self.full.alloc(n)                    # [n]
        self.mapping[full] = self.swa.alloc(n)
        return full

    def alloc_decode(self, seq_lens: Tensor, last_loc: Tensor,
                     num_new_pages: Optional[int] = None) -> Optional[Tensor]:
        """One full slot per request ([B]); None with neither pool touched when either is short."""
        n = self._decode_pages(seq_lens, num_new_pages)
        if not self._fits(n):
            return None
        swa_last = self.mapping[last_loc]            # [B]
        full = self.full.alloc_decode(seq_lens, last_loc, n)                        # [B]
        self.mapping[full] = self.swa.alloc_decode(seq_lens, swa_last, n)
        return full

    # ---- free ---------------------------------------------------------------------------
    def _free_now(self, slots: Tensor) -> None:
        """Full pages and whatever window pages they still hold; safe after ``free_swa``."""
        self._free_peer(slots)
        self.full.free(slots)

    def free_swa(self, full_slots: Tensor) -> None:
        """Frees the window-pool pages of ``full_slots`` ([N]); a second call is a no-op."""
        self._free_peer(full_slots)

    def free_page_starts(self, first_slots: Tensor, window: bool = True) -> None:
        """Frees whole full pages named by their first slots (distinct) and, with ``window``, their window
        pages, which must still be held (``window=False``: already evicted). The caller's host bookkeeping
        says which, so neither a mask over the mapping nor `torch.unique` reads the device back."""
        if first_slots.numel() == 0 or self._group is not None:
            self.free(first_slots)  # a free group de-duplicates the lot at its end; _free_peer skips unmapped
            return
        slots = first_slots.to(torch.int64)
        if window:
            self.free_swa_page_starts(slots)
        elif self.debug and bool((self.mapping[slots] != 0).any()):
            raise AssertionError(f"free_page_starts(window=False): slots {slots.tolist()} still hold window pages")
        self.full.free_page_starts(slots)

    def free_swa_page_starts(self, first_slots: Tensor) -> None:
        """Frees the window pages of whole full pages named by their first slots (distinct, still mapped): the
        page-granular, sync-free form of ``free_swa`` for a caller that knows the range left the window."""
        if first_slots.numel() == 0:
            return
        slots = first_slots.to(torch.int64)
        peer = self.mapping[slots]                                        # [P] window page starts
        if self.debug and bool((peer <= 0).any()):
            raise AssertionError(f"free_swa_page_starts: slots {slots.tolist()} hold no window page")
        self._zero_pages(slots // self.page_size)
        self.swa.free_page_starts(peer)

    def evict_outside_window(self, req_to_token: Tensor, seq_lens: Tensor, evicted_lens: Tensor,
                             protected_lens: Optional[Tensor] = None) -> Tensor:
        """Frees window-pool pages of tokens that left the window; returns new evicted lengths.

        Args:
            req_to_token: [B, W] full slots of each request by position (W >= seq_lens).
            seq_lens: [B] current lengths. evicted_lens: [B] prefix already evicted (page-aligned).
            protected_lens: [B] prefix owned by a prefix cache, which frees it itself.
        Returns:
            [B] new evicted lengths. The range freed is [ceil_page(max(evicted, protected)),
            floor_page(seq - window - ps)): whole pages only (paged frees release whole pages),
            with one spare page kept behind the window as sglang does for tree insertion.
        """
        ps = self.page_size
        old = evicted_lens if protected_lens is None else torch.maximum(evicted_lens, protected_lens)
        old = (old + ps - 1) // ps * ps                                  # [B]
        new = (seq_lens - self.window - ps).clamp(min=0) // ps * ps      # [B]
        cols = torch.arange(req_to_token.shape[1], device=req_to_token.device)  # [W]
        mask = (cols >= old[:, None]) & (cols < new[:, None])            # [B, W]
        self.free_swa(req_to_token[mask])
        return torch.where(new > old, new, evicted_lens)
