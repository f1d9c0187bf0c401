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
        from specpipe.models.eagle3 import target_forward_aux

        hidden, feats = target_forward_aux(model, tokens, batch, feature_layers)
        return model.logits(hidden), feats
    hidden = model(tokens, batch)
    return model.logits(hidden), hidden


class Verify(Stage):
    name = "verify"

    def __init__(self, target, num_steps: int, feature_layers=None):
        self.model = target
        self.num_steps = num_steps
        self.feature_layers = feature_layers  # EAGLE-3: the draft reads these layers' outputs, concatenated

    @branch
    def target_forward(self, tokens: Tensor, batch):
        """[B, N] tokens -> logits [B, N, V], features [B, N, H] for the drafter (final hidden, or aux layers)."""
        return target_features(self.model, tokens, batch, self.feature_layers)

    @branch
    def greedy(self, predict: Tensor, tokens: Tensor, parent: Tensor):
        """predict [B,N] target argmax per node, tokens [B,N], parent [B,N] ->
        accept_index [B, S+1] local nodes on the accepted path (-1 padded), accept_len [B] drafts accepted,
        commit [B, S+1] tokens committed this round (accepted drafts then the bonus; valid up to accept_len)."""
        B = tokens.shape[0]
        dev = tokens.device
        cur = torch.zeros(B, dtype=torch.int64, device=dev)
        alive = torch.ones(B, dtype=torch.bool, device=dev)
        count = torch.zeros(B, dtype=torch.int64, device=dev)
        path = [cur]
        for _ in range(self.num_steps):
            want = predict.gather(1, cur[:, None])  # [B, 1] token the target puts after cur
            match = (parent == cur[:, None]) & (tokens == want)  # [B, N] siblings hold distinct tokens
            alive = alive & match.any(-1)
            nxt = match.to(torch.int64).argmax(-1)
            cur = torch.where(alive, nxt, cur)
            count = count + alive.to(torch.int64)
            path.append(torch.where(alive, nxt, torch.full_like(nxt, -1)))
        accept_index = torch.stack(path, 1)  # [B, S+1]
        commit = predict.gather(1, accept_index.clamp(min=0))  # [B, S+1]
        return accept_index, count, commit
