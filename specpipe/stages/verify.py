"""Greedy tree verification: walk the tree from the root, accepting the child the target agrees with.

Exactly lossless: the committed tokens are the target's own argmax continuation, because a child
is accepted only when its token equals the target's prediction at its parent, and the bonus token
is the target's prediction at the last accepted node.
"""
from __future__ import annotations

import torch
from torch import Tensor

from specpipe.stages.base import Stage, branch


def target_features(model, tokens: Tensor, batch, feature_layers=None):
    """Logits and the hidden features a drafter consumes: the final hidden, or (EAGLE-3) chosen layers."""
    if feature_layers:
        hidden, feats = model(tokens, batch, aux_layers=feature_layers)
        return model.logits(hidden), feats
    hidden = model(tokens, batch)
    return model.logits(hidden), hidden


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


class Verify(Stage):
    name = "verify"
    model_branches = frozenset({"target_forward"})

    def __init__(self, target, num_steps: int, feature_layers=None):
        self.model = target
        self.num_steps = num_steps
        self.feature_layers = feature_layers  # EAGLE-3: the draft reads these layers' outputs, concatenated

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
