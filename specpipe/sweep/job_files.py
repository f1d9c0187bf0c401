"""A sweep job's own files: its metrics.json read back (is it a finished run of this same job, for
resume=true?) and its error.json (why it failed, a crash's traceback included).

A job's output dir is finished when it holds a readable metrics.json (the run renames it into place last), so an
interrupted or crashed job never looks finished and a resumed sweep re-runs it; so does a job whose metrics.json
is damaged (truncated, empty, not a JSON object).
"""
from __future__ import annotations

import copy
import json
import math
import traceback
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig

from specpipe.config.schema import is_number
from specpipe.config.validate import expand_user_paths, to_container
from specpipe.notes import logger
from specpipe.outputs.resume import model_files_digest
from specpipe.outputs.run_files import json_kind, read_json_object, write_json
from specpipe.outputs.run_identity import config_differences, prompts_digest

log = logger(__name__)

TRACEBACK_FRAMES = 8  # the last frames of a crashed job's traceback kept in its error.json


def finite(v) -> bool:
    """math.isfinite for any JSON number: an integer too large for a float (10**400) is not finite either."""
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def metrics_problem(m: dict, keys=("tokens_per_s", "step_latency_ms_p90")) -> Optional[str]:
    """Why a metrics.json object cannot be a finished job's metrics (None when it can): tokens_per_s must be a
    finite number, every other key of `keys` it holds a number or null, and its config an object."""
    if not is_number(m.get("tokens_per_s")) or not finite(m["tokens_per_s"]):
        return ("metrics.json has no tokens_per_s" if m.get("tokens_per_s") is None else
                f"metrics.json has tokens_per_s={json.dumps(m['tokens_per_s'])[:40]}, not a finite number")
    for k in (*keys, "accept_length_mean"):
        if m.get(k) is not None and not is_number(m[k]):
            return f"metrics.json has {k}={json.dumps(m[k])[:40]}, not a number"
        if is_number(m.get(k)) and not (isinstance(m[k], float) and math.isnan(m[k])) and not finite(m[k]):
            return f"metrics.json has {k}={json.dumps(m[k])[:40]}, not a finite number"
    cfg = m.get("config", {})
    if not isinstance(cfg, dict):
        return f"metrics.json has a config that is {json_kind(cfg)}, not an object"
    if cfg.get("latency_limit_ms") is not None and not is_number(cfg["latency_limit_ms"]):
        return f"metrics.json has config.latency_limit_ms={json.dumps(cfg['latency_limit_ms'])[:40]}, not a number"
    return None


def _same_run(stored: dict, current: dict, job: Optional[DictConfig] = None) -> bool:
    """Whether two resolved configs ran the same job (`config_differences` finds none)."""
    return not config_differences(stored, current, job)


def _same_prompts(cfg: DictConfig, stored: dict, where: Path) -> bool:
    want = stored.get("prompts_sha256")
    if want is None:  # a run of an older specpipe: its config is all there is to compare
        return True
    w = cfg.workload
    if w.prompts_file == "-":
        log.info(f"resume: {where}: its prompts came from standard input, which cannot be compared with the earlier "
                 f"run's, so the job runs again")
        return False
    from specpipe.workload.prompts import load_prompts

    try:
        items = load_prompts(w.prompts_file, w.prompt_set, w.num_prompts)
    except Exception:  # the run itself reports what is wrong with the file
        return False
    if prompts_digest(items) != want:
        log.info(f"resume: {where}: the prompts differ from the earlier run's (workload.prompts_file changed since), "
                 f"so the job runs again")
        return False
    return True


def finished_metrics(cfg: DictConfig, out_dir: str) -> Optional[dict]:
    """The job's stored metrics when out_dir already holds a finished run of this same config and prompts, else
    None.

    Comparing configs matters because Hydra names job dirs by job number: re-running a stable
    sweep dir with different values must not reuse job 3's old results for a new job 3. A metrics.json
    that cannot be read (truncated, not UTF-8, not a JSON object) is not a finished run: the job runs again.
    """
    path = Path(out_dir) / "metrics.json"
    if (path.parent / "error.json").exists():  # a failed job (every request failed) keeps its metrics.json too
        log.info(f"resume: {path.parent} failed last time (error.json), so the job runs again")
        return None
    stored, why = read_json_object(path)
    if stored is not None:
        why = metrics_problem(stored)
    if why is not None:
        log.info(f"resume: {path.parent}: {why}, so the job runs again")
        return None
    if stored is None:
        return None
    job = copy.deepcopy(cfg)
    expand_user_paths(job)  # the stored config has its paths made absolute, as the run saw them
    if not _same_run(stored.get("config", {}), to_container(job), job):
        return None
    if not _same_prompts(job, stored, path.parent):
        return None
    folders, digest = stored.get("model_folders"), stored.get("model_files_sha256")
    if isinstance(folders, list) and all(isinstance(f, str) for f in folders) and isinstance(digest, str):
        if model_files_digest(folders) != digest:  # weights retrained or replaced under the same path
            log.info(f"resume: {path.parent}: the model files in {', '.join(folders)} changed since the job finished, "
                     f"so the job runs again")
            return None
    return stored


def write_error(out_dir: str, error: str, **details: Any) -> None:
    """Record why a sweep job failed, so `python -m specpipe.report` can show it as a row.

    error.json holds {"error": error, "crash": false} for a config error; `write_crash` adds the
    exception's type, message and traceback, with "crash": true. The job's command-line overrides go in as
    "overrides" (a list, as Hydra's overrides.yaml holds them), so that the report can name the job's point
    even when hydra.output_subdir=null saved no overrides.yaml."""
    write_json(Path(out_dir) / "error.json", {"error": error, "crash": False, **details})


def crash_message(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"crashed: {type(exc).__name__}" + (f": {text}" if text else "")


def write_crash(out_dir: str, exc: BaseException, **details: Any) -> str:
    """Record an unexpected exception of a sweep job in its error.json; the message the report shows."""
    message = crash_message(exc)
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-TRACEBACK_FRAMES))
    kind = type(exc).__qualname__
    kind = kind if type(exc).__module__ == "builtins" else f"{type(exc).__module__}.{kind}"
    write_error(out_dir, message, crash=True, exception=kind, message=str(exc), traceback=tb, **details)
    return message


def clear_error(out_dir: str) -> None:
    """A job that succeeds on a re-run drops the error of its earlier attempt."""
    (Path(out_dir) / "error.json").unlink(missing_ok=True)
