"""What a `draft=` option plugs into the speculative loop, and what every drafter shares.

A drafter is one class in specpipe/drafters/<option>.py, named by its schema's `_target_`
(`config.drafts`); the run builds it with `build(cfg, pair, setup)` and hands it to
`decode.speculative.SpecPipeline`, which calls, per request batch:
  join(pipe, reqs, pf, first)                                   after the target prefill (`decode.prefill.Prefill`)
  keep(keep_t)                                                  when finished requests leave
  propose(pipe, rows_t, L, L_t) -> (Tree, draft_probs | None)   one draft round
  after_verify(pipe, u, commit, vhidden, accept_index, L_t, kept_t, rows_t, old_last)
  finish(reqs)                                                  requests that completed (not retracted)
so the verify and commit code is shared by every drafter. `build` returning None means plain decoding
(draft=none): the run then decodes through `decode.plain.PlainPipeline`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from specpipe.stages.finite import finite_rows


@dataclass
class DraftSetup:
    """What the run knows when it builds a drafter, besides the config and the model pair."""
    max_requests: int  # rows of the running batch (per-row state is sized by it)
    max_context: int  # tokens a request can reach: its prompt, its new tokens and one round's tree
    device: Any  # the run's `devices.base.Device`
    sampled: bool = False  # some request samples (a drafter may then sample its drafts, for rejection sampling)
    keep: Optional[dict] = None  # state carried from one run to the next (the API's calls), e.g. draft=suffix's cache


class Proposer:
    """The base every drafter derives from: the calls above do nothing unless a drafter needs them."""

    K = 1  # candidates per expansion (draft.topk): sizes the draft scratch with `scratch_width`
    S = 1  # draft depth (draft.num_steps)
    scratch_width = 0  # draft KV columns per branch and round (its schema's `scratch_columns`; 0: no draft KV)
    stages: tuple = ()  # the stages whose branches the compile policies bind
    bad: Optional[Tensor] = None  # [B] bool: draft logits non-finite this round (None: the drafter raises none)
    round_extend = None  # a stage whose draft extend a fused `verify.round` may run inside its call (EAGLE's head)
    # host [B, N] confidence in each node of the last proposal given its parent, in [0, 1] (None: none reported):
    # what the speculation policies rank nodes by (`speculation.acceptance`)
    node_conf = None
    report_conf = False  # a speculation policy reads node_conf (static does not: no work spent on it)
    conf_is_probability = False  # node_conf is the drafter's probability of the token (the policies' prior)
    # seconds of this step's propose spent on earlier steps' work (EAGLE's held extend catching up): not what
    # drafting costs, so the policy's draft stage leaves it out
    untimed_s = 0.0

    @classmethod
    def build(cls, cfg, pair, setup: DraftSetup) -> Optional["Proposer"]:
        """The drafter `cfg.draft` configures, over the loaded `pair`."""
        raise NotImplementedError

    def join(self, pipe, reqs, pf, first) -> None:
        pass

    def keep(self, keep_t) -> None:
        pass

    def propose(self, pipe, rows_t, L, L_t):
        raise NotImplementedError

    def after_verify(self, pipe, u, commit, vhidden, accept_index, L_t, kept_t, rows_t, old_last) -> None:
        pass

    def finish(self, reqs) -> None:
        pass

    def plan(self, cfg, prep, allocator_name: str) -> Optional[tuple[str, str]]:
        """Settle how the rounds run once the stages are bound: (a compile policy `key=value` that cannot apply in this
        run, why, as the note says it) or None."""
        return None


def non_finite(score_blocks: list, batch_size: int) -> Tensor:
    """[B] bool: a request whose draft scores (hence draft logits) hold NaN or inf this round."""
    return ~finite_rows(torch.cat([s.reshape(batch_size, -1) for s in score_blocks], 1))
