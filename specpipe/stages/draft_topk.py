"""Draft top-k: turn the draft's top-K distribution into the next K branch tokens per request.

Branch `first` (step 0) only flattens and repeats; branch `later` (steps >= 1) re-ranks the K*K
children of the current K branches by cumulative path probability. A host-side dispatcher picks
the branch, so neither body branches on the step index (a compiled body would guard on it).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from specpipe.stages.base import Stage, branch


class DraftTopK(Stage):
    name = "draft_topk"

    def __init__(self, topk: int, fused: bool = False):
        self.topk = topk
        self.fused_mode = fused

    @branch
    def first(self, topk_p: Tensor, topk_index: Tensor, hidden: Tensor):
        """[B,K] probs, [B,K] ids, [B,H] hidden -> ids [B*K], hidden [B*K,H], scores [B,K], parents [B,K+1]."""
        B, K = topk_p.shape
        ids = topk_index.reshape(-1)  # [B*K] request-major, branch-minor
        hid = hidden.repeat_interleave(K, dim=0)  # [B*K, H]
        parents = torch.arange(-1, K, device=topk_p.device).expand(B, K + 1)  # [B, K+1] read-only view
        parent_branch = torch.zeros((B, K), dtype=torch.int64, device=topk_p.device)
        return ids, hid, topk_p, parent_branch, (topk_p.unsqueeze(1), topk_index, parents)

    @branch
    def later(self, topk_p: Tensor, topk_index: Tensor, hidden: Tensor, scores: Tensor):
        """[B*K,K] probs/ids of each branch's children, [B*K,H], scores [B,K] -> next K branches.

        Returns ids [B*K], hidden [B*K,H], scores [B,K], parent_branch [B,K] (which of the K current
        branches each new one extends) and tree blocks (scores [B,K,K], tokens [B,K*K], selected
        local child ids [B,K] in [0, K*K)).
        """
        K = topk_p.shape[1]
        B = scores.shape[0]
        expand = scores[:, :, None] * topk_p.view(B, K, K)  # [B, K, K] cumulative path probability
        cs_p, cs_idx = expand.view(B, K * K).topk(K, dim=-1)  # [B, K]
        tokens = topk_index.view(B, K * K)
        ids = tokens.gather(1, cs_idx).reshape(-1)  # [B*K]
        parent_branch = cs_idx // K  # [B, K]
        rows = parent_branch + torch.arange(B, device=scores.device)[:, None] * K
        hid = hidden[rows.reshape(-1)]  # [B*K, H]
        return ids, hid, cs_p, parent_branch, (expand, tokens, cs_idx)

    def fused(self, i: int, topk_p: Tensor, topk_index: Tensor, hidden: Tensor, scores: Optional[Tensor]):
        """Both steps in one function (the pre-split code): compiled whole when `fused` is on."""
        if i == 0:
            B, K = topk_p.shape
            parents = torch.arange(-1, K, device=topk_p.device).expand(B, K + 1)
            return (topk_index.reshape(-1), hidden.repeat_interleave(K, dim=0), topk_p,
                    torch.zeros((B, K), dtype=torch.int64, device=topk_p.device),
                    (topk_p.unsqueeze(1), topk_index, parents))
        return DraftTopK.later(self, topk_p, topk_index, hidden, scores)

    def __call__(self, i: int, topk_p: Tensor, topk_index: Tensor, hidden: Tensor, scores: Optional[Tensor]):
        """Dispatch on the step index (host side); later-step parent ids become global node ids."""
        K = self.topk
        if self.fused_mode:
            out = self.fused(i, topk_p, topk_index, hidden, scores)
        elif i == 0:
            out = self.first(topk_p, topk_index, hidden)
        else:
            out = self.later(topk_p, topk_index, hidden, scores)
        if i == 0:
            return out
        ids, hid, sc, pb, (s_blk, t_blk, sel) = out
        return ids, hid, sc, pb, (s_blk, t_blk, sel + (K * K * (i - 1) + K))

    def bind(self, wrap) -> None:
        """With `fused`, the single function runs under the `later` policy and `first` stays unused."""
        if self.fused_mode:
            self.fused = wrap(self.name, "later", self.fused)
        else:
            super().bind(wrap)
