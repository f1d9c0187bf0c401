"""resume=true for a run that was stopped part way: the requests its completions.partial.jsonl holds count as
finished and only the rest decode, so Ctrl-C at request 900 of 1000 costs 100 requests, not 1000.

The partial file's sidecar (completions.partial.meta.json, written when decoding starts) records the config, the
prompts and the model files the records came from: records of another run (a changed setting, a rewritten prompts
file, retrained weights under the same path, a folder reused by hand) never pass for this one's. Partial files an
earlier attempt set aside (`*.prev`, `*.prev.N`: a resumed run stopped again before it decoded anything, a resume
refused over a setting since put back) are read too, so no finished request is lost to a second stop. Each
request decodes from its own seed, so the requests that decode now come out as they would have in the run that
was stopped."""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig

from specpipe.config.schema import is_number
from specpipe.config.validate import to_container
from specpipe.notes import logger
from specpipe.outputs.run_files import META, PARTIAL, read_json_object
from specpipe.outputs.run_identity import config_differences, prompts_digest

log = logger(__name__)

FINISH_REASONS = ("stop", "length")  # a record that ended so is finished; "error" runs again
MAX_SET_ASIDE = 8  # the newest set-aside partial files read besides the current one


@dataclass
class EarlierRun:
    """One partial file a stopped run left in its folder, with its sidecar."""
    path: Path
    meta: Optional[dict]
    records: list = field(default_factory=list)
    problem: Optional[str] = None  # why its records cannot be used ("... is missing")


def model_files_digest(folders) -> str:
    """sha256 over the name, size and modification time of every file in the model folders
    (`models.cache.folder_state`, which the in-process weight cache keys on too): weights retrained or replaced
    under the same path change it (reading the weights themselves would cost seconds per GB)."""
    from specpipe.models.cache import folder_state  # (imports torch: only a run that has models asks)

    h = hashlib.sha256()
    for folder in sorted({str(f) for f in folders}):
        h.update(json.dumps([folder, folder_state(folder)]).encode() + b"\n")
    return h.hexdigest()


def model_folders(models) -> list:
    """The folders the loaded models came from, sorted (none for random models, which their config describes)."""
    return sorted({str(src) for m in models
                   if m is not None and isinstance(extra := getattr(getattr(m, "config", None), "extra", None), dict)
                   and (src := extra.get("source"))})


def partial_meta(job_cfg: DictConfig, items: list, models_digest: str) -> dict:
    """The sidecar's contents: what `carry_finished` compares before it takes a record."""
    return {"config": to_container(job_cfg), "prompts_sha256": prompts_digest(items), "num_requests": len(items),
            "model_files_sha256": models_digest}


def _set_aside(folder: Path) -> list:
    """(partial, sidecar) pairs of the folder, newest first: the current ones, *.prev, then *.prev.N from the
    highest N down (clear_outputs moves an older *.prev on to the first free *.prev.N)."""
    pairs = [(folder / PARTIAL, folder / META), (folder / f"{PARTIAL}.prev", folder / f"{META}.prev")]
    try:
        numbered = sorted((int(m.group(1)) for p in folder.iterdir()
                           if (m := re.fullmatch(re.escape(PARTIAL) + r"\.prev\.(\d+)", p.name))), reverse=True)
    except OSError:
        numbered = []
    pairs += [(folder / f"{PARTIAL}.prev.{n}", folder / f"{META}.prev.{n}") for n in numbered]
    return [(p, m) for p, m in pairs if p.is_file()][:1 + MAX_SET_ASIDE]


def read_partial(out_dir) -> list:
    """The partial files stopped runs left in out_dir, newest first (empty: none). A line that is not a JSON
    object (the one being written when the run was killed) is left out: its request decodes again."""
    found = []
    for path, meta_path in _set_aside(Path(out_dir)):
        meta, why = read_json_object(meta_path)
        if meta is None:
            found.append(EarlierRun(path, None, problem=why or f"{meta_path.name} is missing"))
            continue
        try:
            text = path.read_bytes().decode("utf-8", errors="replace")
        except OSError as e:
            found.append(EarlierRun(path, meta, problem=f"{path.name} cannot be read ({e.strerror or e})"))
            continue
        records = []
        for line in text.splitlines():
            try:
                rec = json.loads(line)
            except (ValueError, RecursionError):
                continue
            if isinstance(rec, dict):
                records.append(rec)
        found.append(EarlierRun(path, meta, records))
    return found


