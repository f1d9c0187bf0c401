"""python -m specpipe.report SWEEP_DIR [--out DIR]: one table and one plot for a whole sweep.

Reads every job dir under SWEEP_DIR (metrics.json, error.json, .hydra/overrides.yaml) and writes
report.csv, report.md and report.png. The columns are the overrides that differ between jobs, so
the table shows what the sweep varied and nothing that stayed fixed. A job that failed shows its
error.json message; one that was interrupted or crashed (a job dir without either file) shows that.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml

from specpipe.sweep import objective

METRICS = ("tokens_per_s", "accept_length_mean", "step_latency_ms_p90", "num_verify_steps", "recompiles", "wall_s")
DIGITS = {"tokens_per_s": 1, "accept_length_mean": 2, "step_latency_ms_p90": 2, "wall_s": 2}
UNFINISHED = "unfinished: no metrics.json (interrupted, crashed or still running; resume=true re-runs it)"


@dataclass
class Job:
    name: str  # job dir relative to the sweep dir ("0", "1", ...)
    overrides: dict[str, str] = field(default_factory=dict)
    metrics: Optional[dict] = None
    error: Optional[str] = None

    @property
    def tps(self) -> Optional[float]:
        v = (self.metrics or {}).get("tokens_per_s")
        return None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)

    @property
    def limit(self) -> Optional[float]:
        return ((self.metrics or {}).get("config") or {}).get("latency_limit_ms")

    @property
    def within_limit(self) -> Optional[bool]:
        p90 = (self.metrics or {}).get("step_latency_ms_p90")
        return None if self.limit is None or p90 is None else p90 <= self.limit


def _natural(name: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _read_json(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _overrides(job_dir: Path) -> dict[str, str]:
    """key -> value from Hydra's per-job .hydra/overrides.yaml ('+', '++' and '~' prefixes dropped)."""
    path = job_dir / ".hydra" / "overrides.yaml"
    try:
        items = yaml.safe_load(path.read_text()) or []
    except (OSError, yaml.YAMLError):
        return {}
    out = {}
    for item in items:
        key, _, value = str(item).partition("=")
        out[key.lstrip("+~")] = value
    return out


def find_jobs(sweep_dir: Path) -> list[Job]:
    """Every job dir under sweep_dir: one that has metrics.json, error.json or .hydra/overrides.yaml."""
    dirs = {p.parent for p in sweep_dir.rglob("metrics.json")} | {p.parent for p in sweep_dir.rglob("error.json")}
    dirs |= {p.parent.parent for p in sweep_dir.rglob("overrides.yaml") if p.parent.name == ".hydra"}
    jobs = []
    for d in sorted(dirs, key=lambda d: _natural(str(d.relative_to(sweep_dir)))):
        metrics = _read_json(d / "metrics.json")
        err = None
        if metrics is None:
            err = (_read_json(d / "error.json") or {}).get("error") or UNFINISHED
        jobs.append(Job(str(d.relative_to(sweep_dir)) if d != sweep_dir else ".", _overrides(d), metrics, err))
    return jobs


def varied_keys(jobs: list[Job]) -> tuple[list[str], dict[str, str]]:
    """(keys whose value differs between jobs, in command-line order; the keys every job shares)."""
    keys: list[str] = []
    for j in jobs:
        keys += [k for k in j.overrides if k not in keys and not k.startswith("hydra")]
    varied = [k for k in keys if len({j.overrides.get(k) for j in jobs}) > 1]
    fixed = {k: jobs[0].overrides[k] for k in keys if k not in varied and k in jobs[0].overrides}
    return varied, fixed


def best_job(jobs: list[Job]) -> Job:
    """The job the sweeper would pick: most tokens/s, and within latency_limit_ms where one was set."""
    return max((j for j in jobs if j.tps is not None), key=lambda j: objective(j.metrics, j.limit))


def sort_jobs(jobs: list[Job]) -> list[Job]:
    """Fastest first; jobs without a throughput (failed, unfinished) last, in job order."""
    done = sorted((j for j in jobs if j.tps is not None), key=lambda j: -j.tps)
    return done + [j for j in jobs if j.tps is None]


def _fmt(key: str, v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{DIGITS.get(key, 3)}f}"
    return str(v)


def rows(jobs: list[Job], varied: list[str]) -> tuple[list[str], list[list]]:
    limited = any(j.limit is not None for j in jobs)  # a latency-limited sweep (sweep=optuna_tree)
    header = ["job", *varied, *METRICS, *(["within_latency_limit"] if limited else []), "error"]
    out = []
    for j in jobs:
        m = j.metrics or {}
        ok = [{True: "yes", False: "no"}.get(j.within_limit, "")] if limited else []
        out.append([j.name, *(j.overrides.get(k, "") for k in varied), *(m.get(k) for k in METRICS), *ok,
                    j.error or ""])
    return header, out


