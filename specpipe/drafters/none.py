"""draft=none: nothing drafts. Plain decoding, one token per step, through the same runner and KV bookkeeping:
the baseline every benchmark compares against (`decode.plain.PlainPipeline`)."""
from __future__ import annotations

from typing import Optional

from specpipe.drafters.base import DraftSetup, Proposer


class NoProposer(Proposer):
    """No drafter: `build` gives none, and the run decodes plainly."""

    @classmethod
    def build(cls, cfg, pair, setup: DraftSetup) -> Optional[Proposer]:
        return None
