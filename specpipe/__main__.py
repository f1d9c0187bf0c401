"""python -m specpipe [group=option ...] [key=value ...] [-m for sweeps]."""
from __future__ import annotations

import contextlib
import shlex
import signal
import sys
import threading
from pathlib import Path

import hydra
from omegaconf import DictConfig

from specpipe.config.schema import register_schemas
from specpipe.notes import logger

log = logger("specpipe.__main__")  # run as a script its __name__ is "__main__", outside the specpipe logger


RUNNING: dict = {}  # the in-process sweep's current job: num, dir, sweep_dir
WRITTEN: dict = {}  # job folder -> the job of this process's sweep that wrote it


class Terminated(KeyboardInterrupt):
    """SIGTERM (`kill`, `timeout`, a job scheduler's stop), raised where Ctrl-C raises KeyboardInterrupt, so that
    it ends a run as Ctrl-C does: the finished requests kept and the resume command printed; exit 143 (128 + 15)
    instead of 130. It left the partial file but said nothing."""


@contextlib.contextmanager
def sigterm_stops_as_ctrl_c():
    """SIGTERM raises Terminated in the main thread while this block runs (the handler before it comes back
    after: main() called from a program or a test leaves that program's handler in place)."""
    def terminate(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
        raise Terminated()

    # (a SIGTERM the parent process ignores stays ignored, as Python leaves an ignored SIGINT)
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:
        yield
        return
    before = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if before is None else before)


def stopped(e: KeyboardInterrupt) -> tuple[str, int]:
    """What stopped the run, said as its message begins, and the exit status: Ctrl-C 130, SIGTERM 143."""
    return ("stopped by SIGTERM", 143) if isinstance(e, Terminated) else ("interrupted", 130)


