"""Paged allocator: the KV pool is cut into pages of ``page_size`` slots; requests own whole pages.

Page-alignment invariant: a request's position t lives in a slot s with s % ps == t % ps, and
positions [k*ps, (k+1)*ps) share one physical page, so only a request's last page is partly used
and an extend first continues it from ``last_loc + 1``. Page size 1 works through the same API.

Differences from sglang (kv_allocators.md §1): capacity is checked *before* any kernel runs, so
OOM never launches a kernel that reads past the free list; ``num_new_pages`` may be passed by a
caller that knows it (SWA/HiSparse composites, speculative decoding) to skip the host count,
and ``debug=True`` verifies it. The kernels are a constructor choice made by the caller.
"""
from __future__ import annotations

import importlib
from typing import Optional

import torch
from torch import Tensor

from specpipe.allocators.base import KVAllocator, num_new_pages as count_new_pages

KERNELS = {"torch": "specpipe.allocators.kernels_torch",
           "triton": "specpipe.allocators.kernels_triton"}


def load_kernels(name: str):
    """Kernel module by name; importing it is deferred so a missing triton only fails on use."""
    if name not in KERNELS:
        raise ValueError(f"kernels must be one of {sorted(KERNELS)}, got {name!r}")
    return importlib.import_module(KERNELS[name])


def count_decode_pages(seq_lens: Tensor, page_size: int) -> int:
    """Requests whose new token opens a page: count((seq - 1) % ps == 0). Host sync."""
    return int(((seq_lens - 1) % page_size == 0).sum().item())


class PagedAllocator(KVAllocator):
    """Free list of page ids 1..num_pages (page 0 is the padding sink); frees prepend pages."""

    capabilities = frozenset({"alloc_extend", "alloc_decode", "num_new_pages", "backup_state", "free_page_starts"})

    def __init__(self, num_slots: int, page_size: int = 1, device: str | torch.device = "cpu",
                 debug: bool = False, kernels: str = "torch"):
        self.kernels = load_kernels(kernels)
        self.kernel_name = kernels
        super().__init__(num_slots, page_size, device, debug)

    # ---- extend / decode ----------------------------------------------------------------
    def alloc_extend(self, prefix_lens: Tensor, seq_lens: Tensor, last_loc: Tensor,
                     num_new_pages: Optional[int] = None, extend_num_tokens: Optional[int] = None
                     ) -> Optional[Tensor]:
        """Slots for positions [prefix_b, seq_b) of each request ([T] int64, request-major).

        Args:
            prefix_lens: [B] tokens already placed. seq_lens: [B] tokens after the extend.
            last_loc: [B] slot of position prefix_b - 1, or -1 for an empty prefix.
            num_new_pages: Σ ceil(seq/ps) - ceil(pre/ps) when the caller knows it (no host
                count, no sync); trusted unless ``debug``.
            extend_num_tokens: Σ (seq - pre) as a host int; counted (a sync) when None.
        Returns:
            The slots, or None (free list unchanged) when fewer than num_new_pages pages are free.
        """
        ps = self.page_size
        if extend_num_tokens is None:
            extend_num_tokens = int((seq_lens - prefix_lens).sum().item())
        if num_new_pages is None:  # page size 1: one page per token, nothing to count
            num_new_pages = extend_num_tokens if ps == 1 else count_new_pages(prefix_lens, seq_lens, ps)
        if self.debug:
            self._check_extend(prefix_lens, seq_lens, last_loc, num_new_pages, extend_num_tokens)
        if num_new_pages > self.free_pages.numel():
            return None
        out = self.kernels.alloc_extend(prefix_lens, seq_lens, last_loc, self.free_pages, ps,
                                        num_new_pages, extend_num_tokens)  # [T]
        self.free_pages = self.free_pages[num_new_pages:]
        return out

    def alloc_decode(self, seq_lens: Tensor, last_loc: Tensor,
                     num_new_pages: Optional[int] = None) -> Optional[Tensor]:
        """One slot per request for position seq_b - 1 ([B]); seq_lens include the new token.

        ``num_new_pages`` (= count((seq - 1) % ps == 0)) may be passed like in alloc_extend.
        """
        ps = self.page_size
        if num_new_pages is None:
            num_new_pages = seq_lens.numel() if ps == 1 else count_decode_pages(seq_lens, ps)
        if self.debug:
            self._check_extend(seq_lens - 1, seq_lens, last_loc, num_new_pages, seq_lens.numel())
        if num_new_pages > self.free_pages.numel():
            return None
        out = self.kernels.alloc_decode(seq_lens, last_loc, self.free_pages, ps, num_new_pages)
        self.free_pages = self.free_pages[num_new_pages:]
        return out

    def _check_extend(self, prefix_lens: Tensor, seq_lens: Tensor, last_loc: Tensor,
                      num_new_pages: int, extend_num_tokens: int) -> None:
        """Debug: the caller's counts match the lengths, and last_loc is page-aligned."""
        ps = self.page_size
        expect = count_new_pages(prefix_lens, seq_lens, ps)
        if num_new_pages != expect:
            raise AssertionError(f"num_new_pages={num_new_pages} passed, but the lengths need "
                                 f"{expect} pages (page_size={ps})")
        tokens = int((seq_lens - prefix_lens).sum().item())
        if extend_num_tokens != tokens:
            raise AssertionError(f"extend_num_tokens={extend_num_tokens} passed, lengths give {tokens}")
        if bool((seq_lens < prefix_lens).any()):
            raise AssertionError("seq_lens < prefix_lens")
        # last_loc is read only to continue a partly filled page: a page-aligned prefix may have none
        # (SWA's window pool, after the whole prefix left the window and the tail was freed back to it)
        none = last_loc <= 0
        bad = (prefix_lens > 0) & torch.where(none, prefix_lens % ps != 0, (last_loc + 1) % ps != prefix_lens % ps)
        if bool(bad.any()):
            raise AssertionError(f"last_loc not page-aligned with prefix_lens: {last_loc.tolist()}")

    # ---- free ---------------------------------------------------------------------------
    def _free_now(self, slots: Tensor) -> None:
        """Frees every page any of ``slots`` lies in; the pages are reused first (prepended)."""
        pages = torch.unique(slots.to(torch.int64) // self.page_size)  # [P] sorted, distinct
        if self.debug:
            self._check_free(pages)
        self.free_pages = torch.cat((pages, self.free_pages))

    def free_page_starts(self, first_slots: Tensor) -> None:
        """Frees whole pages given by their first slots, distinct (a caller that knows the freed range is
        page-aligned, as a verify round's commit does): `free` of every slot of those pages, in the same
        order, without `torch.unique`, whose data-dependent size reads the device back (a sync per round)."""
        if first_slots.numel() == 0 or self._group is not None:
            self.free(first_slots)  # a free group de-duplicates the lot at its end
            return
        slots = first_slots.to(torch.int64)
        pages = torch.sort(slots // self.page_size).values
        if self.debug:
            if bool((slots % self.page_size != 0).any()) or bool((pages[1:] == pages[:-1]).any()):
                raise AssertionError(f"free_page_starts: slots {slots.tolist()} are not distinct page starts")
            self._check_free(pages)
        self.free_pages = torch.cat((pages, self.free_pages))

    def _check_free(self, pages: Tensor) -> None:
        if bool(((pages < 1) | (pages > self.num_pages)).any()):
            raise AssertionError(f"freeing pages outside 1..{self.num_pages}: {pages.tolist()}")
        if bool(torch.isin(pages, self.free_pages).any()):
            raise AssertionError(f"double free of pages {pages[torch.isin(pages, self.free_pages)].tolist()}")
