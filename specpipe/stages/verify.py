"""Greedy tree verification: walk the tree from the root, accepting the child the target agrees with.

Exactly lossless: the committed tokens are the target's own argmax continuation, because a child
is accepted only when its token equals the target's prediction at its parent, and the bonus token
is the target's prediction at the last accepted node.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from specpipe.models.attention_batch import AttentionBatch, extend_batch
from specpipe.stages.base import Stage, branch, per_shape
from specpipe.stages.draft_forward import DraftForward
from specpipe.stages.finite import finite_rows
from specpipe.stages.prefill import target_hidden


def target_features(model, tokens: Tensor, batch, feature_layers=None):
    """Logits and the hidden features a drafter consumes: the final hidden, or (EAGLE-3) chosen layers."""
    final, hidden = target_hidden(model, tokens, batch, feature_layers)
    return model.logits(final), hidden


class PlainForward(Stage):
    """draft=none's step: one target forward over each request's newest token. It runs under the verify stage's
    target_forward policy (it is the step's target forward, as in the speculative pipelines), so that
    compile.verify.target_forward=compile compiles the baseline too instead of leaving it eager."""
    name = "verify"
    model_branches = frozenset({"target_forward"})

    def __init__(self, target):
        self.model = target

    @branch
    def target_forward(self, tokens: Tensor, batch) -> Tensor:
        """[B, 1] tokens -> logits [B, V]."""
        return self.model.logits(self.model(tokens, batch)[:, 0])


def tree_batch(positions: Tensor, tree_mask: Tensor, depth: Tensor, vslots: Tensor, kv_slots: Tensor,
               L_t: Tensor) -> AttentionBatch:
    """The verify forward's attention: the prefix fully visible plus the tree mask; node j sits at table position
    L_b + j (vslots [B, N] its slots), kv_slots [B, Lv] the row's table columns [0, Lv)."""
    B, N = vslots.shape
    Lv = kv_slots.shape[1]
    c = torch.arange(Lv, device=vslots.device)
    j = c[None, :] - L_t[:, None]  # [B, Lv] tree index of each column
    in_tree = (j >= 0) & (j < N)
    jc = j.clamp(0, N - 1)
    tree_vis = tree_mask.gather(2, jc[:, None, :].expand(B, N, Lv)) & in_tree[:, None, :]
    mask = (c[None, :] < L_t[:, None])[:, None, :] | tree_vis  # [B, N, Lv]
    kv_pos = torch.where(in_tree, L_t[:, None] + depth.gather(1, jc), c[None, :].expand(B, Lv))
    return AttentionBatch(positions, vslots, kv_slots, mask, kv_pos, table_columns=True)


def commit_moves(vslots: Tensor, accept_index: Tensor, count: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Where the accepted path's K/V is (src [B, S+1]) and where it is committed (tgt: the row's next positions),
    and whether nothing needs to move (in_place [B]: a chain, a tree's first branch)."""
    B, N = vslots.shape
    S1 = accept_index.shape[1]
    d = torch.arange(S1, device=vslots.device)
    src = vslots.gather(1, accept_index.clamp(min=0))
    tgt = vslots.gather(1, d.clamp(max=N - 1).expand(B, S1))
    in_place = ((src == tgt) | (d[None, :] > count[:, None])).all(1)
    return src, tgt, in_place


def round_stats(parent: Tensor, accept_index: Tensor, logits: Tensor, in_place: Tensor,
                draft_bad: Optional[Tensor]) -> Tensor:
    """[B, S+3] per request: sibling rank of each accepted node, linked draft nodes, whether the accepted
    path's K/V already sits where it is committed (`in_place`), logits finite (1 ok, 0 target NaN, 2 draft NaN:
    draft_bad [B], the drafter's scores were not finite)."""
    N = parent.shape[1]
    ar = torch.arange(N, device=parent.device)
    earlier = (parent[:, :, None] == parent[:, None, :]) & (ar[None, None, :] < ar[None, :, None])
    rank = earlier.sum(-1)  # [B, N] siblings before each node (0: the draft's first choice)
    acc_rank = rank.gather(1, accept_index[:, 1:].clamp(min=0))  # [B, S]
    linked = (parent[:, 1:] >= 0).sum(-1, keepdim=True)
    status = finite_rows(logits.flatten(1)).to(torch.int64)
    if draft_bad is not None:
        status = torch.where(draft_bad & (status == 1), torch.full_like(status, 2), status)
    return torch.cat([acc_rank, linked, in_place.to(torch.int64)[:, None], status[:, None]], 1)


class Verify(Stage):
    name = "verify"
    model_branches = frozenset({"target_forward", "round"})

    def __init__(self, target, num_steps: int, feature_layers=None):
        self.model = target
        self.num_steps = num_steps
        self.feature_layers = feature_layers  # EAGLE-3: the draft reads these layers' outputs, concatenated
        self.round = per_shape(self.round, num_steps)  # its acceptance lays out S+1 depths
        self.draft = None  # an EAGLE head's DraftForward: `round` also runs its extend over the committed tokens

    @branch
    def target_forward(self, tokens: Tensor, batch):
        """[B, N] tokens -> logits [B, N, V], features [B, N, H] for the drafter (final hidden, or aux layers)."""
        return target_features(self.model, tokens, batch, self.feature_layers)

    @branch
    def greedy(self, predict: Tensor, tokens: Tensor, parent: Tensor, mask: Tensor):
        """predict [B,N] target argmax per node, tokens [B,N], parent [B,N], mask [B,N,N] (node j sees its
        ancestors and itself) -> accept_index [B, S+1] local nodes on the accepted path (-1 padded),
        accept_len [B] drafts accepted, commit [B, S+1] tokens committed this round (accepted drafts then
        the bonus; valid up to accept_len).

        All nodes at once, not a walk of S rounds: a node matches when its token is the target's argmax at
        its parent (the first such sibling, should siblings repeat a token), and it is accepted when it and
        every ancestor match; accepted nodes form one root path, one per depth."""
        B, N = tokens.shape
        S = self.num_steps
        ar = torch.arange(N, device=tokens.device)
        ok = (parent >= 0) & (tokens == predict.gather(1, parent.clamp(min=0)))
        earlier_sibling = (parent[:, :, None] == parent[:, None, :]) & (ar[None, :] < ar[:, None])  # [B, j, k]
        ok = (ok & ~(earlier_sibling & ok[:, None, :]).any(-1)) | (ar == 0)
        on_path = ~(mask & ~ok[:, None, :]).any(-1) & mask[:, :, 0]  # [B, N], the root included
        depth = mask.sum(-1) - 1
        slot = torch.where(on_path & (depth <= S), depth, torch.full_like(depth, S + 1))
        accept_index = torch.full((B, S + 2), -1, dtype=torch.int64, device=tokens.device)
        accept_index = accept_index.scatter(1, slot, ar.expand(B, N))[:, : S + 1]  # column S+1: the rest
        count = (accept_index[:, 1:] >= 0).sum(-1)
        commit = predict.gather(1, accept_index.clamp(min=0))  # [B, S+1]
        return accept_index, count, commit

    @branch
    def round(self, tokens: Tensor, positions: Tensor, tree_mask: Tensor, parent: Tensor, depth: Tensor,
              vslots: Tensor, kv_slots: Tensor, L_t: Tensor, draft_bad: Tensor, row_table: Tensor):
        """A greedy round's verify as one function: the tree's attention batch, the target forward, greedy
        acceptance, and what the commit reads (`commit_moves`, `round_stats`). Compiled, these are one call
        instead of some 60 eager ops around it. Returns vhidden [B, N, H], accept_index, count, commit, src, tgt,
        the host row ints [B, 1 + (S+1) + S+3] (count, commit, stats) the commit reads back, and with an EAGLE
        head attached (`draft`) its extend over the committed tokens (topk_p, topk_index, hidden: the next
        round's start) and each request's new root token, else four Nones. row_table [B, C]: the requests' rows of
        the slot table (every input has the batch as its first dim).

        The extend runs before the host knows which requests stopped: a request that goes on keeps every token
        it accepted (count + 1), and a stopped one leaves the batch, so what is computed for it goes unused."""
        batch = tree_batch(positions, tree_mask, depth, vslots, kv_slots, L_t)
        logits, vhidden = target_features(self.model, tokens, batch, self.feature_layers)
        accept_index, count, commit = Verify.greedy(self, logits.argmax(-1), tokens, parent, tree_mask)
        src, tgt, in_place = commit_moves(vslots, accept_index, count)
        stats = round_stats(parent, accept_index, logits, in_place, draft_bad)
        ints = torch.cat([count[:, None], commit, stats], 1)
        if self.draft is None:
            return vhidden, accept_index, count, commit, src, tgt, ints, None, None, None, None
        H, S1 = vhidden.shape[-1], commit.shape[1]
        hid = vhidden.gather(1, accept_index.clamp(min=0)[:, :, None].expand(-1, -1, H))  # [B, S+1, H]
        rows = torch.arange(row_table.shape[0], device=row_table.device)  # row_table [B, C]: each request's slots
        ext = extend_batch(row_table, rows, L_t, count + 1, S1, kv_slots.shape[1])  # within the verify's columns
        p, idx, h = DraftForward.extend(self.draft, commit, hid, ext, count)
        root = commit.gather(1, count[:, None])[:, 0]
        return vhidden, accept_index, count, commit, src, tgt, ints, p, idx, h, root
