"""What a sweep job returns to the sweeper: its tokens/s, a negative score over the latency limit, or a failed
point (NaN, or for Optuna the worst value for the study's direction)."""
from __future__ import annotations

import math
from typing import Any, Optional

from specpipe.config.schema import is_number

OPTUNA_SWEEPER = "hydra_plugins.hydra_optuna_sweeper"


def failed_objective(hydra_cfg: Any) -> Any:
    """What a failed job returns to the sweeper (hydra_cfg: HydraConfig.get(), or a job config's hydra node).

    NaN, which the basic sweeper ignores. Optuna's sweeper (hydra-optuna-sweeper 1.2, optuna 2.x) raises on NaN
    and ends the whole search at the first failed trial, so there a failed job scores the worst value for the
    study's direction instead: -inf when it maximizes (sweep=optuna_tree), +inf when it minimizes (the
    sweeper's default), one per objective for a multi-objective study."""
    sweeper = getattr(hydra_cfg, "sweeper", None)
    target = str(getattr(sweeper, "_target_", "") or "") if sweeper is not None else ""
    if not target.startswith(OPTUNA_SWEEPER):
        return float("nan")
    direction = getattr(sweeper, "direction", None)

    def worst(d) -> float:
        return float("-inf") if "max" in str(getattr(d, "name", d)).lower() else float("inf")

    if isinstance(direction, (list, tuple)) or type(direction).__name__ == "ListConfig":
        values = [worst(d) for d in direction]
        return values[0] if len(values) == 1 else values
    return worst(direction)


def objective(metrics: dict, latency_limit_ms: Optional[float]) -> float:
    """What a job returns to the sweeper: tokens/s, or a negative score when over the latency limit.

    Every run within the limit (p90 step latency <= limit) scores its tokens/s >= 0; a run over it
    scores -(p90 / limit) < -1, so it never beats one within the limit, and of two runs over the limit
    the one closer to it wins (the sweeper still gets a direction to move in).
    """
    tps = float(metrics.get("tokens_per_s") or 0.0)
    p90 = metrics.get("step_latency_ms_p90")
    if latency_limit_ms is None or within_latency_limit(p90, latency_limit_ms):
        return tps
    return -float(p90) / max(float(latency_limit_ms), 1e-9)


def not_measured(metrics: Optional[dict]) -> bool:
    """A resumed job whose requests had all finished in the run that was stopped: it decoded nothing."""
    m = metrics or {}
    return bool(m.get("resumed_requests")) and m.get("generated_tokens") == 0


def job_score(metrics: dict, latency_limit_ms: Optional[float], hydra_cfg: Any) -> Any:
    """What a finished job returns to the sweeper: its objective, or a failed point when it measured no speed (its
    0 tokens/s would rank it as the worst point, and Optuna would steer away from a setting that was never timed).
    A job skipped by a later resume=true reads the same metrics.json and scores the same."""
    return failed_objective(hydra_cfg) if not_measured(metrics) else objective(metrics, latency_limit_ms)


def within_latency_limit(p90, limit: float) -> bool:
    """Whether a job kept the limit: a job with no step latency (no decode step after the prefill, e.g.
    max_new_tokens=1) has nothing over it. The objective and the report's column both ask this."""
    return p90 is None or (is_number(p90) and (math.isnan(p90) or p90 <= limit))
