"""The grammar= group's schema: the engine that turns a request's response_format / regex / grammar into token
masks (conf/grammar/<option>.yaml names its class in specpipe/grammar/<option>.py), and what it adds to drafting.

A run without constrained requests builds nothing from it: the engine loads on the first constrained request.
"""
from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING


@dataclass
class GrammarConf:
    _target_: str = MISSING  # the engine class (the config group chooses it)
    # propose the tokens the grammar forces (`{"name": "`) as a draft chain at no model cost, ahead of the drafter's
    # own tree; with draft=none the run then verifies through the speculative loop whenever a request is constrained
    jump_forward: bool = True
    max_forced_tokens: int = 8  # longest forced chain one draft=none step verifies (drafters: their tree's depth)

    @classmethod
    def check(cls, g, errors: list) -> None:
        if g.max_forced_tokens < 1:
            errors.append(f"grammar.max_forced_tokens={g.max_forced_tokens} must be >= 1")


@dataclass
class LLGuidanceGrammarConf(GrammarConf):
    _target_: str = "specpipe.grammar.llguidance.LLGuidanceGrammar"


GRAMMAR_SCHEMAS = {"llguidance": LLGuidanceGrammarConf}
