"""Triton allocation kernels (CUDA; the tests run them under TRITON_INTERPRET=1 on CPU).

Same contract as ``kernels_torch``. One program per request; each program reduces the lengths of
the requests before it to find its output offset and its first page in ``free_pages`` (O(B²)
total work in one launch, cheaper than separate cumsum launches at decode batch sizes). Only the
page size is a compile-time constant: a run compiles each kernel once, whatever its batch sizes. Triton
is imported and the kernels are compiled on first use, so importing the allocator package never
needs triton. Capacity is checked by the caller before launch, so loads never read past the
free list.
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor

BLOCK = 1024  # tokens per loop iteration over a request's new pages: one compilation for any length
# earlier requests per loop iteration when a program sums the lengths before it: the batch size is a runtime
# value, so one compilation serves every batch (a constexpr batch bound compiled a kernel per new power of two)
BLOCK_B = 128


@functools.cache
def _kernels():
    """Builds the jitted kernels once (triton reads TRITON_INTERPRET at decoration time)."""
    try:
        import triton
        import triton.language as tl
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError("kernels='triton' needs the triton package") from e

    # free_pages is re-sliced after every allocation, so its pointer's 16-byte alignment flips;
    # not specialising on it keeps one compiled variant instead of two
    @triton.jit(do_not_specialize=["free_ptr"])
    def extend_kernel(pre_ptr, seq_ptr, last_ptr, free_ptr, out_ptr,
                      PS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_B: tl.constexpr):
        pid = tl.program_id(0)
        out_start = tl.full([], 0, tl.int64)
        page_start = tl.full([], 0, tl.int64)
        for j0 in range(0, pid, BLOCK_B):  # the requests before this one, BLOCK_B at a time
            offs = j0 + tl.arange(0, BLOCK_B)
            earlier = offs < pid
            pre_j = tl.load(pre_ptr + offs, mask=earlier, other=0).to(tl.int64)
            seq_j = tl.load(seq_ptr + offs, mask=earlier, other=0).to(tl.int64)
            out_start += tl.sum(seq_j - pre_j, axis=0)
            page_start += tl.sum((seq_j + PS - 1) // PS - (pre_j + PS - 1) // PS, axis=0)
        pre = tl.load(pre_ptr + pid).to(tl.int64)
        seq = tl.load(seq_ptr + pid).to(tl.int64)
        last = tl.load(last_ptr + pid).to(tl.int64)
        pre_up = (pre + PS - 1) // PS * PS          # first position on a new page
        # part 1: the rest of the partial last page, continuing last_loc
        n1 = tl.minimum(seq, pre_up) - pre
        k = tl.arange(0, PS)
        tl.store(out_ptr + out_start + k, last + 1 + k, mask=k < n1)
        # parts 2+3: positions [pre_up, seq) on fresh pages, whole pages then the trailing one
        n_rest = seq - pre_up
        for b in range(0, tl.cdiv(n_rest, BLOCK)):
            kk = b * BLOCK + tl.arange(0, BLOCK)
            m = kk < n_rest
            page = tl.load(free_ptr + page_start + kk // PS, mask=m, other=0)
            tl.store(out_ptr + out_start + n1 + kk, page * PS + kk % PS, mask=m)

    @triton.jit(do_not_specialize=["free_ptr"])
    def decode_kernel(seq_ptr, last_ptr, free_ptr, out_ptr, PS: tl.constexpr, BLOCK_B: tl.constexpr):
        pid = tl.program_id(0)
        page_idx = tl.full([], 0, tl.int64)
        for j0 in range(0, pid, BLOCK_B):  # the requests before this one, BLOCK_B at a time
            offs = j0 + tl.arange(0, BLOCK_B)
            earlier = offs < pid
            seq_j = tl.load(seq_ptr + offs, mask=earlier, other=0).to(tl.int64)
            opens_j = ((seq_j - 1) % PS == 0) & earlier
            page_idx += tl.sum(opens_j.to(tl.int64), axis=0)
        seq = tl.load(seq_ptr + pid).to(tl.int64)
        last = tl.load(last_ptr + pid).to(tl.int64)
        opens = (seq - 1) % PS == 0
        page = tl.load(free_ptr + page_idx, mask=opens, other=0)
        tl.store(out_ptr + pid, tl.where(opens, page * PS, last + 1))

    return extend_kernel, decode_kernel


def alloc_extend(prefix_lens: Tensor, seq_lens: Tensor, last_loc: Tensor, free_pages: Tensor,
                 page_size: int, num_new_pages: int, extend_num_tokens: int) -> Tensor:
    """[extend_num_tokens] int64 slots, request-major; see kernels_torch.alloc_extend."""
    out = torch.empty(extend_num_tokens, dtype=torch.int64, device=free_pages.device)  # [T]
    bs = prefix_lens.numel()
    if bs and extend_num_tokens:
        extend_kernel, _ = _kernels()
        extend_kernel[(bs,)](prefix_lens, seq_lens, last_loc, free_pages, out, PS=page_size, BLOCK=BLOCK,
                             BLOCK_B=BLOCK_B)
    return out


def alloc_decode(seq_lens: Tensor, last_loc: Tensor, free_pages: Tensor, page_size: int,
                 num_new_pages: int) -> Tensor:
    """[B] int64 slots for position seq_b - 1; see kernels_torch.alloc_decode."""
    bs = seq_lens.numel()
    out = torch.empty(bs, dtype=torch.int64, device=free_pages.device)  # [B]
    if bs:
        _, decode_kernel = _kernels()
        decode_kernel[(bs,)](seq_lens, last_loc, free_pages, out, PS=page_size, BLOCK_B=BLOCK_B)
    return out