def let_a_second_ctrl_c_kill() -> None:
    """Once a Ctrl-C is being handled, the next one ends the process at once, as SIGINT does by default. Raised as
    KeyboardInterrupt during the interpreter's shutdown instead, a quick second press printed "Exception ignored
    ... KeyboardInterrupt" tracebacks from torch's and threading's exit hooks."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupted_sweep(how: str = "interrupted") -> str:
    """One paragraph for Ctrl-C (or SIGTERM: `how`) during a sweep: what stopped, what is kept, how to go on."""
    if RUNNING:
        where = f" in job {RUNNING['num']} ({RUNNING['dir']})"
        again = "resume=true " + shlex.quote(f"hydra.sweep.dir={RUNNING['sweep_dir']}")
    else:  # a launcher's worker processes run the jobs; the sweep's callback saw its folder here
        from specpipe.sweep.callback import STARTED_SWEEP

        folder = STARTED_SWEEP.get("dir")
        where = f" ({folder})" if folder else ""
        again = "resume=true " + shlex.quote(f"hydra.sweep.dir={folder}") if folder else \
            "resume=true and hydra.sweep.dir set to this sweep's folder"
    return (f"specpipe: sweep {how}{where}; finished jobs keep their files (the interrupted one has no "
            f"metrics.json); run the same command again with {again} to skip the finished jobs and go on (the "
            f"interrupted job keeps the requests it had finished)")


def import_run():
    """specpipe.run.run, which imports torch: a broken device backend fails here, said in one paragraph."""
    try:
        from specpipe.run import run
    except RuntimeError as e:
        from specpipe.devices import explain_backend_load_error

        msg = explain_backend_load_error(e)
        if msg is None:
            raise
        print("specpipe: " + msg, file=sys.stderr)
        sys.exit(2)
    return run


def folder_taken(hc, out_dir: str) -> bool:
    """Whether another job of this sweep already wrote `out_dir` (then this job is skipped, said on stderr and
    in the sweep's notes). Also records which job a Ctrl-C stops (main() says so)."""
    RUNNING.update(num=hc.job.num, dir=out_dir, sweep_dir=hc.sweep.dir)
    earlier = WRITTEN.setdefault(out_dir, hc.job.num)
    if earlier == hc.job.num:  # this process's jobs, then other processes' (a joblib worker's)
        from specpipe.sweep.claims import claim_folder

        earlier = claim_folder(out_dir, hc.sweep.dir, hc.job.num)
    if earlier is None:
        return False
    # e.g. hydra.sweep.subdir=${draft.topk} while the allocator is swept too
    from specpipe.sweep.claims import COLLIDED, note_collision

    COLLIDED.append(f"job {hc.job.num} ({' '.join(hc.overrides.task)}) would write into {out_dir}, which "
                    f"job {earlier} of this sweep already wrote; it was skipped so that job's results stay. "
                    f"Make hydra.sweep.subdir differ between jobs (its default is ${{hydra.job.num}})")
    note_collision(hc.sweep.dir, COLLIDED[-1])
    log.info(f"specpipe: {COLLIDED[-1]}")
    return True


def interrupted_run(out_dir: str, how: str = "interrupted") -> str:
    """One paragraph for Ctrl-C (or SIGTERM: `how`) during a single run: where the finished requests are, and how
    to go on."""
    from specpipe.outputs.files import PartialCompletions

    partial = Path(out_dir) / PartialCompletions.NAME
    if partial.is_file():
        return (f"specpipe: {how}; the requests that had finished are in {partial} (in the order they "
                f"finished; no metrics.json was written). To decode only the others, run the same command with "
                f"resume=true {shlex.quote('hydra.run.dir=' + str(out_dir))}")
    # stopped before decoding began (loading the model, reading the prompts)
    return f"specpipe: {how} before decoding began; nothing was written"


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def hydra_main(cfg: DictConfig) -> float:
    from hydra.core.hydra_config import HydraConfig

    run = import_run()
    from specpipe.errors import SpecpipeError
    from specpipe.outputs.run_files import clear_outputs
    from specpipe.sweep.job_files import clear_error, finished_metrics, write_error
    from specpipe.sweep.scoring import failed_objective, job_score

    hc = HydraConfig.get()
    multirun = hc.mode.name == "MULTIRUN"
    out_dir = hc.runtime.output_dir
    if multirun and folder_taken(hc, out_dir):
        return failed_objective(hc)
    done = finished_metrics(cfg, out_dir) if cfg.resume else None
    if done is not None:  # resume=true: this job finished in an earlier run of the same sweep dir
        log.info(f"resume: {out_dir} already has metrics.json for this config; skipped")
        return job_score(done, cfg.latency_limit_ms, hc)
    overrides = [str(o) for o in hc.overrides.task]  # the job's point, for error.json
    # a sweep's job writes here now: nothing an earlier sweep left in its folder may pass for this job's results if
    # it fails or is stopped (resume=true would skip it as finished). A single run sets earlier results aside only
    # once it starts writing its own (run() does), so one refused by a check against the model loses nothing.
    if multirun:  # (a stopped run's partial file is set aside as *.prev, where resume=true still reads it)
        clear_outputs(out_dir)
    try:
        result = run(cfg, out_dir=out_dir, overrides=overrides)
    except KeyboardInterrupt as e:
        if multirun:  # Ctrl-C ends the whole sweep (finished jobs keep their files)
            raise
        let_a_second_ctrl_c_kill()
        how, status = stopped(e)
        print(interrupted_run(out_dir, how), file=sys.stderr)
        sys.exit(status)
    except SpecpipeError as e:
        msg = str(e) if str(e).startswith("specpipe:") else f"specpipe: {e}"  # every user error reads the same
        print(msg, file=sys.stderr)
        if multirun:  # one bad point must not end an overnight sweep
            try:
                write_error(out_dir, msg, overrides=overrides)
            except OSError:  # the disk that could not take the outputs may not take this either
                pass
            return failed_objective(hc)
        sys.exit(e.exit_code)
    clear_error(out_dir)  # (a single run into a folder that held a failed sweep job's)
    m = result["metrics"]
    all_failed = m["num_requests"] and m["num_errors"] == m["num_requests"]
    if all_failed and multirun:  # a failed point, as a single run is
        first = (m.get("request_errors") or [{}])[0].get("error", "")
        msg = f"every request failed ({m['num_errors']} of {m['num_requests']}; the first: {first})"
        print(f"specpipe: job {hc.job.num}: {msg}", file=sys.stderr)
        write_error(out_dir, msg, overrides=overrides)
        return failed_objective(hc)
    if all_failed:
        print(f"specpipe: every request failed ({m['num_errors']} of {m['num_requests']}; the reasons are listed "
              "above and in completions.jsonl)", file=sys.stderr)
        sys.exit(1)
    return job_score(m, cfg.latency_limit_ms, hc)


def main() -> None:
    with sigterm_stops_as_ctrl_c():
        run_main()


def run_main() -> None:
    register_schemas()
    from specpipe.cli.argv import expand_globs, flags_first, split_args
    from specpipe.cli.precheck import precheck
    from specpipe.cli.usage import hide_schemas_from_completion, usage
    from specpipe.config.overrides import expand_home

    if any(a in ("--help", "-h") for a in sys.argv[1:]):
        print(usage(sys.argv[1:]))
        return
    if any(a in ("--shell-completion", "-sc") for a in sys.argv[1:]):
        hide_schemas_from_completion()

    try:  # the precheck composes every job's config first (seconds for a large sweep): Ctrl-C there too
        sys.argv[1:] = expand_globs(flags_first(expand_home(sys.argv[1:])))
        err = precheck(sys.argv[1:])
        if err:
            print(err, file=sys.stderr)
            sys.exit(2)
        hydra_main()
    except KeyboardInterrupt as e:  # a single run handles its own; this is a sweep, or before any job ran
        let_a_second_ctrl_c_kill()
        how, status = stopped(e)
        multirun = bool(RUNNING) or split_args(sys.argv[1:])[1]  # RUNNING: a job of a sweep preset had begun
        print(interrupted_sweep(how) if multirun else f"specpipe: {how}", file=sys.stderr)
        sys.exit(status)


if __name__ == "__main__":
    main()
