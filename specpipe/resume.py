"""resume=true for a run that was stopped part way: the requests its completions.partial.jsonl holds count as
finished and only the rest decode, so Ctrl-C at request 900 of 1000 costs 100 requests, not 1000.

The partial file's sidecar (completions.partial.meta.json, written when decoding starts) records the config and
prompts the records came from: records of another run (a changed setting, a rewritten prompts file, a folder
reused by hand) never pass for this one's. Each request decodes from its own seed, so the requests that
decode now come out as they would have in the run that was stopped."""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig

PARTIAL = "completions.partial.jsonl"
META = "completions.partial.meta.json"


@dataclass
class EarlierRun:
    """What a stopped run left in its folder: read before the new run sets the folder's files aside."""
    folder: Path
    meta: Optional[dict]
    records: list = field(default_factory=list)
    problem: Optional[str] = None  # why its records cannot be used ("... is missing")


def partial_meta(job_cfg: DictConfig, items: list) -> dict:
    """The sidecar's contents: what `carry_finished` compares before it takes a record."""
    from specpipe.sweep import prompts_digest
    from specpipe.validate import to_container

    return {"config": to_container(job_cfg), "prompts_sha256": prompts_digest(items), "num_requests": len(items)}


def read_partial(out_dir) -> Optional[EarlierRun]:
    """The stopped run in out_dir (None when it left no partial file). A line that is not a JSON object (the one
    being written when the run was killed) is left out: its request decodes again."""
    from specpipe.sweep import read_json_object

    folder = Path(out_dir)
    path = folder / PARTIAL
    if not path.is_file():
        return None
    meta, why = read_json_object(folder / META)
    if meta is None:
        return EarlierRun(folder, None, problem=why or f"{META} is missing (the run that was stopped wrote none)")
    try:
        text = path.read_bytes().decode("utf-8", errors="replace")
    except OSError as e:
        return EarlierRun(folder, meta, problem=f"{PARTIAL} cannot be read ({e.strerror or e})")
    records = []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(rec, dict):
            records.append(rec)
    return EarlierRun(folder, meta, records)


def _usable(rec: dict, r, vocab_size: int) -> bool:
    """Whether a record is a finished output of request r: its prompt, a finish that is not an error, token ids
    the model has, no more of them than the request may make."""
    ids = rec.get("output_ids")
    return (rec.get("prompt") == r.prompt and isinstance(rec.get("finish_reason"), str)
            and rec["finish_reason"] != "error" and isinstance(ids, list) and len(ids) <= r.max_new_tokens
            and all(type(t) is int and 0 <= t < vocab_size for t in ids)
            and (rec.get("logprobs") is None or (isinstance(rec["logprobs"], list) and len(rec["logprobs"]) == len(ids))))


def carry_finished(earlier: Optional[EarlierRun], job_cfg: DictConfig, items: list, reqs: list,
                   vocab_size: int) -> list:
    """Mark the requests the stopped run finished as finished, with its outputs; those requests, in the order
    they finished (a cross-request draft cache takes them in that order). Nothing is taken (and stderr says why)
    when the records came from another config or other prompts. A request that failed (finish_reason "error")
    runs again."""
    if earlier is None:
        return []
    where = earlier.folder
    if earlier.problem is not None:
        print(f"resume: {where}: {earlier.problem}, so every request runs again", file=sys.stderr)
        return []
    from specpipe.sweep import _same_run, prompts_digest
    from specpipe.validate import to_container

    stored = earlier.meta.get("config")
    if not isinstance(stored, dict) or not _same_run(stored, to_container(job_cfg), job_cfg):
        print(f"resume: {where}: {PARTIAL} came from a run with other settings, so every request runs again",
              file=sys.stderr)
        return []
    if earlier.meta.get("prompts_sha256") != prompts_digest(items):
        print(f"resume: {where}: {PARTIAL} came from a run of other prompts, so every request runs again",
              file=sys.stderr)
        return []
    carried = []
    for rec in earlier.records:
        i = rec.get("index")
        if type(i) is not int or not 0 <= i < len(reqs) or reqs[i].finished or not _usable(rec, reqs[i], vocab_size):
            continue
        r = reqs[i]
        r.output_ids, r.finish_reason = list(rec["output_ids"]), rec["finish_reason"]
        r.logprobs = rec.get("logprobs")
        carried.append(r)
    left = sum(not r.finished for r in reqs)
    print(f"resume: {where}: {len(carried)} of {len(reqs)} requests had finished ({PARTIAL}); "
          f"{'decoding the other ' + str(left) if left else 'nothing is left to decode'}", file=sys.stderr)
    return carried
