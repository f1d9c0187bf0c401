"""The report's table: the keys the sweep varied, one row per job (fastest first), the best job, and the CSV
and markdown forms."""
from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Optional

from specpipe.config.schema import is_number
from specpipe.sweep.job_files import finite
from specpipe.sweep.jobs import METRICS, Job
from specpipe.sweep.scoring import not_measured, objective

DIGITS = {"tokens_per_s": 1, "accept_length_mean": 2, "step_latency_ms_p90": 2, "wall_s": 2}


def varied_keys(jobs: list[Job]) -> tuple[list[str], dict[str, str]]:
    """(keys whose value differs between jobs, in command-line order; the keys every job shares)."""
    keys: list[str] = []
    for j in jobs:
        keys += [k for k in j.overrides if k not in keys and not k.startswith("hydra")]
    varied = [k for k in keys if len({j.overrides.get(k) for j in jobs}) > 1]
    fixed = {k: jobs[0].overrides[k] for k in keys if k not in varied and k in jobs[0].overrides}
    return varied, fixed


def lost_requests(metrics: Optional[dict]) -> float:
    """How many of a finished job's requests failed (0 when metrics.json does not say)."""
    n = (metrics or {}).get("num_errors") or 0
    if not is_number(n) or (isinstance(n, float) and math.isnan(n)):
        return 0.0
    return float(n) if finite(n) else float("inf")  # an integer past float's range (a damaged file): many


def request_failures(metrics: Optional[dict]) -> str:
    """"N of M requests failed: <the first one's error>" for a finished job that lost requests, and "resumed: ..."
    for one that took requests from a stopped run (its numbers cover only the others); else ""."""
    m = metrics or {}
    notes = []
    n = m.get("num_errors")
    if lost_requests(m) > 0:
        first = (m.get("request_errors") or [{}])[0]
        first = first.get("error", "") if isinstance(first, dict) else ""
        notes.append(f"{n} of {m.get('num_requests', '?')} requests failed" + (f": {first}" if first else ""))
    resumed = m.get("resumed_requests")
    if isinstance(resumed, int) and not isinstance(resumed, bool) and resumed > 0:
        notes.append(f"resumed: {resumed} of {m.get('num_requests', '?')} requests came from the stopped run" +
                     ("; none decoded here, so no speed was measured" if not_measured(m) else
                      "; its numbers cover the others"))
    return "; ".join(notes)


def best_job(jobs: list[Job]) -> Job:
    """The job the sweeper would pick: the fewest failed requests (a job that lost some did less work, so its
    tokens/s flatters it), then a measured speed (a resumed job that decoded nothing has none), then most
    tokens/s, within latency_limit_ms where one was set."""
    return max((j for j in jobs if j.tps is not None),
               key=lambda j: (-lost_requests(j.metrics), not not_measured(j.metrics), objective(j.metrics, j.limit)))


def sort_jobs(jobs: list[Job]) -> list[Job]:
    """Fastest first; jobs without a throughput (failed, unfinished) last, in job order."""
    done = sorted((j for j in jobs if j.tps is not None), key=lambda j: -j.tps)
    return done + [j for j in jobs if j.tps is None]


def fixed_digits(v: float, digits: int) -> str:
    """Fixed digits, or 4 significant ones for a value a damaged file made huge (1e308 printed 309 digits)."""
    return f"{v:.4g}" if abs(v) >= 1e9 else f"{v:.{digits}f}"


def _fmt(key: str, v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return fixed_digits(v, DIGITS.get(key, 3))
    return str(v)


def rows(jobs: list[Job], varied: list[str]) -> tuple[list[str], list[list]]:
    limited = any(j.limit is not None for j in jobs)  # a latency-limited sweep (sweep=optuna_tree)
    header = ["job", *varied, *METRICS, *(["within_latency_limit"] if limited else []), "error"]
    out = []
    for j in jobs:
        m = j.metrics or {}
        ok = [{True: "yes", False: "no"}.get(j.within_limit, "")] if limited else []
        out.append([j.name, *(j.overrides.get(k, "") for k in varied), *(m.get(k) for k in METRICS), *ok,
                    j.error or request_failures(j.metrics)])
    return header, out


def write_csv(path: Path, header: list[str], table: list[list]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows([["" if v is None else v for v in r] for r in table])


def _escaped(value: str) -> str:
    """A setting on one line: a newline shows as \\n, so values that differ only there still look different."""
    return value.replace("\n", "\\n").replace("\r", "\\r")


def older_note(sweep_dir: Path, older: int) -> str:
    """Says that older job dirs were left out (find_jobs), and how to see them; "" when none were."""
    return (f"Left out: {older} older job dir(s) in {sweep_dir}, numbered past the jobs of its newest sweep "
            "(multirun.yaml): the leftovers of an earlier, longer sweep into the same folder; "
            f"`python -m specpipe.report {sweep_dir} --all` reports them too.") if older else ""


def markdown(header: list[str], table: list[list], fixed: dict[str, str], best: Job, varied: list[str],
             note: str = "") -> str:
    def cell(key: str, v) -> str:
        text = _fmt(key, v).replace("\n", " ") if key == "error" else _escaped(_fmt(key, v))
        text = text if len(text) <= 120 else text[:117] + "..."
        return text.replace("|", "\\|")

    shown = " ".join(f"{k}={_escaped(best.overrides[k])}" for k in varied if k in best.overrides)
    over = "" if best.within_limit is not False else (
        f" (no job kept its p90 step latency within latency_limit_ms={best.limit:g}; this one came closest)")
    speed = f", {fixed_digits(best.tps, 1)} tokens/s{over}"
    lines = [f"Best: job {best.name}" + (f" ({shown})" if shown else "") + speed, ""]
    if note:
        lines += [note, ""]
    if fixed:
        lines += ["Fixed in every job: " + ", ".join(f"`{k}={_escaped(v)}`" for k, v in fixed.items()), ""]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "|".join("---:" if h in METRICS else "---" for h in header) + "|")
    lines += ["| " + " | ".join(cell(h, v) for h, v in zip(header, r)) + " |" for r in table]
    return "\n".join(lines) + "\n"