def write_csv(path: Path, header: list[str], table: list[list]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows([["" if v is None else v for v in r] for r in table])


def markdown(header: list[str], table: list[list], fixed: dict[str, str], best: Job, varied: list[str]) -> str:
    def cell(key: str, v) -> str:
        text = _fmt(key, v)
        text = text if len(text) <= 120 else text[:117] + "..."
        return text.replace("|", "\\|").replace("\n", " ")

    shown = " ".join(f"{k}={best.overrides[k]}" for k in varied if k in best.overrides)
    lines = [f"Best: job {best.name}" + (f" ({shown})" if shown else "") + f", {best.tps:.1f} tokens/s", ""]
    if fixed:
        lines += ["Fixed in every job: " + ", ".join(f"`{k}={v}`" for k, v in fixed.items()), ""]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "|".join("---:" if h in METRICS else "---" for h in header) + "|")
    lines += ["| " + " | ".join(cell(h, v) for h, v in zip(header, r)) + " |" for r in table]
    return "\n".join(lines) + "\n"


def plot(path: Path, jobs: list[Job], varied: list[str], best: Job) -> None:
    """Acceptance length (y) vs tokens/s (x), one labelled point per finished job, the best starred.

    Jobs over their latency limit are drawn hollow: the best is the fastest of the others.

    Plain decoding (draft=none) has no acceptance length; it commits one token per step, drawn at 1.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [j for j in jobs if j.tps is not None]
    xs = [j.tps for j in done]
    ys = [float(j.metrics.get("accept_length_mean") or 1.0) for j in done]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    over = [j.within_limit is False for j in done]
    ax.scatter(xs, ys, s=28, zorder=2, edgecolors="tab:blue", facecolors=["none" if o else "tab:blue" for o in over])
    for j, x, y in zip(done, xs, ys):
        label = "/".join(j.overrides.get(k, "") for k in varied) or j.name
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    best = done.index(best)
    ax.scatter([xs[best]], [ys[best]], s=220, marker="*", color="tab:red", zorder=3,
               label=f"best: job {done[best].name}, {xs[best]:.1f} tokens/s")
    ax.set_xlabel("tokens/s")
    ax.set_ylabel("acceptance length (tokens per verify step)")
    ax.set_title("labels: " + " / ".join(varied) if varied else "one point per job", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def report(sweep_dir: Path, out: Path) -> tuple[list[Job], str]:
    """Write report.csv, report.md and report.png for sweep_dir into out; (jobs fastest first, markdown)."""
    jobs = sort_jobs(find_jobs(sweep_dir))
    varied, fixed = varied_keys(jobs)
    header, table = rows(jobs, varied)
    best = best_job(jobs)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "report.csv", header, table)
    md = markdown(header, table, fixed, best, varied)
    (out / "report.md").write_text(md)
    plot(out / "report.png", jobs, varied, best)
    return jobs, md


def no_metrics_message(sweep_dir: Path, jobs: list[Job]) -> str:
    if not sweep_dir.is_dir():
        return (f"specpipe.report: {sweep_dir} is not a directory. Give the folder of a sweep, e.g. "
                "multirun/2026-01-31/12-00-00 or the hydra.sweep.dir you chose.")
    why = f"{len(jobs)} job dir(s) were found but none finished" if jobs else "it holds no job dirs"
    first = next((j.error for j in jobs if j.error and j.error != UNFINISHED), None)
    return (f"specpipe.report: no metrics.json under {sweep_dir}: {why}, so there is nothing to report. "
            + (f"The first failed job says: {first} " if first else "")
            + "Give the folder of a sweep (`python -m specpipe -m ...` prints it as the sweep output dir), "
            "whose numbered job dirs each get metrics.json when their run finishes.")


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m specpipe.report", description=__doc__.splitlines()[0])
    ap.add_argument("sweep_dir", type=Path, help="a multirun folder (hydra.sweep.dir)")
    ap.add_argument("--out", type=Path, default=None, help="where to write report.* (default: SWEEP_DIR)")
    args = ap.parse_args(argv)
    jobs = find_jobs(args.sweep_dir) if args.sweep_dir.is_dir() else []
    if not any(j.metrics is not None for j in jobs):
        print(no_metrics_message(args.sweep_dir, jobs), file=sys.stderr)
        sys.exit(2)
    out = args.out or args.sweep_dir
    jobs, md = report(args.sweep_dir, out)
    print(md)
    failed = sum(j.metrics is None for j in jobs)
    print(f"{len(jobs)} jobs ({failed} without metrics) -> {out / 'report.csv'}, {out / 'report.md'}, "
          f"{out / 'report.png'}")


if __name__ == "__main__":
    main()
