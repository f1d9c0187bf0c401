"""draft=none: nothing drafts. Plain decoding, one token per step, through the same runner and KV bookkeeping:
the baseline every benchmark compares against (`decode.plain.PlainPipeline`)."""
from __future__ import annotations

from typing import Optional

import torch

from specpipe.drafters.base import DraftSetup, Proposer
from specpipe.stages.tree_layout import tree_from_parents


class NoProposer(Proposer):
    """No drafter: `build` gives none, and the run decodes plainly."""

    @classmethod
    def build(cls, cfg, pair, setup: DraftSetup) -> Optional[Proposer]:
        return None


class RootOnly(Proposer):
    """draft=none with constrained requests and grammar.jump_forward: the tree is the root alone, and the grammar's
    forced chains (`grammar.tree`) are the only drafts, verified in the same forward as the next token."""

    def propose(self, pipe, rows_t, L, L_t):
        root = pipe.last_token[:, None]  # [B, 1]
        return tree_from_parents(root, torch.full_like(root, -1), L_t, pipe.S), None
