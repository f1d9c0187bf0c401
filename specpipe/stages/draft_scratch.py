"""Where draft-tree KV lives during one draft round: throw-away slots, handed back before verify.

Two layouts, chosen by the allocator's page size (``PrepareDecode.draft_scratch``):

``FlatScratch`` (page_size 1): B*W*K slots anywhere in the pool. Every branch's attention reads all
  draft columns of its request and the ancestry mask picks its own path, so nothing is copied.

``BranchRegions`` (page_size > 1): each request's draft tokens sit at page-aligned *virtual
  positions* after its prefix, as a page-table attention kernel needs them (slot % ps == pos % ps):
  with ``last = L % ps`` and ``P = ceil((last + W) / ps)`` pages per branch, branch k owns positions
  ``floor(L/ps)*ps + k*P*ps + [0, P*ps)``; column c of the branch (draft step c) sits at offset
  ``last + c``. Branch 0 continues the prefix's real partial last page; branches 1..K-1 get a copy
  of it (the mirror, sglang's ``move_kv_cache``), so each branch reads exactly "the prefix's whole
  pages + its own pages". One ``alloc_extend`` with ``num_new_pages = Σ (K*P - [last > 0])`` (closed
  form, host ints) reserves every region at once.

  Unlike sglang, whose branch b reads its own region even after re-ranking moved b onto another
  parent's subtree (its draft attention is ancestry-approximate), :meth:`BranchRegions.follow`
  copies the parent branch's columns into each branch before a step, so a branch's region always
  holds its exact path and the draft tree equals the page-size-1 tree token for token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from specpipe.config.validate import scratch_tokens_per_request  # noqa: F401  (the worst case, counted in config)
from specpipe.models.attention_batch import AttentionBatch
from specpipe.stages.draft_forward import draft_decode_batch


@dataclass
class FlatScratch:
    """Page size 1: columns [B, W, K] of slots; branches are told apart by the ancestry mask."""

    cols: Tensor  # [B, W, K] slot of draft column c, branch k
    prefix_slots: Tensor  # [B, Lp] the prefix (and the root, for drafters that have one)
    prefix_valid: Tensor  # [B, Lp]
    seq_lens: Tensor  # [B] position of tree column `first` (the first step after the root)
    first: int  # 1 when column 0 holds a root token shared by every branch, else 0
    state: object  # allocator state to restore after the round

    def root_slots(self) -> Tensor:
        return self.cols[:, 0, 0]

    def tensors(self) -> tuple:
        """What a compiled draft round takes in (`from_tensors` rebuilds the scratch inside it). cols is a view
        into the allocator's free list: its storage offset, guarded as 0, 1 or >= 2, would recompile, so a copy."""
        return self.cols.clone(), self.prefix_slots, self.prefix_valid, self.seq_lens

    @classmethod
    def from_tensors(cls, first: int, cols, prefix_slots, prefix_valid, seq_lens) -> "FlatScratch":
        return cls(cols, prefix_slots, prefix_valid, seq_lens, first, None)

    def begin(self, prep, kv) -> None:
        """Nothing to mirror: every branch reads the prefix through the shared table."""

    def follow(self, prep, kv, parent_branch: Tensor, step: int) -> None:
        """Nothing to copy: the ancestry mask already selects each branch's path."""

    def step_batch(self, step: int, anc: Tensor) -> AttentionBatch:
        return draft_decode_batch(self.prefix_slots, self.prefix_valid, self.cols[:, self.first:], anc, step,
                                  self.seq_lens)


