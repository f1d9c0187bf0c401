"""python -m specpipe.report SWEEP_DIR [--out DIR]: one table and one plot for a whole sweep.

Reads the job dirs under SWEEP_DIR (metrics.json, error.json, .hydra/overrides.yaml) and writes
report.csv, report.md and report.png (and report_batch.png, tokens/s over batch size, when the sweep varies
workload.batch_size). The columns are the overrides that differ between jobs, so
the table shows what the sweep varied and nothing that stayed fixed (without overrides.yaml, as with
hydra.output_subdir=null: the settings of metrics.json's config that differ). Only the jobs of the newest
sweep in SWEEP_DIR are read (--all reads every one): a new sweep into the same folder leaves the higher
numbered jobs of an earlier, longer one in place. A job that failed shows its
error.json message (for a crash, the exception); one that was interrupted or killed (a job dir without
either file) shows that, and so does one whose metrics.json or error.json cannot be read, saying why.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional

from specpipe.sweep.jobs import UNFINISHED, Job, error_message, find_jobs
from specpipe.sweep.overrides import mtime
from specpipe.sweep.plot import BATCH_KEY, plot, plot_by_batch
from specpipe.sweep.points import newest_sweep_points, newest_sweep_size
from specpipe.sweep.tables import best_job, markdown, older_note, rows, sort_jobs, varied_keys, write_csv


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
    names = ("report.csv", "report.md", "report.png") + (("report_batch.png",) if BATCH_KEY in varied else ())
    tmp = {name: out / f".{name}.tmp" for name in names}
    try:
        write_csv(tmp["report.csv"], header, table)
        tmp["report.md"].write_text(md, encoding="utf-8")
        plot(tmp["report.png"], jobs, varied, best)
        if "report_batch.png" in tmp:  # tokens/s over batch size, a line per policy / drafter / ...
            plot_by_batch(tmp["report_batch.png"], jobs, varied)
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
        if has_error and mtime(d / "error.json") >= since:
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
