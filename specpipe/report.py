"""python -m specpipe.report SWEEP_DIR [--out DIR]: one table and one plot for a whole sweep.

Reads the job dirs under SWEEP_DIR (metrics.json, error.json, .hydra/overrides.yaml) and writes
report.csv, report.md and report.png. The columns are the overrides that differ between jobs, so
the table shows what the sweep varied and nothing that stayed fixed (without overrides.yaml, as with
hydra.output_subdir=null: the settings of metrics.json's config that differ). Only the jobs of the newest
sweep in SWEEP_DIR are read (--all reads every one): a new sweep into the same folder leaves the higher
numbered jobs of an earlier, longer one in place. A job that failed shows its
error.json message (for a crash, the exception); one that was interrupted or killed (a job dir without
either file) shows that, and so does one whose metrics.json or error.json cannot be read, saying why.
"""
from __future__ import annotations

import argparse
import csv
import itertools
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml

from specpipe.schema import is_number
from specpipe.sweep import (NOT_RUN_KEYS, finite, metrics_problem, not_measured, objective, read_json_object,
                            within_latency_limit)

METRICS = ("tokens_per_s", "accept_length_mean", "step_latency_ms_p90", "num_verify_steps", "recompiles", "wall_s")
DIGITS = {"tokens_per_s": 1, "accept_length_mean": 2, "step_latency_ms_p90": 2, "wall_s": 2}
UNFINISHED = ("unfinished: no metrics.json (interrupted, killed or still running; resume=true runs the requests it "
              "had not finished)")
RERUN = "resume=true re-runs it"
STRAY = ("not the newest sweep's point for its job number (multirun.yaml): most likely an earlier sweep's job that "
         "the newest one, stopped, did not reach; not ranked (--all ranks every job)")
HYDRA_FILES = ("overrides.yaml", "config.yaml", "hydra.yaml")  # what Hydra saves in a job's hydra.output_subdir


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


def hydra_dir(job_dir: Path) -> Optional[Path]:
    """The job's Hydra folder: .hydra, or the folder hydra.output_subdir named instead (one holding overrides.yaml,
    config.yaml and hydra.yaml); None when Hydra saved none (hydra.output_subdir=null)."""
    try:
        found = [d for d in sorted(job_dir.iterdir()) if d.name == ".hydra" and (d / "overrides.yaml").is_file()
                 or all((d / f).is_file() for f in HYDRA_FILES)]
    except OSError:
        return None
    # a re-sweep with another hydra.output_subdir leaves the earlier one's folder beside it: the newest is the job's
    return max(found, key=lambda d: _mtime(d / "overrides.yaml"), default=None)


def _overrides(hydra: Optional[Path]) -> dict[str, str]:
    """key -> value from Hydra's per-job overrides.yaml ('+', '++' and '~' prefixes dropped)."""
    if hydra is None:
        return {}
    try:
        items = yaml.safe_load((hydra / "overrides.yaml").read_text(encoding="utf-8")) or []
    except (OSError, yaml.YAMLError):
        return {}
    return _parse_overrides(items)


def _error_overrides(job_dir: Path, metrics: Optional[dict] = None) -> dict[str, str]:
    """key -> value from the overrides a job recorded, in metrics.json (a finished job) or error.json (a failed one,
    sweep.write_error): its point when Hydra saved no overrides.yaml (hydra.output_subdir=null). Values are
    written as the config's would be ("0.5" for "0.50"), so they compare with the finished jobs' settings."""
    items = (metrics or {}).get("overrides")
    if not isinstance(items, list):
        err, _ = read_json_object(job_dir / "error.json")
        items = (err or {}).get("overrides")
    if not isinstance(items, list):
        return {}
    out = {}
    for key, value in _parse_overrides(items).items():
        parsed = hydra_value(key, value)
        out[key] = value if isinstance(parsed, dict) else _text(parsed)
    return out


