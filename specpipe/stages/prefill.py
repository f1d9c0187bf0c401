"""The target's forward over fresh prompts, as a branch the compile policy can compile.

A prompt's forward is compute-bound (its matmuls run near the core's peak either way), but eager it also pays
one op dispatch per norm, rotary, activation and residual, and the Python of every layer: 15-20% of a
300-token prefill of the shipped pair on one CPU thread. Compiled, those fuse. Only the padded form (one row
per request, causal over its own K/V) runs here: a packed prefill's segment bounds are Python ints that a
graph would specialize on (one graph per set of prompt lengths), and a chunked SWA prefill attends to what
earlier chunks cached; both stay eager.
"""
from __future__ import annotations

from torch import Tensor

from specpipe.stages.base import Stage, branch


def target_hidden(model, ids: Tensor, batch, feature_layers=None) -> tuple[Tensor, Tensor]:
    """The target's final hidden and the features a drafter reads: the final hidden itself, or (EAGLE-3) the
    chosen layers' outputs."""
    if feature_layers:
        return model(ids, batch, aux_layers=feature_layers)
    final = model(ids, batch)
    return final, final


class PrefillForward(Stage):
    name = "prefill"
    model_branches = frozenset({"target_forward"})

    def __init__(self, target, feature_layers=None):
        self.model = target
        self.feature_layers = feature_layers  # EAGLE-3: the drafter reads these layers' outputs

    @branch
    def target_forward(self, ids: Tensor, batch, last: Tensor):
        """ids [B, T] right-padded prompts, last [B] each one's newest position -> (hidden [B, T, H]: what the
        drafter reads (the final hidden, or EAGLE-3's chosen layers), logits [B, V] at the newest tokens)."""
        final, hidden = target_hidden(self.model, ids, batch, self.feature_layers)
        newest = final.gather(1, last[:, None, None].expand(-1, 1, final.shape[-1]))[:, 0]
        return hidden, self.model.logits(newest)
