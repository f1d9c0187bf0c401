"""A sweep's job folders: which belong to its newest sweep, each one's point (its overrides) and state (its
metrics, or why it has none: failed, unfinished, an earlier run's metrics.json)."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml

from specpipe.config.schema import is_number
from specpipe.outputs.run_files import read_json_object
from specpipe.outputs.run_identity import NOT_RUN_KEYS
from specpipe.sweep.job_files import metrics_problem
from specpipe.sweep.overrides import (HYDRA_FILES, config_leaves, error_overrides, hydra_dir, hydra_overrides,
                                      hydra_value, mtime, override_text, recorded_overrides)
from specpipe.sweep.points import is_point, matches
from specpipe.sweep.scoring import within_latency_limit

METRICS = ("tokens_per_s", "accept_length_mean", "step_latency_ms_p90", "num_verify_steps", "recompiles", "wall_s")
UNFINISHED = ("unfinished: no metrics.json (interrupted, killed or still running; resume=true runs the requests it "
              "had not finished)")
RERUN = "resume=true re-runs it"
STRAY = ("not the newest sweep's point for its job number (multirun.yaml): most likely an earlier sweep's job that "
         "the newest one, stopped, did not reach; not ranked (--all ranks every job)")


@dataclass
class Job:
    name: str  # job dir relative to the sweep dir ("0", "1", ...)
    overrides: dict[str, str] = field(default_factory=dict)
    metrics: Optional[dict] = None
    error: Optional[str] = None
    hydra: Optional[Path] = None  # the folder where Hydra saved the job's overrides.yaml and config.yaml

    @property
    def tps(self) -> Optional[float]:
        v = (self.metrics or {}).get("tokens_per_s")
        return float(v) if is_number(v) and not math.isnan(v) else None

    @property
    def limit(self) -> Optional[float]:
        return ((self.metrics or {}).get("config") or {}).get("latency_limit_ms")

    @property
    def within_limit(self) -> Optional[bool]:
        return None if self.limit is None else within_latency_limit((self.metrics or {}).get("step_latency_ms_p90"),
                                                                    self.limit)


def _natural(name: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def job_number(job_dir: Path, hydra: Optional[Path]) -> Optional[int]:
    """The job's number in its sweep (hydra.job.num), or its folder's name when that is a number."""
    try:
        return int(yaml.safe_load((hydra / "hydra.yaml").read_text(encoding="utf-8"))["hydra"]["job"]["num"])
    except Exception:
        return int(job_dir.name) if job_dir.name.isdigit() else None


def find_jobs(sweep_dir: Path, since: float = float("-inf"), size: Optional[int] = None,
              points: Optional[list] = None) -> tuple[list[Job], int]:
    """(every job dir under sweep_dir of the newest sweep, how many an earlier sweep left there).

    A job dir has metrics.json, error.json or a Hydra folder (hydra_dir). The leftovers of an earlier, longer
    sweep into the same folder are the jobs numbered `size` (the newest sweep's job count) or more; a job whose
    overrides are none of the newest sweep's `points` (newest_sweep_points: a stopped re-sweep leaves the jobs it
    did not reach) is kept but not ranked (STRAY); a sweep still running (the failure summary) also knows when it
    started: a job dir it did not write since then is older. (File times alone would not do for a report: a copied
    or cloned folder has them in any order.)
    """
    found = job_dirs(sweep_dir)
    kept = [(d, h) for d, h in found if _newest(d, h, since, size)]
    own = {d: recorded_overrides(d) for d, _ in kept}
    told_by = {d: own[d] if own[d] is not None else hydra_overrides(h) if h else None for d, h in kept}
    strays = _strays(kept, told_by, points)
    jobs, told = [], []  # told: the overrides each job's error.json recorded (for jobs without overrides.yaml)
    for d, h in kept:
        overrides = own[d] if own[d] is not None and h is not None else hydra_overrides(h)
        metrics, err = job_state(d, overrides)
        if d in strays:  # shown, never ranked: an earlier sweep's job the newest one did not reach, most likely
            metrics, err = None, STRAY
        jobs.append(Job(str(d.relative_to(sweep_dir)) if d != sweep_dir else ".", overrides, metrics, err, h))
        told.append({} if h is not None else error_overrides(d, metrics))
    _fill_points(jobs, [h for _, h in kept], told)
    return jobs, len(found) - len(kept)


def job_dirs(sweep_dir: Path) -> list[tuple[Path, Optional[Path]]]:
    """(job dir, its Hydra folder or None) for every folder under sweep_dir with metrics.json, error.json or a
    Hydra folder, in natural order ("2" before "10")."""
    dirs = {p.parent for p in sweep_dir.rglob("metrics.json")} | {p.parent for p in sweep_dir.rglob("error.json")}
    dirs |= {p.parent.parent for p in sweep_dir.rglob("overrides.yaml")
             if p.parent.name == ".hydra" or all((p.parent / f).is_file() for f in HYDRA_FILES)}
    return [(d, hydra_dir(d)) for d in sorted(dirs, key=lambda d: _natural(str(d.relative_to(sweep_dir))))]


def _newest(d: Path, h: Optional[Path], since: float, size: Optional[int]) -> bool:
    """Whether job dir d is the newest sweep's: numbered below its `size`, written at or after `since`."""
    n = job_number(d, h) if size is not None else None
    if n is not None and n >= size:
        return False
    return max(mtime(f) for f in (d / "metrics.json", d / "error.json",
                                  *([h / "overrides.yaml"] if h else []))) >= since


