"""What a run writes into its output folder: completions.jsonl and metrics.json at the end, each whole or not at
all, and completions.partial.jsonl as requests finish, so a stopped run loses no finished request (reading these
back and setting an earlier run's aside is `outputs.run_files`; taking a stopped run's records, `outputs.resume`)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from specpipe.decode.request import Request
from specpipe.errors import ConfigError
from specpipe.notes import logger
from specpipe.outputs.run_files import META, PARTIAL, write_json
from specpipe.workload.tokenizer import output_text

log = logger(__name__)


def completion_record(r: Request, tokenizer) -> dict:
    """A request's line in completions.jsonl (and the partial file): its prompt, output ids and text, why it ended."""
    rec = {"index": r.index, "prompt": r.prompt, "output_ids": r.output_ids,
           "text": output_text(tokenizer, r.prompt_ids, r.output_ids), "finish_reason": r.finish_reason}
    rec.update(request_stats(r))
    if r.logprobs is not None:
        rec["logprobs"] = r.logprobs
    if r.error:
        rec["error"] = r.error
    return rec


def request_stats(r: Request) -> dict:
    """A request's own telemetry (completions.jsonl, the API's Completion.stats): what drafting did for it."""
    rec: dict = {}
    if r.accept_histogram:  # it went through speculative rounds (vLLM's names; [i]: rounds that accepted i drafts)
        rec.update(num_draft_tokens=r.num_draft_tokens, num_accepted_tokens=r.num_accepted_tokens,
                   acceptance_histogram=r.accept_histogram)
    if r.constraint is not None:  # what its grammar did to drafting (docs/structured.md)
        rec["constraint"] = r.constraint.describe()
        rec.update(grammar_forced_tokens=r.grammar_forced_tokens, grammar_pruned_tokens=r.grammar_pruned_tokens)
        if r.accept_histogram:
            rec["unconstrained_accepted_tokens"] = r.unconstrained_accepted_tokens
    return rec


OUTPUT_FILES = ("completions.jsonl.tmp", "completions.jsonl", "metrics.json.tmp", "metrics.json")


def check_output_names(out: Path) -> None:
    """A folder where an output file goes fails before decoding: its write would fail only at the run's end.
    (Without its partial file a run goes on, and says so.)"""
    taken = [n for n in OUTPUT_FILES if (out / n).is_dir()]
    if taken:
        raise ConfigError(f"the output folder {out} holds a folder named {taken[0]}, where the run writes its file of "
                          f"that name; move that folder away, or give another output folder (hydra.run.dir, or "
                          f"out_dir in the Python API)")


class PartialCompletions:
    """completions.partial.jsonl: each request's record as soon as it finishes (finish order), flushed, so
    Ctrl-C, a crash or a kill loses no finished request. The ordered completions.jsonl replaces it at the end."""

    NAME = PARTIAL

    def __init__(self, out: Path, tokenizer, meta: Optional[dict] = None):
        self.path, self.tokenizer, self.f = out / self.NAME, tokenizer, None
        try:
            out.mkdir(parents=True, exist_ok=True)
            self.f = open(self.path, "w", encoding="utf-8")
        except OSError as e:  # as a failed write: the decoding goes on, the end says what could not be kept
            log.warning(f"specpipe: warning: cannot write {self.path} ({e.strerror or e}); decoding goes on without it")
            return
        if meta is not None:  # what resume=true checks before it takes these records (without it: none taken)
            try:
                write_json(out / META, meta)
            except OSError:
                pass

    def write(self, reqs: list[Request]) -> None:
        if self.f is None:
            return
        try:
            for r in reqs:
                self.f.write(json.dumps(completion_record(r, self.tokenizer)) + "\n")
            self.f.flush()
        except OSError as e:  # a full disk must not cost the decoding still going on: go on without the file
            log.warning(f"specpipe: warning: cannot write {self.path} ({e.strerror or e}); decoding goes on, and the "
                        f"outputs are written at the end if there is room then")
            self.close()

    def close(self) -> None:
        f, self.f = self.f, None
        try:
            if f is not None:
                f.close()
        except OSError:  # its buffered tail could not be written: the warning above said so
            pass


def write_outputs(out: Path, summary: dict, reqs: list[Request], tokenizer) -> None:
    """Each file whole or not at all (written aside, then renamed): a Ctrl-C or a full disk here leaves the partial
    file and no metrics.json, never a cut completions.jsonl. metrics.json comes last: it marks a finished job."""
    out.mkdir(parents=True, exist_ok=True)
    tmp, done = out / "metrics.json.tmp", out / "completions.jsonl.tmp"
    try:
        tmp.write_text(json.dumps(summary, indent=2))
        with open(done, "w", encoding="utf-8") as f:
            for r in reqs:
                f.write(json.dumps(completion_record(r, tokenizer)) + "\n")
    except BaseException:
        for t in (tmp, done):
            try:
                t.unlink(missing_ok=True)
            except OSError:
                pass
        raise
    os.replace(done, out / "completions.jsonl")
    os.replace(tmp, out / "metrics.json")
    for name in (PartialCompletions.NAME, META):
        partial = out / name
        if not partial.is_dir():  # (a folder of that name was never ours: the run went on without the file)
            partial.unlink(missing_ok=True)  # completions.jsonl holds all of it, in order
