"""Per-job sweep support: resume a finished job, record a failed one, score a run for a sweeper.

A job's output dir is finished when it holds a readable metrics.json (app.write_outputs renames it into
place last), so an interrupted or crashed job never looks finished and a resumed sweep re-runs it; so
does a job whose metrics.json is damaged (truncated, empty, not a JSON object).

`SweepSummary` is the Hydra callback (conf/config.yaml, hydra.callbacks) that keeps a sweep going when a
job raises an unexpected exception (recorded in that job's error.json, traceback included) and, at the
end of the sweep, lists the jobs that failed and exits with status 1 when there are any.
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Optional

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from specpipe.resume import META, PARTIAL
from specpipe.schema import is_number
from specpipe.validate import PATH_KEYS, expand_user_paths, to_container

COLLIDED: list = []  # this process's sweep: why each job that found its folder taken was skipped


def sweep_id(sweep_dir) -> Optional[str]:
    """This sweep's identity, the same in every job's process (a launcher's workers too): when Hydra saved the
    sweep's multirun.yaml, at its start. None without one."""
    try:
        return str((Path(str(sweep_dir)) / "multirun.yaml").stat().st_mtime_ns)
    except OSError:
        return None


def claim_folder(out_dir, sweep_dir, num: int) -> Optional[str]:
    """None when the job folder out_dir is job `num`'s; else the number of the job of this sweep that claimed it
    first ("?" if unreadable). The claim is a file in the folder, so a launcher's separate worker processes
    (joblib) see each other's; two jobs writing one folder went unnoticed there."""
    sid = sweep_id(sweep_dir)
    if sid is None:
        return None
    folder = Path(str(out_dir))
    claim = folder / f".specpipe_claim_{sid}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        other = ""
        for _ in range(20):  # the claimer writes its number just after creating the file
            try:
                other = claim.read_text().strip()
            except OSError:
                other = ""
            if other:
                break
            time.sleep(0.05)
        return None if other == str(num) else (other or "?")
    except OSError:  # an unwritable folder: the run's own write says so
        return None
    with os.fdopen(fd, "w") as f:
        f.write(str(num))
    for old in folder.glob(".specpipe_claim_*"):  # an earlier sweep's
        if old != claim:
            old.unlink(missing_ok=True)
    return None


def note_collision(sweep_dir, message: str) -> None:
    """Record a skipped job for the end of the sweep, which runs in the launcher's process."""
    sid = sweep_id(sweep_dir)
    if sid is not None:
        try:
            with open(Path(str(sweep_dir)) / f".specpipe_collisions_{sid}", "a", encoding="utf-8") as f:
                f.write(" ".join(message.split()) + "\n")
        except OSError:
            pass


def collisions(sweep_dir) -> list[str]:
    """The skipped jobs' messages `note_collision` recorded in this sweep."""
    sid = sweep_id(sweep_dir)
    try:
        text = (Path(str(sweep_dir)) / f".specpipe_collisions_{sid}").read_text(encoding="utf-8") if sid else ""
    except OSError:
        return []
    return [line for line in text.splitlines() if line]
NOT_RUN_KEYS = ("resume", "latency_limit_ms")  # change how a job is scored or skipped, not what it computes
TRACEBACK_FRAMES = 8  # the last frames of a crashed job's traceback kept in its error.json


def _kind(value) -> str:
    if isinstance(value, list):
        return "a JSON array"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return "a number"


def read_json_object(path: Path) -> tuple[Optional[dict], Optional[str]]:
    """(the JSON object in path, None); (None, None) when there is no such file; else (None, why the file
    cannot be used), a phrase that starts with the file's name: "metrics.json is empty"."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, f"{path.name} cannot be read ({e.strerror or e})"
    if not data.strip():
        return None, f"{path.name} is empty"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, f"{path.name} is not valid UTF-8 JSON (byte 0x{data[e.start]:02x} at offset {e.start})"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        cut = e.pos >= len(text.rstrip()) or (e.msg.startswith("Unterminated string") and '"' not in text[e.pos + 1:])
        msg = e.msg.removesuffix(" at")  # ("Unterminated string starting at")
        return None, (f"{path.name} is unreadable ({'truncated' if cut else 'invalid'} JSON: {msg} at line {e.lineno} "
                      f"column {e.colno})")
    except RecursionError:
        return None, f"{path.name} is unreadable (JSON nested too deeply)"
    if not isinstance(value, dict):
        return None, f"{path.name} is not a JSON object (it holds {_kind(value)})"
    return value, None


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
        return f"metrics.json has a config that is {_kind(cfg)}, not an object"
    if cfg.get("latency_limit_ms") is not None and not is_number(cfg["latency_limit_ms"]):
        return f"metrics.json has config.latency_limit_ms={json.dumps(cfg['latency_limit_ms'])[:40]}, not a number"
    return None


def schema_default(cfg: Optional[DictConfig], path: tuple) -> tuple[bool, Any]:
    """(True, the default) of the setting at `path` from the dataclass schema of its parent node in `cfg`, or
    (False, None) when no schema says."""
    import dataclasses

    from omegaconf import OmegaConf

    if cfg is None:
        return False, None
    parent = OmegaConf.select(cfg, ".".join(path[:-1])) if len(path) > 1 else cfg
    schema = OmegaConf.get_type(parent) if isinstance(parent, DictConfig) else None
    if not dataclasses.is_dataclass(schema):
        return False, None
    for f in dataclasses.fields(schema):
        if f.name == path[-1]:
            if f.default is not dataclasses.MISSING:
                return True, f.default
            if f.default_factory is not dataclasses.MISSING:
                value = f.default_factory()
                return True, to_container(OmegaConf.structured(value)) if dataclasses.is_dataclass(value) else value
    return False, None


def config_differences(stored: dict, current: dict, job: Optional[DictConfig] = None) -> list:
    """The settings two resolved configs ran differently, as (dotted key, stored value, current value): every
    setting both hold must be equal; a setting only the job holds must be at its schema default (a newer specpipe
    added it: a sweep started before an upgrade still resumes; every finished job ran again, its results gone,
    when the upgrade added sampling.min_p); a setting only the stored run holds (an older specpipe's, since
    dropped) is left out."""
    out = []

    def walk(a, b, path: tuple) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for k in a:
                if k in b:
                    walk(a[k], b[k], path + (k,))
            for k in b.keys() - a.keys():
                known, default = schema_default(job, path + (k,))
                if not (known and default == b[k]):
                    out.append((".".join(path + (k,)), None, b[k]))
        elif a != b and not same_file(".".join(path), a, b):
            out.append((".".join(path), a, b))

    strip = lambda c: {k: v for k, v in c.items() if k not in NOT_RUN_KEYS}  # noqa: E731
    walk(strip(stored), strip(current), ())
    return out


def same_file(key: str, a: Any, b: Any) -> bool:
    """Whether two values of a path setting name one file from here (relative and absolute, through a symlink). The
    path is only the name: what resume relies on, the prompts' and the model files' contents, is compared apart."""
    if key not in PATH_KEYS or not (isinstance(a, str) and isinstance(b, str)) or "-" in (a, b):
        return False
    return os.path.realpath(os.path.expanduser(a)) == os.path.realpath(os.path.expanduser(b))


def _same_run(stored: dict, current: dict, job: Optional[DictConfig] = None) -> bool:
    """Whether two resolved configs ran the same job (`config_differences` finds none)."""
    return not config_differences(stored, current, job)


def prompts_digest(items: list) -> str:
    """sha256 of the prompts a run decoded (each one's JSON object, keys sorted), kept in metrics.json as
    `prompts_sha256`: resume=true compares it, so a prompts file rewritten under the same name runs again."""
    h = hashlib.sha256()
    for it in items:
        h.update(json.dumps(it, sort_keys=True, default=str).encode() + b"\n")
    return h.hexdigest()


def _same_prompts(cfg: DictConfig, stored: dict, where: Path) -> bool:
    want = stored.get("prompts_sha256")
    if want is None:  # a run of an older specpipe: its config is all there is to compare
        return True
    w = cfg.workload
    if w.prompts_file == "-":
        print(f"resume: {where}: its prompts came from standard input, which cannot be compared with the earlier "
              f"run's, so the job runs again", file=sys.stderr)
        return False
    from specpipe.workload import load_prompts

    try:
        items = load_prompts(w.prompts_file, w.prompt_set, w.num_prompts)
    except Exception:  # the run itself reports what is wrong with the file
        return False
    if prompts_digest(items) != want:
        print(f"resume: {where}: the prompts differ from the earlier run's (workload.prompts_file changed since), "
              f"so the job runs again", file=sys.stderr)
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
        print(f"resume: {path.parent} failed last time (error.json), so the job runs again", file=sys.stderr)
        return None
    stored, why = read_json_object(path)
    if stored is not None:
        why = metrics_problem(stored)
    if why is not None:
        print(f"resume: {path.parent}: {why}, so the job runs again", file=sys.stderr)
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
        from specpipe.resume import model_files_digest

        if model_files_digest(folders) != digest:  # weights retrained or replaced under the same path
            print(f"resume: {path.parent}: the model files in {', '.join(folders)} changed since the job finished, "
                  f"so the job runs again", file=sys.stderr)
            return None
    return stored


def _write_json(path: Path, obj: dict) -> None:
    """Write path through a temporary file renamed into place, so it is never seen half written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def write_error(out_dir: str, error: str, **details: Any) -> None:
    """Record why a sweep job failed, so `python -m specpipe.report` can show it as a row.

    error.json holds {"error": error, "crash": false} for a config error; `write_crash` adds the
    exception's type, message and traceback, with "crash": true. The job's command-line overrides go in as
    "overrides" (a list, as Hydra's overrides.yaml holds them), so that the report can name the job's point
    even when hydra.output_subdir=null saved no overrides.yaml."""
    _write_json(Path(out_dir) / "error.json", {"error": error, "crash": False, **details})


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


RUN_OUTPUTS = ("metrics.json", "metrics.json.tmp", "completions.jsonl", "completions.jsonl.tmp", PARTIAL, META,
               "error.json")
# an earlier run's results (the partial file: an interrupted run's finished requests): set aside as NAME.prev
KEPT_OUTPUTS = ("metrics.json", "completions.jsonl", PARTIAL, META)


def clear_outputs(out_dir: str) -> None:
    """Clear what an earlier run left in a job's folder before the job runs there again (a re-sweep into the same
    hydra.sweep.dir, or a resumed job that was not finished): an interrupted, killed or failed job must not be
    left beside an older run's metrics.json, which the report and resume would take for this job's. The earlier
    results are renamed to metrics.json.prev / completions.jsonl.prev / completions.partial.jsonl.prev, never
    deleted: an older NAME.prev moves on to the first free NAME.prev.2, NAME.prev.3, ... (two interrupted runs in a
    row lost the first one's finished requests when the second's replaced its .prev)."""
    for name in RUN_OUTPUTS:
        path = Path(out_dir) / name
        try:
            if path.is_dir() or not path.exists():  # (a folder of that name was never ours)
                continue
            if name in KEPT_OUTPUTS:
                prev = path.with_name(name + ".prev")
                if prev.exists():
                    n = 2
                    while prev.with_name(f"{prev.name}.{n}").exists():
                        n += 1
                    os.replace(prev, prev.with_name(f"{prev.name}.{n}"))
                os.replace(path, prev)
            else:
                path.unlink()
        except OSError:  # a read-only leftover: the run's own write then fails and says so
            pass


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
        print(f"specpipe: job {config.hydra.job.num} {message}. This is not a configuration error; {where}. "
              "The sweep goes on with the next job.", file=sys.stderr)
        job_return.return_value = failed_objective(config.hydra)
        job_return.status = JobStatus.COMPLETED

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from specpipe.report import failure_summary

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
            print(text, file=sys.stderr)
            sys.exit(1)
