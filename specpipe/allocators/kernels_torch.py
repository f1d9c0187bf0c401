"""Vectorised torch-native allocation kernels (CPU, NPU, any torch device).

Same contract as ``kernels_triton`` and the ``reference`` oracle: they only *read* the front of
``free_pages``; the caller has already checked that ``num_new_pages`` pages are there and slices
the free list afterwards. No per-request Python loop and no host sync: every count the output
shape depends on arrives as a host int.

Worked example (page_size 4, free_pages = [7, 9, ...]): request 0 has prefix 6, seq 11 and
last_loc 21 (page 5, offset 1). Positions 6, 7 continue its partial page (slots 22, 23);
positions 8..10 open page 7 (slots 28, 29, 30). Request 1 (prefix 0, seq 2) then takes page 9:
slots 36, 37. Output: [22, 23, 28, 29, 30, 36, 37], num_new_pages = 2.
"""
from __future__ import annotations

import torch
from torch import Tensor


def _i64(x: Tensor) -> Tensor:
    return x if x.dtype == torch.int64 else x.to(torch.int64)


def alloc_extend(prefix_lens: Tensor, seq_lens: Tensor, last_loc: Tensor, free_pages: Tensor,
                 page_size: int, num_new_pages: int, extend_num_tokens: int) -> Tensor:
    """Slots for positions [prefix_b, seq_b) of every request, request-major.

    Args:
        prefix_lens: [B] tokens that already have slots.
        seq_lens: [B] tokens after the extend.
        last_loc: [B] slot of position prefix_b - 1, or -1 when prefix_b == 0.
        free_pages: [P] free page ids; the first ``num_new_pages`` are consumed, in batch order.
    Returns:
        [extend_num_tokens] int64 slots.

    A token opens a fresh page exactly when its position is a multiple of ps, and fresh pages are
    taken in token order, so a token's free-list index is a cumsum over tokens; tokens before
    ceil_page(prefix) continue the request's partial page instead. ~20 small ops: on CPU the cost
    is per-op dispatch, which is why the arithmetic is folded (bit ops, add with alpha).
    """
    ps, T = page_size, extend_num_tokens
    if ps == 1:  # every token is a new page: the first T free ids, request-major
        return free_pages[:T]
    sh = ps.bit_length() - 1
    pre, seq, last = _i64(prefix_lens), _i64(seq_lens), _i64(last_loc)  # [B] each
    ext = seq - pre                                                      # [B]
    per_req = torch.stack((seq - ext.cumsum(0),        # position of token 0 minus its index
                           last >> sh,                  # page holding the partial last page
                           (pre + (ps - 1)) & -ps), 1)  # [B, 3] first position on a fresh page
    shift, part, lim = per_req.repeat_interleave(ext, 0, output_size=T).unbind(1)  # [T] each
    pos = torch.arange(T, device=free_pages.device) + shift                       # [T]
    off = pos & (ps - 1)                                                          # [T]
    if num_new_pages == 0:  # every token continues a partial page
        return torch.add(off, part, alpha=ps)
    # idx is -1 for partial-page tokens ahead of the batch's first fresh page: free_pages[-1]
    # is in range (num_new_pages >= 1) and torch.where discards it
    idx = (off == 0).cumsum(0) - 1                                                # [T]
    page = torch.where(pos < lim, part, free_pages[idx])                          # [T]
    return torch.add(off, page, alpha=ps)


def alloc_decode(seq_lens: Tensor, last_loc: Tensor, free_pages: Tensor, page_size: int,
                 num_new_pages: int) -> Tensor:
    """One slot per request for position seq_b - 1 ([B] int64).

    A request opens a page iff (seq_b - 1) % ps == 0 and takes free_pages[#earlier openers].
    Rows that open no page gather at index <= num_new_pages - 1 (or -1), always in range, so a
    free list of exactly ``num_new_pages`` pages is never read out of bounds (the NPU gather bug
    in kv_allocators.md §2); torch.where discards those rows.
    """
    ps = page_size
    if ps == 1:
        return free_pages[:seq_lens.numel()]
    cont = _i64(last_loc) + 1                               # [B] next slot in the current page
    if num_new_pages == 0:
        return cont
    need = ((_i64(seq_lens) - 1) & (ps - 1)) == 0           # [B]
    idx = need.cumsum(0) - 1                                # [B]
    return torch.where(need, free_pages[idx] * ps, cont)
