"""Per-job sweep support: resume a finished job, record a failed one, score a run for a sweeper.

A job's output dir is finished when it holds metrics.json (app.write_outputs renames it into place
last), so an interrupted or crashed job never looks finished and a resumed sweep re-runs it.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig

from specpipe.validate import to_container

NOT_RUN_KEYS = ("resume", "latency_limit_ms")  # change how a job is scored or skipped, not what it computes


def _same_run(stored: dict, current: dict) -> bool:
    strip = lambda c: {k: v for k, v in c.items() if k not in NOT_RUN_KEYS}  # noqa: E731
    return strip(stored) == strip(current)


def finished_metrics(cfg: DictConfig, out_dir: str) -> Optional[dict]:
    """The job's stored metrics when out_dir already holds a finished run of this same config, else None.

    Comparing configs matters because Hydra names job dirs by job number: re-running a stable
    sweep dir with different values must not reuse job 3's old results for a new job 3.
    """
    path = Path(out_dir) / "metrics.json"
    if not path.is_file():
        return None
    try:
        stored = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None  # unreadable: run it again
    if not _same_run(stored.get("config", {}), to_container(cfg)):
        return None
    return stored


def write_error(out_dir: str, message: str) -> None:
    """Record why a sweep job failed, so `python -m specpipe.report` can show it as a row."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "error.json").write_text(json.dumps({"error": message}, indent=2) + "\n")


def clear_error(out_dir: str) -> None:
    """A job that succeeds on a re-run drops the error of its earlier attempt."""
    (Path(out_dir) / "error.json").unlink(missing_ok=True)


def objective(metrics: dict, latency_limit_ms: Optional[float]) -> float:
    """What a job returns to the sweeper: tokens/s, or a negative score when over the latency limit.

    Every run within the limit (p90 step latency <= limit) scores its tokens/s >= 0; a run over it
    scores -(p90 / limit) < -1, so it never beats one within the limit, and of two runs over the limit
    the one closer to it wins (the sweeper still gets a direction to move in).
    """
    tps = float(metrics.get("tokens_per_s") or 0.0)
    p90 = metrics.get("step_latency_ms_p90")
    if latency_limit_ms is None or p90 is None or math.isnan(p90) or p90 <= latency_limit_ms:
        return tps
    return -float(p90) / max(float(latency_limit_ms), 1e-9)


MAX_TREE_TOKENS = 16  # num_draft_tokens ceiling for searches: verify cost grows with it on every device


def tree_search_space(cfg: DictConfig, trial) -> None:
    """Optuna hook (hydra.sweeper.custom_search_space): num_draft_tokens within the sampled shape.

    A tree of topk branches and num_steps levels holds at most 1 + topk + (num_steps-1)*topk^2 nodes
    (num_steps + 1 for a chain): more would only fail. Fewer than num_steps + 1 cannot hold one
    full-depth path, so the last draft steps would be computed and never verified.
    """
    k, s = int(trial.params["draft.topk"]), int(trial.params["draft.num_steps"])
    most = min(s + 1 if k == 1 else 1 + k + (s - 1) * k * k, MAX_TREE_TOKENS)
    trial.suggest_int("draft.num_draft_tokens", min(s + 1, most), most)