@dataclass
class BranchRegions:
    """Page size > 1: one page-aligned region per (request, branch); see the module docstring."""

    region: Tensor  # [B, K, R] slots (R = max pages per branch * ps; 0 = padding past P_b*ps)
    last: Tensor  # [B] L % ps: offset of column 0 inside each region
    base: Tensor  # [B] floor(L/ps)*ps: virtual position of offset 0
    prefix_slots: Tensor  # [B, Lb] table slots of positions [0, Lb) (only < base are read)
    first: int  # columns before the tree (1: a root shared by every branch)
    state: object
    mirror_len: np.ndarray  # [B] host: last + first, the entries every branch shares
    _fixed: Optional[tuple] = None  # step_batch's per-round tensors, built on first use

    def _column(self, col: Tensor) -> Tensor:
        """[B, K] slots at region offset col [B]."""
        B, K, _ = self.region.shape
        return self.region.gather(2, col[:, None, None].expand(B, K, 1))[..., 0]

    def root_slots(self) -> Tensor:
        return self._column(self.last)[:, 0]

    def tensors(self) -> tuple:
        """What a compiled draft round takes in: `from_tensors` rebuilds the regions inside it, where `follow`'s
        copies and `step_batch` are tensor code (`begin`'s host-side mirror runs before the call)."""
        return self.region, self.last, self.base, self.prefix_slots

    @classmethod
    def from_tensors(cls, first: int, region, last, base, prefix_slots) -> "BranchRegions":
        return cls(region, last, base, prefix_slots, first, None, None)

    def begin(self, prep, kv) -> None:
        """Mirror the prefix's partial last page (and the root) from branch 0 into every branch.

        The entries are known on the host (``mirror``: the lengths last + first per request), so
        exactly those are copied.
        """
        B, K, R = self.region.shape
        n = self.mirror_len
        if K == 1 or not n.any():
            return
        per = np.repeat(n, K - 1)  # [(B)(K-1)] entries of branch k >= 1 of each request
        seg = np.repeat(np.arange(B * (K - 1)), per)
        j = np.arange(int(per.sum())) - np.repeat(np.cumsum(per) - per, per)
        b, k = seg // (K - 1), seg % (K - 1) + 1
        flat = self.region.reshape(-1)
        dev = flat.device
        tgt = flat[torch.from_numpy((b * K + k) * R + j).to(dev)]
        src = flat[torch.from_numpy(b * K * R + j).to(dev)]
        prep.move_kv(kv, tgt, src)

    def follow(self, prep, kv, parent_branch: Tensor, step: int) -> None:
        """Before tree step `step` (>= 1): each branch takes its parent's draft columns [0, step).

        Columns last + first + [0, step) lie inside every region (step < W), and a branch whose
        parent is itself copies its slots onto themselves, so the copy has a fixed size.
        """
        B, K, R = self.region.shape
        if K == 1 or step == 0:
            return
        j = (self.last + self.first)[:, None] + torch.arange(step, device=self.region.device)  # [B, step]
        cols = j[:, None, :].expand(B, K, step)
        src = self.region.gather(1, parent_branch[:, :, None].expand(B, K, R)).gather(2, cols)
        prep.move_kv(kv, self.region.gather(2, cols).reshape(-1), src.reshape(-1))

    def step_batch(self, step: int, anc: Optional[Tensor] = None) -> AttentionBatch:
        """Tree step `step`: branch k reads the prefix's whole pages and its own region up to itself."""
        B, K, R = self.region.shape
        if self._fixed is None:  # what every step of the round shares
            dev = self.region.device
            Lb = self.prefix_slots.shape[1]
            cb, j = torch.arange(Lb, device=dev), torch.arange(R, device=dev)
            kv_slots = torch.cat([self.prefix_slots, self.region.reshape(B, K * R)], 1)  # [B, Lb + K*R]
            pre = (cb[None, :] < self.base[:, None])[:, None, :].expand(B, K, Lb)
            own = torch.eye(K, dtype=torch.bool, device=dev)[None, :, :, None]  # branch k reads region k only
            kv_pos = torch.cat([cb.expand(B, Lb), (self.base[:, None] + j[None, :]).repeat(1, K)], 1)
            self._fixed = (kv_slots, pre, own, kv_pos, j)
        kv_slots, pre, own, kv_pos, j = self._fixed
        col = self.last + self.first + step  # [B] region offset written this step
        reg = own & (j[None, :] <= col[:, None])[:, None, None, :]  # [B, K, K, R]
        mask = torch.cat([pre, reg.reshape(B, K, K * R)], 2)
        positions = (self.base + col)[:, None].expand(B, K)
        return AttentionBatch(positions, self._column(col), kv_slots, mask, kv_pos)


def branch_region_slots(table: Tensor, rows_t: Tensor, L: np.ndarray, slots: Tensor, K: int, P: np.ndarray,
                        ps: int) -> Tensor:
    """[B, K, Pmax*ps] slots of every branch region from one alloc_extend's output.

    ``slots`` holds positions [L_b, base_b + K*P_b*ps) request-major; region offsets below ``last``
    in branch 0 are the prefix's own partial page (table positions [base_b, L_b)).
    """
    dev = table.device
    B = len(L)
    last = L % ps
    base = L - last
    R = int(P.max()) * ps
    k = np.arange(K)[None, :, None]
    j = np.arange(R)[None, None, :]
    v = base[:, None, None] + k * (P[:, None, None] * ps) + j  # [B, K, R] virtual position
    valid = j < P[:, None, None] * ps
    starts = np.cumsum(base + K * P * ps - L) - (base + K * P * ps - L)  # offset of each request in `slots`
    in_prefix = v < L[:, None, None]
    idx = np.where(valid & ~in_prefix, starts[:, None, None] + v - L[:, None, None], 0)
    from_new = slots[torch.from_numpy(idx.reshape(-1)).to(dev)].view(B, K, R)
    col = torch.from_numpy(np.where(in_prefix, v, 0).reshape(B, -1)).to(dev)
    from_table = table[rows_t[:, None], col].view(B, K, R)
    out = torch.where(torch.from_numpy(in_prefix).to(dev), from_table, from_new)
    return torch.where(torch.from_numpy(valid).to(dev), out, torch.zeros_like(out))
