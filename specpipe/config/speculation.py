"""The speculation= group's schemas: how much of each draft tree a step verifies (one dataclass per
conf/speculation/<option>.yaml, each naming its policy class in specpipe/speculation/<option>.py).

Every policy honours the per-request limits: a prompt's `speculate: false` and `max_spec_tokens`, and
`max_context` (a request whose context has passed it decodes plainly). What they add:
  static    the drafter's whole tree, padding included (the behaviour before policies existed: the baseline)
  schedule  at most so many draft tokens per request, by batch size and by context length (0: off)
  adaptive  only nodes whose estimated chance of acceptance reaches `min_accept`
  cost      the verify width that maximises expected committed tokens per second under the measured cost curve
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from omegaconf import MISSING


@dataclass
class SpeculationConf:
    _target_: str = MISSING  # the policy class (a subclass's default; the config group chooses it)
    max_context: Optional[int] = None  # requests whose context is longer decode plainly (None: no limit)

    trims: ClassVar[bool] = True  # verifies only the nodes it keeps (False: the full tree, padding included)

    @classmethod
    def option(cls) -> str:
        return cls._target_.rsplit(".", 2)[-2]

    @classmethod
    def check(cls, s, errors: list) -> None:
        if s.max_context is not None and s.max_context < 1:
            errors.append(f"speculation.max_context={s.max_context} must be >= 1 (or null: no limit)")


@dataclass
class StaticSpeculationConf(SpeculationConf):
    _target_: str = "specpipe.speculation.static.StaticPolicy"
    trims: ClassVar[bool] = False


def check_steps(s, key: str, errors: list) -> None:
    """A schedule: a list of [from, draft tokens] pairs, `from` ascending from 0 or 1, tokens >= 0."""
    steps = s.get(key)
    words = (f"speculation.{key} must be a list of [from, draft_tokens] pairs with ascending `from` values and "
             f"draft_tokens >= 0, e.g. [[1, 12], [8, 4], [32, 0]]")
    try:
        pairs = [(int(a), int(b)) for a, b in steps]
    except (TypeError, ValueError):
        errors.append(f"{words}; got {steps!r}")
        return
    if not pairs or any(b < 0 or a < 0 for a, b in pairs) or [a for a, _ in pairs] != sorted({a for a, _ in pairs}):
        errors.append(f"{words}; got {[list(p) for p in pairs]}")


@dataclass
class ScheduleSpeculationConf(SpeculationConf):
    _target_: str = "specpipe.speculation.schedule.SchedulePolicy"
    # [from batch size, most draft tokens per request]: the last row whose `from` the running batch reaches applies
    by_batch: Any = field(default_factory=lambda: [[1, 12], [8, 6], [32, 2], [64, 0]])
    # [from context length, most draft tokens]: the last row whose `from` the request's context reaches applies
    by_context: Any = field(default_factory=lambda: [[0, 12], [8192, 4], [32768, 0]])

    @classmethod
    def check(cls, s, errors: list) -> None:
        super().check(s, errors)
        check_steps(s, "by_batch", errors)
        check_steps(s, "by_context", errors)


@dataclass
class AdaptiveSpeculationConf(SpeculationConf):
    _target_: str = "specpipe.speculation.adaptive.AdaptivePolicy"
    min_accept: float = 0.1  # keep a node when its estimated chance of being accepted is at least this

    @classmethod
    def check(cls, s, errors: list) -> None:
        super().check(s, errors)
        if not 0 <= s.min_accept <= 1:
            errors.append(f"speculation.min_accept={s.min_accept} must be in [0, 1]")


@dataclass
class CostSpeculationConf(SpeculationConf):
    _target_: str = "specpipe.speculation.cost.CostPolicy"
    # steps in a row without a draft worth making before drafting itself pauses (0: never); while paused a
    # probe drafts every skip_after-th step, rarer after failed probes, until a draft pays again
    skip_after: int = 4
    # a draft is verified only when it promises at least this share more tokens per second than a plain step (the
    # best of noisy estimates is an optimistic one)
    min_gain: float = 0.05
    # a fixed cost curve instead of a measured one: {batch size: {verify width: ms per step}} (tests, replays)
    cost_ms: Optional[Any] = None

    @classmethod
    def check(cls, s, errors: list) -> None:
        super().check(s, errors)
        if s.skip_after < 0:
            errors.append(f"speculation.skip_after={s.skip_after} must be >= 0 (0: never pause drafting)")
        if not 0 <= s.min_gain < 1:
            errors.append(f"speculation.min_gain={s.min_gain} must be in [0, 1) (0.05: a draft must promise 5 % "
                          "more tokens per second than a plain step)")
        if s.cost_ms is not None:
            try:
                bad = [ms for row in s.cost_ms.values() for ms in row.values() if not float(ms) > 0]
                sizes = [int(b) for b in s.cost_ms] + [int(n) for row in s.cost_ms.values() for n in row]
            except (AttributeError, TypeError, ValueError):
                bad, sizes = [None], []
            if bad or not sizes or min(sizes) < 1:
                errors.append(f"speculation.cost_ms must map batch sizes to {{verify width: ms > 0}}, e.g. "
                              f"{{1: {{1: 50, 5: 100}}}}; got {s.cost_ms}")


SPECULATION_SCHEMAS = {"static": StaticSpeculationConf, "schedule": ScheduleSpeculationConf,
                       "adaptive": AdaptiveSpeculationConf, "cost": CostSpeculationConf}


def speculation_schema(s) -> type:
    """The schema class of the speculation node `s` (by its `_target_`; static for an unknown one)."""
    target = s.get("_target_") if s is not None else None
    for schema in SPECULATION_SCHEMAS.values():
        if schema._target_ == target:
            return schema
    return StaticSpeculationConf
