"""Token allocator: page size 1, every slot allocated on its own."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from specpipe.allocators.base import KVAllocator


class TokenAllocator(KVAllocator):
    def __init__(self, num_slots: int, page_size: int = 1, device: str | torch.device = "cpu",
                 debug: bool = False):
        if page_size != 1:
            raise ValueError(f"the token allocator has page_size 1, got {page_size}")
        super().__init__(num_slots, 1, device, debug)

    def alloc_extend(self, prefix_lens: Tensor, seq_lens: Tensor, last_loc: Tensor,
                     num_new_pages: Optional[int] = None, extend_num_tokens: Optional[int] = None
                     ) -> Optional[Tensor]:
        n = extend_num_tokens if extend_num_tokens is not None else num_new_pages
        if n is None:
            n = int((seq_lens - prefix_lens).sum().item())
        if self.debug:
            expect = int((seq_lens - prefix_lens).sum().item())
            if n != expect:
                raise AssertionError(f"caller passed {n} new slots, the lengths need {expect}")
        return self.alloc(n)

    def _free_now(self, slots: Tensor) -> None:
        # appended: freed slots are reused last
        self.free_pages = torch.cat((self.free_pages, slots.to(torch.int64)))
