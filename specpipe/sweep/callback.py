"""`SweepSummary`, the Hydra callback (conf/config.yaml, hydra.callbacks) that keeps a sweep going when a job
raises an unexpected exception (recorded in that job's error.json, traceback included) and, at the end of the
sweep, lists the jobs that failed and exits with status 1 when there are any.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from specpipe.notes import logger
from specpipe.sweep.claims import COLLIDED, collisions
from specpipe.sweep.job_files import TRACEBACK_FRAMES, crash_message, write_crash
from specpipe.sweep.report import failure_summary
from specpipe.sweep.scoring import failed_objective

log = logger(__name__)

def file_clock(folder: Path) -> float:
    """The time now, as the filesystem of folder (created if missing) stamps files: the jobs' files are later.

    A shared filesystem (Slurm) stamps files with its server's clock, which may differ from this machine's."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".specpipe-clock-") as f:
            return os.fstat(f.fileno()).st_mtime
    except OSError:
        return time.time() - 1.0


STARTED_SWEEP: dict = {}  # the folder of the sweep this process started (set where the sweep runs, not in a worker)


class SweepSummary(Callback):
    """Hydra callback for multiruns (conf/config.yaml: hydra.callbacks.sweep_summary), with any launcher.

    on_job_end runs where the job ran: an unexpected exception of a job (a config error is already caught
    and recorded by the job itself) is written to the job's error.json with its traceback, and the job
    returns failed_objective (NaN; for Optuna the worst score) to the sweeper instead of raising, so the other
    jobs still run. on_multirun_end runs where the sweep was started: it lists the jobs of this sweep that failed
    and exits with status 1 when there are any. Single runs and Ctrl-C (KeyboardInterrupt is not an
    Exception, so Hydra does not catch it and no callback sees it) are left as they are.
    """

    def __init__(self) -> None:
        self.started = time.time()

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        STARTED_SWEEP["dir"] = str(config.hydra.sweep.dir)  # where Ctrl-C sends the user back to (any launcher)
        self.started = file_clock(Path(STARTED_SWEEP["dir"]))

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        from hydra.core.utils import JobStatus
        from hydra.types import RunMode

        exc = getattr(job_return, "_return_value", None)
        if (config.hydra.mode != RunMode.MULTIRUN or job_return.status != JobStatus.FAILED
                or not isinstance(exc, Exception)):
            return
        out_dir = config.hydra.runtime.output_dir
        where = f"the traceback is in {out_dir}/error.json"
        try:
            message = write_crash(out_dir, exc, overrides=[str(o) for o in config.hydra.overrides.task])
        except OSError as e:  # keep the sweep going; the traceback goes to the terminal instead
            message, where = crash_message(exc), f"{out_dir}/error.json could not be written ({e}), so the " \
                                                 "traceback is printed above"
            traceback.print_exception(type(exc), exc, exc.__traceback__, limit=-TRACEBACK_FRAMES)
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            traceback.print_exception(type(exc), exc, exc.__traceback__)
        log.warning(f"specpipe: job {config.hydra.job.num} {message}. This is not a configuration error; {where}. "
                    "The sweep goes on with the next job.")
        job_return.return_value = failed_objective(config.hydra)
        job_return.status = JobStatus.COMPLETED

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            text = failure_summary(Path(str(config.hydra.sweep.dir)), since=self.started)
        except Exception as e:  # a warning from Hydra would end the sweep with status 0 and no list of failures
            text = (f"specpipe: the list of this sweep's failed jobs could not be made ({crash_message(e)}); run "
                    f"python -m specpipe.report {config.hydra.sweep.dir} to see each job's status")
        skipped = list(dict.fromkeys([*(" ".join(c.split()) for c in COLLIDED), *collisions(config.hydra.sweep.dir)]))
        COLLIDED.clear()
        if skipped:  # jobs that shared a folder with an earlier job: skipped, and never in an error.json
            text = "\n".join([*([text] if text else []), *(f"specpipe: {c}" for c in skipped)])
        if text:
            log.info(text)
            sys.exit(1)
