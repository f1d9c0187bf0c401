"""Tree building: pick the N-1 best draft candidates and lay them out as a verify tree.

Candidates carry global node ids: step 0 gives ids [0, K), step i >= 1 gives
[K + K²(i-1), K + K²i), where id K + K²(i-1) + p*K + c is child rank c of the p-th branch selected
at step i-1. Selected ids are sorted ascending, which is a topological order (parents first).
Local node 0 is the root (the last committed token); node j >= 1 is the j-th selected id.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specpipe.stages.base import Stage, branch


@dataclass
class Tree:
    tokens: Tensor  # [B, N] root then selected draft tokens
    positions: Tensor  # [B, N] seq_len + depth
    mask: Tensor  # [B, N, N] bool, node j sees node k iff k is j or an ancestor of j
    parent: Tensor  # [B, N] local parent index, -1 for the root and for unlinked nodes
    depth: Tensor  # [B, N]
    next_token: Tensor  # [B, N] first child (ascending local index) or -1
    next_sibling: Tensor  # [B, N] next sibling or -1
    retrieve_index: Tensor  # [B, N] flat verify row b*N + j


def candidates(score_list: list, token_list: list, parents_list: list) -> tuple[Tensor, Tensor, Tensor]:
    """The draft steps' blocks as one row per request: scores [B, M], tokens [B, M], parent_list [B, 1 + K(S-1)]
    (the last step's selections parent nothing)."""
    B = score_list[0].shape[0]
    scores = torch.cat([s.reshape(B, -1) for s in score_list], dim=1)
    tokens = torch.cat([t.reshape(B, -1) for t in token_list], dim=1)
    if len(parents_list) > 1:
        parent_list = torch.cat(parents_list[:-1], dim=1)
    else:
        parent_list = torch.empty((B, 0), dtype=torch.int64, device=scores.device)
    return scores, tokens, parent_list


class BuildTree(Stage):
    name = "build_tree"

    def __init__(self, topk: int, num_steps: int, num_draft_tokens: int):
        self.topk, self.num_steps, self.num_draft_tokens = topk, num_steps, num_draft_tokens

    def __call__(self, verified_id: Tensor, score_list: list, token_list: list, parents_list: list,
                 seq_lens: Tensor) -> Tree:
        return Tree(*self.build(verified_id, *candidates(score_list, token_list, parents_list), seq_lens))

    @branch
    def build(self, verified_id: Tensor, scores: Tensor, tokens: Tensor, parent_list: Tensor, seq_lens: Tensor):
        K, N = self.topk, self.num_draft_tokens
        B = verified_id.shape[0]
        dev = verified_id.device
        # the N-1 best, ties to the lower id: a node never scores above its parent and comes after it, so a kept node's
        # parent is kept too. topk breaks ties arbitrarily: a sampled chain whose draft was sure of a token (q = 1)
        # lost a node in the middle, by the value of the token drafted there, and was no longer lossless
        sel = scores.sort(dim=-1, descending=True, stable=True).indices[:, : N - 1]
        sel = sel.sort(dim=-1).values  # [B, N-1] ascending global ids
        draft = tokens.gather(1, sel)  # [B, N-1]
        if parent_list.shape[1] == 0:  # one draft step: every node is a child of the root
            pg = torch.full_like(sel, -1)
        else:
            pg = parent_list.gather(1, (sel // K).clamp(max=parent_list.shape[1] - 1))  # parent global id
            pg = torch.where(sel < K, torch.full_like(sel, -1), pg)
        eq = sel[:, None, :] == pg[:, :, None]  # [B, child, candidate parent]
        local = eq.to(torch.int64).argmax(-1) + 1
        linked = torch.where(eq.any(-1), local, torch.full_like(local, -1))  # -1: parent not selected
        parent_tail = torch.where(pg < 0, torch.zeros_like(local), linked)
        parent = torch.cat([torch.full((B, 1), -1, dtype=torch.int64, device=dev), parent_tail], 1)  # [B, N]
        ar = torch.arange(N, device=dev)
        anc = (ar[:, None] == ar[None, :]).expand(B, N, N).clone()  # [B, N, N]
        cur = parent
        for _ in range(self.num_steps):
            valid = cur >= 0
            anc |= (cur.clamp(min=0)[:, :, None] == ar) & valid[:, :, None]
            cur = torch.where(valid, parent.gather(1, cur.clamp(min=0)), cur)
        reach = anc[:, :, 0]  # linked to the root
        depth = anc.sum(-1) - 1
        positions = seq_lens[:, None] + depth
        parent = torch.where(reach, parent, torch.full_like(parent, -1))
        child = parent[:, None, :] == ar[None, :, None]  # [B, p, j]
        big = torch.full((), N, device=dev)
        first = torch.where(child, ar, big).min(-1).values
        next_token = torch.where(first < N, first, torch.full_like(first, -1))
        sib = (parent[:, :, None] == parent[:, None, :]) & (ar[None, None, :] > ar[None, :, None]) \
            & (parent[:, :, None] >= 0)
        nsib = torch.where(sib, ar, big).min(-1).values
        next_sibling = torch.where(nsib < N, nsib, torch.full_like(nsib, -1))
        retrieve = torch.arange(B, device=dev)[:, None] * N + ar
        all_tokens = torch.cat([verified_id[:, None], draft], 1)
        return all_tokens, positions, anc, parent, depth, next_token, next_sibling, retrieve
