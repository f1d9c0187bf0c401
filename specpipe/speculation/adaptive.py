"""speculation=adaptive: verify a node only when its estimated chance of acceptance reaches speculation.min_accept.

The chance is the drafter's confidence in the node (`Proposer.node_conf`) mapped through what this run's verifies
accepted so far (`speculation.acceptance`), multiplied along the node's path: a request whose drafts stop being
accepted soon verifies its root alone, and one whose drafts are right verifies deep."""
from __future__ import annotations

from specpipe.speculation.base import Policy


class AdaptivePolicy(Policy):
    def __init__(self, s, num_draft_tokens: int, num_steps: int):
        super().__init__(s, num_draft_tokens, num_steps)
        self.min_accept = float(s.min_accept)

    def keep(self, ht, conf, limits):
        p = self.probs(ht, conf)
        return self.top_slice(p, ht.depth, limits) & (p >= self.min_accept)