def _strays(kept: list, told_by: dict, points: Optional[list]) -> set:
    """The job dirs whose overrides (`told_by`) are none of the newest sweep's points, or another number's point."""
    strays = set() if points is None else {d for d, _ in kept if not is_point(told_by[d], points)}
    if len(strays) == len(kept):  # no job is one of the points: the points are what is wrong
        strays = set()
    numbered = {d: job_number(d, h) for d, h in kept if d not in strays and told_by[d] is not None}
    numbered = {d: n for d, n in numbered.items() if n is not None and points and 0 <= n < len(points)}
    off = {d for d, n in numbered.items() if not matches(told_by[d], points[n])}
    if len(off) * 2 < len(numbered):  # a point, but not its own number's (an older sweep's, in another order);
        strays |= off                 # when most are off, the order retraced is what is wrong
    return strays


def _fill_points(jobs: list[Job], hydras: list, told: list) -> None:
    """Complete each job's overrides: the points jobs without a Hydra folder recorded, the settings that differ
    between jobs when no job has overrides, and what a job that left a swept key at its default ran with."""
    recorded = [t for h, t in zip(hydras, told) if h is None]
    if recorded and all(recorded):  # every job without a Hydra folder recorded its point: read as overrides.yaml
        for j, h, t in zip(jobs, hydras, told):
            if h is None:
                j.overrides = dict(t)
    keys = {k for j in jobs for k in j.overrides}
    if not keys:  # no overrides.yaml (hydra.output_subdir=null): the settings that differ between finished jobs,
        configs = [config_leaves(j.metrics.get("config")) for j in jobs if j.metrics]  # and the failed jobs' points
        keys = {k for c in configs for k in c if k != "resume" and len({c2.get(k) for c2 in configs}) > 1}
        for k in {k for t in told for k in t} - keys:
            values = {c[k] for c in configs if k in c} | {t.get(k) for t in told if t}
            if k != "resume" and not k.startswith("hydra") and len(values) > 1:
                keys.add(k)
        for j, t in zip(jobs, told):
            source = config_leaves(j.metrics.get("config")) if j.metrics else t
            j.overrides = {k: v for k, v in source.items() if k in keys}
    for j in jobs:
        for k in keys - set(j.overrides):  # a job that left a swept key at its default shows what it ran with
            if not k.startswith("hydra"):
                value = ran_with(j, k)
                if value:
                    j.overrides[k] = value


