"""One request as the decode loop tracks it: its prompt, what it generated, why it finished, and the
per-request settings (seed, stop ids and strings, sampling) that travel with it through retractions."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class Request:
    index: int
    prompt: str
    prompt_ids: list
    max_new_tokens: int
    output_ids: list = field(default_factory=list)
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    t_submit: float = 0.0
    seed: int = 0  # the request's own sampling seed
    retractions: int = 0  # times it was evicted under KV pressure and re-queued
    stop_strings: Optional[Any] = None  # a StopStrings checker when the request has stop strings
    stop_ids: frozenset = frozenset()  # its own "stop_token_ids", which end it as the model's EOS ids do
    sampling: Optional[tuple] = None  # its own (temperature, top_p, top_k, repetition_penalty, min_p); None: the run's
    logprobs: Optional[list] = None  # with workload.logprobs: each output token's raw target log-probability
    speculate: bool = True  # a prompt's "speculate": false decodes it plainly (one token per step)
    max_spec_tokens: Optional[int] = None  # a prompt's own cap on the draft tokens it verifies per step
    # a prompt's response_format / regex / grammar (workload.constraints.Constraint); None: free
    constraint: Optional[Any] = None
    grammar_forced_tokens: int = 0  # tokens its grammar forced, drafted as chains at no model cost (jump-forward)
    grammar_pruned_tokens: int = 0  # draft tokens its grammar forbade, pruned before verify
    unconstrained_accepted_tokens: int = 0  # drafts the target's unmasked greedy choice would have accepted
    num_draft_tokens: int = 0  # draft tokens verified for it (vLLM's name)
    num_accepted_tokens: int = 0  # of which accepted
    accept_histogram: list = field(default_factory=list)  # [i]: its rounds that accepted i drafts

    @property
    def context_ids(self) -> list:
        """The prompt and everything generated so far."""
        return self.prompt_ids + self.output_ids

    @property
    def resumed(self) -> bool:
        """Re-admitted after a retraction with tokens already generated."""
        return self.retractions > 0 and bool(self.output_ids)

    @property
    def prefill_ids(self) -> list:
        """What an admission prefills: the prompt; after a retraction, the context without its newest token,
        which stays the next round's root as it was before (a re-prefill that drew the next token itself
        would draw it with another coin than the round it replaces: a sampled standalone chain's own)."""
        return self.prompt_ids + self.output_ids[:-1] if self.resumed else self.prompt_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def stop_set(eos) -> frozenset:
    """EOS as given (None, one id, or several, None entries ignored) -> the set of ids that end a request."""
    if eos is None:
        return frozenset()
    if isinstance(eos, int):
        return frozenset([eos])
    return frozenset(int(t) for t in eos if t is not None)