def hydra_value(key: str, text: str):
    """An override's value as Hydra reads it ("010" is the text 010, which the schema makes 10; YAML 1.1 would read
    octal 8), or the text itself when Hydra cannot parse it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return OverridesParser.create().parse_override(f"{key}={text}").value()
    except Exception:
        return text


def _parse_overrides(items) -> dict[str, str]:
    out = {}
    if not isinstance(items, list):
        return out
    for item in items:
        key, _, value = str(item).partition("=")
        if key.lstrip("+~") != "resume":  # how the job was launched, not what it ran; a resumed sweep has it everywhere
            out[key.lstrip("+~")] = value
    return out


def _text(v) -> str:
    """A config value as an override writes it ("" for a config group: its choice names it)."""
    if isinstance(v, list):
        return "[" + ",".join(map(_text, v)) + "]"
    if isinstance(v, dict):
        return ""
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def _leaves(node, prefix: str = "") -> dict[str, str]:
    """"draft.topk" -> "2" for every setting of a resolved config."""
    if not isinstance(node, dict):
        return {prefix[:-1]: _text(node)} if prefix else {}
    return {k: v for key, sub in node.items() for k, v in _leaves(sub, f"{prefix}{key}.").items()}


def ran_with(job: Job, key: str) -> str:
    """The value `key` had in a job that did not override it (its default, or a preset's): the group choice
    from hydra.yaml, else the value in metrics.json's config, else the one in config.yaml, which holds
    interpolations (${...}) unresolved, so those are never shown; "" when none says."""
    def choice():
        hydra_cfg = yaml.safe_load((job.hydra / "hydra.yaml").read_text(encoding="utf-8")) or {}
        return ((hydra_cfg.get("hydra") or {}).get("runtime") or {}).get("choices", {})

    for source in (choice, lambda: _leaves((job.metrics or {}).get("config")),
                   lambda: _leaves(yaml.safe_load((job.hydra / "config.yaml").read_text(encoding="utf-8")))):
        try:
            value = source().get(key)
        except (OSError, yaml.YAMLError, TypeError, AttributeError):
            continue
        if value is not None and value != "" and "${" not in str(value):
            return str(value)
    return ""


def newest_sweep_size(sweep_dir: Path) -> Optional[int]:
    """How many jobs the newest sweep into sweep_dir has, from its multirun.yaml (Hydra rewrites it at every
    sweep's start): the command line's sweeps and a preset's hydra.sweeper.params, the command line winning,
    as the basic sweeper combines them. None when that cannot be told (no file, another sweeper, glob())."""
    try:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        hydra = (yaml.safe_load((sweep_dir / "multirun.yaml").read_text(encoding="utf-8")) or {}).get("hydra") or {}
        sweeper = hydra.get("sweeper") or {}
        if "BasicSweeper" not in str(sweeper.get("_target_", "")) or \
                (hydra.get("sweep") or {}).get("subdir", "${hydra.job.num}") != "${hydra.job.num}":
            return None  # another sweeper, or job folders not named by job number: keep them all
        task = [str(o) for o in ((hydra.get("overrides") or {}).get("task") or [])]
        params = [f"{k}={v}" for k, v in (sweeper.get("params") or {}).items() if v is not None]
        counts = {}
        for o in OverridesParser.create().parse_overrides(params + task):  # later (the command line) wins
            key = o.get_key_element()  # prefix kept, as the sweeper keys them: ++k and k are two sweeps
            counts[key] = len(list(o.sweep_string_iterator())) if o.is_sweep_override() else 1
    except Exception:  # unreadable, or a sweep the check cannot count: every job dir is kept
        return None
    return math.prod(counts.values())


def newest_sweep_points(sweep_dir: Path, most: int = 100_000) -> Optional[list[dict]]:
    """The newest sweep's points (key -> canonical text of the value as Hydra parses it), from its multirun.yaml, as
    the basic sweeper makes them; None when that cannot be told (another sweeper, a key given with two prefixes
    such as seed= and ++seed=, too many points), in the sweeper's order (job i runs point i). A value that holds
    ${...} (resolved only by the sweeper) is None, which any value matches. A job folder whose overrides are none of them is not this sweep's point: a re-sweep
    stopped by Ctrl-C leaves the jobs it did not reach as they were."""
    try:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        hydra = (yaml.safe_load((sweep_dir / "multirun.yaml").read_text(encoding="utf-8")) or {}).get("hydra") or {}
        sweeper = hydra.get("sweeper") or {}
        if "BasicSweeper" not in str(sweeper.get("_target_", "")):
            return None
        task = [str(o) for o in ((hydra.get("overrides") or {}).get("task") or [])]
        params = [f"{k}={v}" for k, v in (sweeper.get("params") or {}).items() if v is not None]
        if any("shuffle(" in o for o in params + task):  # drawn anew by every parse: neither order nor safe match
            return None
        values: dict[str, list] = {}
        prefixes: dict[str, str] = {}
        for o in OverridesParser.create().parse_overrides(params + task):
            element = o.get_key_element()
            key = element.lstrip("+~")
            if prefixes.setdefault(key, element[:len(element) - len(key)]) != element[:len(element) - len(key)]:
                return None  # the sweeper applies seed= and ++seed= apart: not retraced here
            if key == "resume":
                continue
            found = [hydra_value(key, v) for v in o.sweep_string_iterator()] if o.is_sweep_override() \
                else [o.value()]
            values[key] = [None if "${" in x else x for x in map(_canonical, found)]  # None: any value matches
        if math.prod(len(v) for v in values.values()) > most:
            return None
        return [dict(zip(values, combo)) for combo in itertools.product(*values.values())]  # job i: point i
    except Exception:
        return None


def _canonical(value) -> str:
    """A parsed override value as text that compares equal when the values are (NaN included)."""
    import json

    try:
        return json.dumps(value, sort_keys=True, default=str)
    except (TypeError, ValueError):
        return repr(value)


def is_point(overrides: Optional[dict], points: list[dict]) -> bool:
    """Whether a job's overrides (key -> text) are one of the newest sweep's points (none known: not told, so yes)."""
    return overrides is None or not points or any(matches(overrides, point) for point in points)


def matches(overrides: dict, point: dict) -> bool:
    mine = {k: _canonical(hydra_value(k, v)) for k, v in overrides.items()}
    return all(v is None or mine.get(k) == v for k, v in point.items())


def _recorded_overrides(job_dir: Path) -> Optional[dict[str, str]]:
    """The overrides metrics.json records (a job run by this version): what its results came from, even beside
    an earlier sweep's .hydra folder (a re-sweep with hydra.output_subdir=null or another name leaves it)."""
    metrics, _ = read_json_object(job_dir / "metrics.json")
    items = (metrics or {}).get("overrides")
    return _parse_overrides(items) if isinstance(items, list) else None


def job_number(job_dir: Path, hydra: Optional[Path]) -> Optional[int]:
    """The job's number in its sweep (hydra.job.num), or its folder's name when that is a number."""
    try:
        return int(yaml.safe_load((hydra / "hydra.yaml").read_text(encoding="utf-8"))["hydra"]["job"]["num"])
    except Exception:
        return int(job_dir.name) if job_dir.name.isdigit() else None


def _mtime(p: Path) -> float:
    try:
        return p.stat().st_mtime
    except OSError:
        return float("-inf")


def find_jobs(sweep_dir: Path, since: float = float("-inf"), size: Optional[int] = None,
              points: Optional[list] = None) -> tuple[list[Job], int]:
    """(every job dir under sweep_dir of the newest sweep, how many an earlier sweep left there).

    A job dir has metrics.json, error.json or a Hydra folder (hydra_dir). The leftovers of an earlier, longer
    sweep into the same folder are the jobs numbered `size` (the newest sweep's job count) or more; a job whose
    overrides are none of the newest sweep's `points` (newest_sweep_points: a stopped re-sweep leaves the jobs it
    did not reach) is kept but not ranked (STRAY); a sweep still running (the failure summary) also knows when it started: a job dir it
    did not write since then is older. (File times alone would not do for a report: a copied or cloned folder has
    them in any order.)
    """
    dirs = {p.parent for p in sweep_dir.rglob("metrics.json")} | {p.parent for p in sweep_dir.rglob("error.json")}
    dirs |= {p.parent.parent for p in sweep_dir.rglob("overrides.yaml")
             if p.parent.name == ".hydra" or all((p.parent / f).is_file() for f in HYDRA_FILES)}
    found = [(d, hydra_dir(d)) for d in sorted(dirs, key=lambda d: _natural(str(d.relative_to(sweep_dir))))]

    def newest(d: Path, h: Optional[Path]) -> bool:
        n = job_number(d, h) if size is not None else None
        if n is not None and n >= size:
            return False
        return max(_mtime(f) for f in (d / "metrics.json", d / "error.json",
                                       *([h / "overrides.yaml"] if h else []))) >= since

    kept = [(d, h) for d, h in found if newest(d, h)]
    own = {d: _recorded_overrides(d) for d, _ in kept}
    told_by = {d: own[d] if own[d] is not None else _overrides(h) if h else None for d, h in kept}
    strays = set() if points is None else {d for d, _ in kept if not is_point(told_by[d], points)}
    if len(strays) == len(kept):  # no job is one of the points: the points are what is wrong
        strays = set()
    numbered = {d: job_number(d, h) for d, h in kept if d not in strays and told_by[d] is not None}
    numbered = {d: n for d, n in numbered.items() if n is not None and points and 0 <= n < len(points)}
    off = {d for d, n in numbered.items() if not matches(told_by[d], points[n])}
    if len(off) * 2 < len(numbered):  # a point, but not its own number's (an older sweep's, in another order);
        strays |= off                 # when most are off, the order retraced is what is wrong
    jobs, told = [], []  # told: the overrides each job's error.json recorded (for jobs without overrides.yaml)
    for d, h in kept:
        overrides = own[d] if own[d] is not None and h is not None else _overrides(h)
        metrics, err = job_state(d, overrides)
        if d in strays:  # shown, never ranked: an earlier sweep's job the newest one did not reach, most likely
            metrics, err = None, STRAY
        jobs.append(Job(str(d.relative_to(sweep_dir)) if d != sweep_dir else ".", overrides, metrics, err, h))
        told.append({} if h is not None else _error_overrides(d, metrics))
    recorded = [t for (_, h), t in zip(kept, told) if h is None]
    if recorded and all(recorded):  # every job without a Hydra folder recorded its point: read as overrides.yaml
        for j, (_, h), t in zip(jobs, kept, told):
            if h is None:
                j.overrides = dict(t)
    keys = {k for j in jobs for k in j.overrides}
    if not keys:  # no overrides.yaml (hydra.output_subdir=null): the settings that differ between finished jobs,
        configs = [_leaves(j.metrics.get("config")) for j in jobs if j.metrics]  # and the failed jobs' points
        keys = {k for c in configs for k in c if k != "resume" and len({c2.get(k) for c2 in configs}) > 1}
        for k in {k for t in told for k in t} - keys:
            values = {c[k] for c in configs if k in c} | {t.get(k) for t in told if t}
            if k != "resume" and not k.startswith("hydra") and len(values) > 1:
                keys.add(k)
        for j, t in zip(jobs, told):
            source = _leaves(j.metrics.get("config")) if j.metrics else t
            j.overrides = {k: v for k, v in source.items() if k in keys}
    for j in jobs:
        for k in keys - set(j.overrides):  # a job that left a swept key at its default shows what it ran with
            if not k.startswith("hydra"):
                value = ran_with(j, k)
                if value:
                    j.overrides[k] = value
    return jobs, len(found) - len(kept)


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
            return (f"unfinished: its metrics.json is an earlier run's ({key}={_text(ran)} there, {key}={text} in "
                    f"this job's overrides), and this job left none (interrupted or killed); {RERUN}")
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


def _num(v: float, digits: int) -> str:
    """Fixed digits, or 4 significant ones for a value a damaged file made huge (1e308 printed 309 digits)."""
    return f"{v:.4g}" if abs(v) >= 1e9 else f"{v:.{digits}f}"


def _fmt(key: str, v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return _num(v, DIGITS.get(key, 3))
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
    lines = [f"Best: job {best.name}" + (f" ({shown})" if shown else "") + f", {_num(best.tps, 1)} tokens/s{over}", ""]
    if note:
        lines += [note, ""]
    if fixed:
        lines += ["Fixed in every job: " + ", ".join(f"`{k}={_escaped(v)}`" for k, v in fixed.items()), ""]
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
    ys = [plotted_acceptance(j.metrics.get("accept_length_mean")) for j in done]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    over = [j.within_limit is False for j in done]
    ax.scatter(xs, ys, s=28, zorder=2, edgecolors="tab:blue", facecolors=["none" if o else "tab:blue" for o in over])
    for j, x, y in zip(done, xs, ys):
        label = "/".join(j.overrides.get(k, "") for k in varied) or j.name
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    best = done.index(best)
    ax.scatter([xs[best]], [ys[best]], s=220, marker="*", color="tab:red", zorder=3,
               label=f"best: job {done[best].name}, {_num(xs[best], 1)} tokens/s")
    ax.set_xlabel("tokens/s")
    ax.set_ylabel("acceptance length (tokens per verify step)")
    ax.set_title("labels: " + " / ".join(varied) if varied else "one point per job", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def plotted_acceptance(v) -> float:
    """A job's acceptance length on the plot: 1 (one token a step, as draft=none) when it has none, or none
    finite (a NaN one left the best job's point and star undrawn)."""
    return float(v) if is_number(v) and finite(v) else 1.0


def report(sweep_dir: Path, out: Path, every_job: bool = False) -> tuple[list[Job], str]:
    """Write report.csv, report.md and report.png for sweep_dir (its newest sweep's jobs, unless every_job)
    into out; (jobs fastest first, markdown)."""
    jobs, older = find_jobs(sweep_dir, size=None if every_job else newest_sweep_size(sweep_dir),
                            points=None if every_job else newest_sweep_points(sweep_dir))
    jobs = sort_jobs(jobs)
    varied, fixed = varied_keys(jobs)
    header, table = rows(jobs, varied)
    best = best_job(jobs)
    out.mkdir(parents=True, exist_ok=True)
    md = markdown(header, table, fixed, best, varied, older_note(sweep_dir, older))
    # all three or none: each is written aside, then renamed (a report.png that could not be written left a new
    # report.csv and report.md beside the old plot)
    tmp = {name: out / f".{name}.tmp" for name in ("report.csv", "report.md", "report.png")}
    try:
        write_csv(tmp["report.csv"], header, table)
        tmp["report.md"].write_text(md, encoding="utf-8")
        plot(tmp["report.png"], jobs, varied, best)
        for name, path in tmp.items():
            if (out / name).is_dir():
                raise IsADirectoryError(21, "Is a directory", str(out / name))
    except BaseException:
        for path in tmp.values():
            path.unlink(missing_ok=True)
        raise
    for name, path in tmp.items():
        os.replace(path, out / name)
    return jobs, md


def no_metrics_message(sweep_dir: Path, jobs: list[Job], older: int = 0) -> str:
    if not sweep_dir.is_dir():
        return (f"specpipe.report: {sweep_dir} is not a directory. Give the folder of a sweep, e.g. "
                "multirun/2026-01-31/12-00-00 or the hydra.sweep.dir you chose.")
    why = f"{len(jobs)} job dir(s) were found but none finished" if jobs else "it holds no job dirs"
    first = next((" ".join(j.error.split()) for j in jobs if j.error and j.error != UNFINISHED), None)
    return (f"specpipe.report: no metrics.json under {sweep_dir}: {why}, so there is nothing to report. "
            + (older_note(sweep_dir, older) + " " if older else "")
            + (f"The first failed job says: {first}" + ("" if first.endswith((".", "!", "?")) else ".") + " "
               if first else "")
            + "Give the folder of a sweep (`python -m specpipe -m ...` prints it as the sweep output dir), "
            "whose numbered job dirs each get metrics.json when their run finishes.")


def out_problem(out: Path) -> Optional[str]:
    """Why the report cannot be written into the folder out (which is created when missing), or None."""
    if out.exists() and not out.is_dir():
        return (f"specpipe.report: --out {out} is an existing file, not a folder: --out names the folder that "
                "report.csv, report.md and report.png are written into (it is created when missing), "
                f"e.g. --out {out.parent}")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return (f"specpipe.report: cannot create the folder {out} for the report ({e.strerror or e}"
                + (f": {e.filename}" if e.filename and str(e.filename) != str(out) else "") + "). Give --out a "
                "folder you can write to (it is created when missing), or drop --out to write into SWEEP_DIR.")
    return None


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m specpipe.report", description=__doc__.splitlines()[0])
    ap.add_argument("sweep_dir", type=Path, help="a multirun folder (hydra.sweep.dir)")
    ap.add_argument("--out", type=Path, default=None, help="where to write report.* (default: SWEEP_DIR)")
    ap.add_argument("--all", action="store_true", dest="every_job",
                    help="also report the job dirs older than the newest sweep in SWEEP_DIR (an earlier sweep's)")
    args = ap.parse_args(argv)
    size = None if args.every_job else newest_sweep_size(args.sweep_dir)
    points = None if args.every_job else newest_sweep_points(args.sweep_dir)
    jobs, older = find_jobs(args.sweep_dir, size=size, points=points) if args.sweep_dir.is_dir() else ([], 0)
    if not any(j.metrics is not None for j in jobs):
        print(no_metrics_message(args.sweep_dir, jobs, older), file=sys.stderr)
        sys.exit(2)
    out = args.out or args.sweep_dir
    problem = out_problem(out)
    if problem:
        print(problem, file=sys.stderr)
        sys.exit(2)
    try:
        jobs, md = report(args.sweep_dir, out, args.every_job)
    except OSError as e:
        print(f"specpipe.report: cannot write the report into {out}: {e.strerror or e}"
              + (f" ({e.filename})" if e.filename else "") + ". Give --out a folder you can write to.",
              file=sys.stderr)
        sys.exit(2)
    failed = sum(j.metrics is None for j in jobs)
    try:
        print(md)
        print(f"{len(jobs)} jobs ({failed} without metrics) -> {out / 'report.csv'}, {out / 'report.md'}, "
              f"{out / 'report.png'}", flush=True)
    except BrokenPipeError:  # `... | head`: the report files are written; the rest of the text is not wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nor is the flush at exit


def _one_line(text: str, limit: int = 200) -> str:
    text = " ".join(text.removeprefix("specpipe: ").split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def failure_summary(sweep_dir: Path, since: float) -> Optional[str]:
    """The end-of-sweep list of this sweep's failed jobs, or None when none failed.

    A job dir belongs to this sweep when it was written at or after `since` (a time.time(); see find_jobs);
    leftovers of an earlier, longer sweep in the same folder are not counted. A job of this sweep failed when
    it wrote an error.json, or has no usable metrics.json (e.g. killed under a launcher that runs jobs elsewhere).
    """
    jobs = find_jobs(sweep_dir, since)[0] if sweep_dir.is_dir() else []
    failed = []
    for j in jobs:
        d = sweep_dir / j.name
        has_error, message = error_message(d)
        if has_error and _mtime(d / "error.json") >= since:
            failed.append((j, message, f"{d / 'error.json'}"))
        elif j.metrics is None:  # killed, or left with a damaged metrics.json; an older error.json is not its story
            failed.append((j, UNFINISHED if has_error else j.error, f"{d} (no error.json from this sweep)"))
    if not failed:
        return None
    tabulate = (f"The other jobs' results are in {sweep_dir}: `python -m specpipe.report {sweep_dir}` tabulates them."
                if any(j.metrics is not None for j in jobs) else "No job finished, so there is nothing to tabulate.")
    varied, _ = varied_keys(jobs)
    lines = [f"specpipe: {len(failed)} of {len(jobs)} jobs failed:"]
    for j, message, where in failed:
        shown = " ".join(f"{k}={j.overrides[k]}" for k in varied if k in j.overrides)
        lines.append(f"  job {j.name}" + (f" ({shown})" if shown else "") + f": {_one_line(message)}")
        lines.append(f"    {where}")
    lines.append(f"Each error.json says why (a crash's holds its traceback). {tabulate} To run only the failed "
                 f"jobs again, repeat the command with resume=true (and hydra.sweep.dir={sweep_dir} if it did not "
                 "set one).")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
