"""Draft forwards: one tree step over B*K branch tokens, and the extend over committed tokens."""
from __future__ import annotations

import torch
from torch import Tensor

from specpipe.models.attention_batch import AttentionBatch
from specpipe.stages.base import Stage, branch


def top_k(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Softmax in float32, then the k most likely ids: probs [.., k], ids [.., k]."""
    probs = torch.softmax(logits.float(), dim=-1)
    return probs.topk(k, dim=-1)


class DraftForward(Stage):
    name = "draft_forward"
    model_branches = frozenset({"decode", "extend"})

    def __init__(self, head, topk: int):
        self.head = head
        self.topk = topk

    @branch
    def decode(self, ids: Tensor, hidden: Tensor, batch: AttentionBatch):
        """ids [B, K], hidden [B, K, H] -> topk_p [B*K, K], topk_index [B*K, K], draft hidden [B*K, H]."""
        B, K = ids.shape
        out = self.head(ids, hidden, batch, own_hidden=True)  # [B, K, H]: the head's own hidden, never fc'd
        p, idx = top_k(self.head.logits(out), self.topk)
        return p.reshape(B * K, -1), idx.reshape(B * K, -1), out.reshape(B * K, -1)

    @branch
    def extend(self, ids: Tensor, hidden: Tensor, batch: AttentionBatch, last: Tensor):
        """ids [B, Q], hidden [B, Q, H], last [B] row of the newest token -> topk_p [B,K], ids [B,K], hidden [B,H].
        A packed prefill (every prompt a segment of one row: ids [1, Q]) gives each prompt's newest position in it."""
        out = self.head(ids, hidden, batch, own_hidden=False)  # [B, Q, H] (or [1, Q, H] packed): target's
        out = out.expand(last.shape[0], -1, -1)
        h_last = out.gather(1, last[:, None, None].expand(-1, 1, out.shape[-1]))[:, 0]  # [B, H]
        p, idx = top_k(self.head.logits(h_last), self.topk)
        return p, idx, h_last


def advance_visibility(anc: Tensor, parent_branch: Tensor, step: int) -> Tensor:
    """anc [B, K, (S-1)*K]: which draft columns each branch sees. Before step `step`, each branch
    inherits its parent branch's row (parent_branch [B, K], unused at step 0) and sees itself."""
    K = anc.shape[1]
    if step > 0:
        anc = anc.gather(1, parent_branch[:, :, None].expand(-1, -1, anc.shape[2]))
    kk = torch.arange(K, device=anc.device)
    anc[:, kk, step * K + kk] = True
    return anc


def draft_decode_batch(prefix_slots: Tensor, prefix_valid: Tensor, scratch: Tensor, anc: Tensor,
                       step: int, seq_lens: Tensor) -> AttentionBatch:
    """Attention for draft step `step`: each branch sees the prefix and its own ancestors' draft tokens.

    prefix_slots/prefix_valid [B, Lp], scratch [B, S-1, K] draft slots, anc [B, K, (S-1)*K] bool.
    """
    B, _, K = scratch.shape
    Lp = prefix_slots.shape[1]
    cols = scratch.reshape(B, -1)  # [B, (S-1)*K] step-major
    kv_slots = torch.cat([prefix_slots, cols], 1)
    mask = torch.cat([prefix_valid[:, None, :].expand(B, K, Lp), anc], 2)  # [B, K, Lkv]
    positions = (seq_lens + step)[:, None].expand(B, K)
    dev = prefix_slots.device
    steps = torch.arange(cols.shape[1], device=dev) // K
    kv_pos = torch.cat([torch.arange(Lp, device=dev).expand(B, Lp), seq_lens[:, None] + steps], 1)
    return AttentionBatch(positions, scratch[:, step, :], kv_slots, mask, kv_pos)