def _usable(rec: dict, r, vocab_size: int) -> bool:
    """Whether a record is a finished output of request r: its prompt, a finish that is not an error, token ids
    the model has, no more of them than the request may make, a log-probability per token if any."""
    ids, lps = rec.get("output_ids"), rec.get("logprobs")
    return (rec.get("prompt") == r.prompt and rec.get("finish_reason") in FINISH_REASONS
            and isinstance(ids, list) and len(ids) <= r.max_new_tokens
            and all(type(t) is int and 0 <= t < vocab_size for t in ids)
            and (lps is None or (isinstance(lps, list) and len(lps) == len(ids) and all(map(is_number, lps)))))


def _mismatch(run: EarlierRun, job_cfg: DictConfig, items: list, models_digest: str) -> Optional[str]:
    """Why run's records are not this run's (None when they are)."""
    if run.problem is not None:
        return run.problem
    stored = run.meta.get("config")
    if not isinstance(stored, dict):
        return f"{run.path.name}'s sidecar holds no config"
    diff = config_differences(stored, to_container(job_cfg), job_cfg)
    if diff:
        shown = ", ".join(f"{k}: {json.dumps(a)[:40]} there, {json.dumps(b)[:40]} now" for k, a, b in diff[:3])
        more = f" and {len(diff) - 3} more" if len(diff) > 3 else ""
        return f"{run.path.name} came from a run with other settings ({shown}{more})"
    if run.meta.get("prompts_sha256") != prompts_digest(items):
        return f"{run.path.name} came from a run of other prompts"
    if run.meta.get("model_files_sha256") != models_digest:
        return f"{run.path.name} came from other model files (changed since, under the same path)"
    return None


def carry_finished(earlier: list, job_cfg: DictConfig, items: list, reqs: list, vocab_size: int,
                   models_digest: str) -> list:
    """Mark the requests the stopped run finished as finished, with its outputs; those requests, in the order
    they finished (a cross-request draft cache takes them in that order). Records are taken from every partial
    file of this same config, prompts and model files (newest first for a request found twice); when none is,
    nothing is taken and stderr says why. A request that failed (finish_reason "error") runs again."""
    if not earlier:
        return []
    where = earlier[0].path.parent
    same = [run for run in earlier if _mismatch(run, job_cfg, items, models_digest) is None]
    if not same:
        why = _mismatch(earlier[0], job_cfg, items, models_digest)
        log.info(f"resume: {where}: {why}, so every request runs again")
        return []
    carried, before = [], sum(r.finished for r in reqs)  # (bad prompts fail before the run)
    for run in same:
        for rec in run.records:
            i = rec.get("index")
            if type(i) is not int or not 0 <= i < len(reqs) or reqs[i].finished or \
                    not _usable(rec, reqs[i], vocab_size):
                continue
            r = reqs[i]
            r.output_ids, r.finish_reason = list(rec["output_ids"]), rec["finish_reason"]
            r.logprobs = rec.get("logprobs")
            r.num_draft_tokens, r.num_accepted_tokens, r.accept_histogram = carried_telemetry(rec)
            carried.append(r)
    left = sum(not r.finished for r in reqs)
    failed = f", {before} failed before decoding" if before else ""
    log.info(f"resume: {where}: {len(carried)} of {len(reqs)} requests had finished "
             f"({', '.join(run.path.name for run in same)}){failed}; "
             f"{'decoding the other ' + str(left) if left else 'nothing is left to decode'}")
    return carried


def carried_telemetry(rec: dict) -> tuple[int, int, list]:
    """A finished record's speculation counts (0 and [] where absent or not counts: a hand-edited file)."""
    def count(v):
        return v if type(v) is int and v >= 0 else 0
    hist = rec.get("acceptance_histogram")
    hist = [count(v) for v in hist] if isinstance(hist, list) else []
    return count(rec.get("num_draft_tokens")), count(rec.get("num_accepted_tokens")), hist
