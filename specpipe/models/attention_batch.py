"""What one forward pass attends to, expressed as slot indices and a boolean mask.

Every forward of specpipe (prefill, decode, tree verify, per-branch draft steps, draft extend)
is the same computation: each query token writes its K/V into one slot of the KV pool and reads
the K/V of a list of slots, filtered by a mask. Only the mask differs between modes, so the
model has one attention path and the stages build masks with pure tensor code.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor


@dataclass
class AttentionBatch:
    positions: Tensor  # [B, Q] int64 RoPE position of each query token
    out_slots: Tensor  # [B, Q] int64 KV-pool slot each query writes (padding rows write slot 0)
    kv_slots: Tensor  # [B, Lkv] int64 slots each request reads (padding columns read slot 0)
    mask: Optional[Tensor]  # [B, Q, Lkv] bool, True where query q may attend key column k (None: see `causal`)
    kv_positions: Optional[Tensor] = None  # [B, Lkv] int64 token position of each key (sliding window)
    # every request starts at position 0 and its queries are right-padded (a fresh prefill): dense layers
    # may attend causally over this forward's own K/V instead of gathering them back from the pool
    fresh_causal: bool = False
    # a packed fresh prefill (B = 1): (start, length) of each request's queries along the row; attention stays
    # within each segment, so requests of different lengths share one forward without padding
    segments: Optional[tuple] = None
    # allocator views added by PrepareDecode.decorate (None for plain allocators):
    swa_out_slots: Optional[Tensor] = None  # [B, Q] window-pool slots of out_slots (allocator=swa)
    swa_kv_slots: Optional[Tensor] = None  # [B, Lkv] window-pool slots of kv_slots (0 = evicted/padding)
    observe: Optional[Callable] = None  # observe(layer, batch, selected [B,Q,Lkv], token_bytes, budget) (hisparse)
    # a causal extend's (query valid [B, Q], key valid [B, Lkv]): `mask` is built from these and the positions on
    # first use, since the causal kernels of a fresh prefill never read it (a long prompt's [B, T, T] stays unbuilt)
    causal: Optional[tuple] = None
    # key column c is table position c of every row (extend and verify batches; a tree's nodes sit at the row's
    # positions L_b + j): a sliding-window layer then needs only each row's last columns (`window_view`)
    table_columns: bool = False
    _read_slots: Optional[tuple] = None  # memo of read_slots()
    _window_views: Optional[dict] = None  # memo of window_view(), by window
    _dense_mask: Optional[Tensor] = None  # memo of dense_mask()
    _packed_masks: Optional[dict] = None  # memo of packed_dense_mask(), by (group size, dtype)

    def read_slots(self) -> tuple[Tensor, Optional[Tensor]]:
        """kv_slots (and swa_kv_slots) with every column no query may see re-pointed at slot 0.

        Masked columns get zero weight, but 0 * NaN is NaN: stale slots (a row's old table entries,
        another request's freed K/V) must never be read. Computed once per forward, not per layer.
        """
        if self._read_slots is None:
            if self.mask is None:  # a causal extend: a key is seen when a valid query is at or after it
                q_valid, k_valid = self.causal
                last = self.positions.masked_fill(~q_valid, -1).max(1).values  # [B]
                seen = k_valid & (self.kv_positions <= last[:, None])
            else:
                seen = self.mask.any(1)  # [B, Lkv]
            zero = torch.zeros((), dtype=self.kv_slots.dtype, device=self.kv_slots.device)
            swa = None if self.swa_kv_slots is None else torch.where(seen, self.swa_kv_slots, zero)
            self._read_slots = (torch.where(seen, self.kv_slots, zero), swa)
        return self._read_slots

    def window_view(self, window: int) -> "AttentionBatch":
        """This batch narrowed to the key columns a `window`-token sliding-window layer can see, or itself when
        that is not narrower. With table columns, the queries of row b sit at positions p_b + [0, Q) at most
        (p_b its first query's) and see keys newer than their position - window, so only columns
        [p_b - window + 1, p_b + Q) matter: a long context's windowed layers gather window + Q - 1 columns per
        row, not all of them. Built once per forward and window; read after the layer's K/V write."""
        Q, Lkv = self.positions.shape[1], self.kv_slots.shape[1]
        W = window - 1 + Q
        if not self.table_columns or self.kv_positions is None or W >= Lkv:
            return self
        if self._window_views is None:
            self._window_views = {}
        view = self._window_views.get(window)
        if view is None:
            cols = self.positions[:, :1] - (window - 1) + torch.arange(W, device=self.positions.device)  # [B, W]
            inside = (cols >= 0) & (cols < Lkv)
            cols = cols.clamp(0, Lkv - 1)
            zero = torch.zeros((), dtype=self.kv_slots.dtype, device=self.kv_slots.device)
            take = lambda x: None if x is None else torch.where(inside, x.gather(1, cols), zero)  # noqa: E731
            if self.mask is not None:
                mask, causal = self.mask.gather(2, cols[:, None, :].expand(-1, Q, -1)) & inside[:, None, :], None
            else:
                q_valid, k_valid = self.causal
                mask, causal = None, (q_valid, k_valid.gather(1, cols) & inside)
            view = AttentionBatch(self.positions, self.out_slots, take(self.kv_slots), mask,
                                  self.kv_positions.gather(1, cols), swa_out_slots=self.swa_out_slots,
                                  swa_kv_slots=take(self.swa_kv_slots), causal=causal)
            self._window_views[window] = view
        return view

    def attend_mask(self) -> Tensor:
        """`mask`, built on first use when the batch was made with `causal` parts instead."""
        if self.mask is None:
            self.mask = self.mask_rows(0, self.positions.shape[1])
        return self.mask

    def mask_rows(self, a: int, b: int) -> Tensor:
        """mask[:, a:b] (queries a..b-1), without building the rest of a causal extend's mask."""
        if self.mask is not None:
            return self.mask[:, a:b]
        q_valid, k_valid = self.causal
        return ((self.kv_positions[:, None, :] <= self.positions[:, a:b, None]) & k_valid[:, None, :]
                & q_valid[:, a:b, None])

    def dense_mask(self) -> Tensor:
        """`mask` as SDPA's [B, 1, Q, Lkv] attn_mask (see sdpa_mask), computed once per forward."""
        if self._dense_mask is None:
            self._dense_mask = sdpa_mask(self.attend_mask())
        return self._dense_mask

    def packed_dense_mask(self, groups: int, dtype: torch.dtype) -> Tensor:
        """dense_mask() with each query row repeated for the `groups` query heads of a KV group ([B, 1, G*Q, Lkv],
        `pack_group_mask`), as SDPA's additive mask of `dtype` (0 seen, -inf not: what SDPA turns a boolean mask
        into on every call). Built once per forward: in a compiled forward, every layer's conversion of the boolean
        mask recomputed the mask itself, its gathers included, inside that layer's kernel."""
        if self._packed_masks is None:
            self._packed_masks = {}
        key = (groups, dtype)
        if key not in self._packed_masks:
            seen = pack_group_mask(self.dense_mask(), groups)
            self._packed_masks[key] = torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill(
                ~seen, -math.inf)
        return self._packed_masks[key]

    @property
    def batch_size(self) -> int:
        return self.positions.shape[0]


def sdpa_mask(mask: Tensor) -> Tensor:
    """[B, Q, Lkv] -> [B, 1, Q, Lkv]; a fully masked row (a padding query) sees column 0 instead,
    since softmax over no keys is NaN."""
    col0 = torch.arange(mask.shape[-1], device=mask.device) == 0
    return (mask | (~mask.any(-1, keepdim=True) & col0))[:, None]


def pack_group_mask(mask: Tensor, groups: int) -> Tensor:
    """A [B, 1, Q, L] mask shared by the heads -> [B, 1, G*Q, L] for the G query heads of a KV group packed as
    one head's rows (`grouped_sdpa`): row r*Q + i is query i of the group's head r."""
    B, _, Q, L = mask.shape
    return mask[:, :, None].expand(B, 1, groups, Q, L).reshape(B, 1, groups * Q, L)


def extend_batch(
    req_to_token: Tensor,  # [R, C] int64 request-row -> slot table
    rows: Tensor,  # [B] int64 row of each request in req_to_token
    starts: Tensor,  # [B] int64 first position written this forward (= tokens already cached)
    lens: Tensor,  # [B] int64 number of new tokens per request (may be 0 for padding)
    q_len: int,  # padded number of query tokens (>= max(lens))
    kv_len: int,  # padded number of key columns (>= max(starts + lens))
) -> AttentionBatch:
    """Causal extend: request b adds tokens at positions [starts_b, starts_b + lens_b).

    The slots for the new tokens must already be written into req_to_token. Padding query rows
    write to slot 0 (the padding sink) and their outputs are garbage that callers ignore.
    """
    dev = req_to_token.device
    q_idx = torch.arange(q_len, device=dev)  # [Q]
    k_idx = torch.arange(kv_len, device=dev)  # [Lkv]
    positions = starts[:, None] + q_idx[None, :]  # [B, Q]
    q_valid = q_idx[None, :] < lens[:, None]  # [B, Q]
    table = req_to_token[rows]  # [B, C]
    width = table.shape[1]
    pos_clamped = positions.clamp(max=width - 1)
    out_slots = torch.where(q_valid, table.gather(1, pos_clamped), torch.zeros_like(positions))
    kv_cols = k_idx.clamp(max=width - 1)
    end = starts + lens  # [B]
    k_valid = k_idx[None, :] < end[:, None]  # [B, Lkv]
    kv_slots = torch.where(k_valid, table[:, kv_cols], torch.zeros((), dtype=table.dtype, device=dev))
    # stride 0 on the batch dim whatever B is (expand gives a size-1 dim a stride of kv_len): a compiled branch
    # guards strides, so B == 1 would otherwise get a graph of its own
    kv_positions = k_idx.as_strided((rows.shape[0], kv_len), (0, 1))
    return AttentionBatch(positions, out_slots, kv_slots, None, kv_positions, causal=(q_valid, k_valid),
                          table_columns=True)