def ran_with(job: Job, key: str) -> str:
    """The value `key` had in a job that did not override it (its default, or a preset's): the group choice
    from hydra.yaml, else the value in metrics.json's config, else the one in config.yaml, which holds
    interpolations (${...}) unresolved, so those are never shown; "" when none says."""
    def choice():
        hydra_cfg = yaml.safe_load((job.hydra / "hydra.yaml").read_text(encoding="utf-8")) or {}
        return ((hydra_cfg.get("hydra") or {}).get("runtime") or {}).get("choices", {})

    for source in (choice, lambda: config_leaves((job.metrics or {}).get("config")),
                   lambda: config_leaves(yaml.safe_load((job.hydra / "config.yaml").read_text(encoding="utf-8")))):
        try:
            value = source().get(key)
        except (OSError, yaml.YAMLError, TypeError, AttributeError):
            continue
        if value is not None and value != "" and "${" not in str(value):
            return str(value)
    return ""


def error_message(job_dir: Path) -> tuple[bool, Optional[str]]:
    """(whether job_dir has an error.json, the failure it records or why it cannot be read; None if absent)."""
    err, why = read_json_object(job_dir / "error.json")
    if err is None:
        return why is not None, (f"failed: {why}; {RERUN}" if why else None)
    msg = err.get("error")
    if not isinstance(msg, str) or not msg.strip():
        return True, f"failed: error.json holds no error message; {RERUN}"
    return True, msg


def _setting(config: dict, key: str):
    """The value at the dotted key of a resolved config; a `_Missing` instance when there is none."""
    node = config
    for part in key.split("."):
        node = node.get(part, _Missing()) if isinstance(node, dict) else _Missing()
    return node


class _Missing:
    pass


def stale_metrics(metrics: dict, overrides: dict[str, str]) -> Optional[str]:
    """Why metrics.json is an earlier run's and not this job's (None when nothing says so): a number or true/false
    that the job's overrides set and metrics.json's config holds otherwise. Folders written by older versions
    only: a job now clears its folder before it runs, so a re-sweep into the same folder that was interrupted
    or killed no longer leaves the previous sweep's metrics.json under the new job's settings."""
    config = metrics.get("config")
    if not isinstance(config, dict):
        return None
    for key, text in overrides.items():
        if key in NOT_RUN_KEYS or key.startswith("hydra"):
            continue
        wanted = hydra_value(key, text)
        ran = _setting(config, key)
        if (is_number(wanted) or isinstance(wanted, bool)) and (is_number(ran) or isinstance(ran, bool)) \
                and isinstance(wanted, bool) == isinstance(ran, bool) and wanted != ran:
            return (f"unfinished: its metrics.json is an earlier run's ({key}={override_text(ran)} there, {key}={text} "
                    f"in this job's overrides), and this job left none (interrupted or killed); {RERUN}")
    return None


def job_state(job_dir: Path, overrides: Optional[dict[str, str]] = None) -> tuple[Optional[dict], Optional[str]]:
    """(the job's metrics, None) when it finished; else (None, why not): the error.json message of a failed
    job, what is wrong with a metrics.json that cannot be used, or UNFINISHED when there is neither file.

    error.json wins over metrics.json: a job in which every request failed writes both (it is a failed point),
    and so, in folders written by older versions, does a re-run into an earlier sweep's folder that failed
    (the earlier run's metrics.json stayed); resume=true re-runs such a job too. `overrides` (the job's, from
    overrides.yaml) tell an earlier run's metrics.json left in the folder (stale_metrics)."""
    metrics, bad_metrics = read_json_object(job_dir / "metrics.json")
    has_error, failed = error_message(job_dir)
    if metrics is not None:
        bad_metrics = metrics_problem(metrics, METRICS)
        if bad_metrics is None and not has_error:
            stale = stale_metrics(metrics, overrides or {})
            return (metrics, None) if stale is None else (None, stale)
    damaged = f"{bad_metrics}; {RERUN}" if bad_metrics else None
    if failed and damaged:
        return None, f"{failed} ({damaged})"
    return None, failed or damaged or UNFINISHED
