"""A run folder's files: JSON objects read back with a reason when they cannot be used, JSON written so it is
never seen half written, and an earlier run's outputs set aside before a job runs in the folder again.

A job's output dir is finished when it holds a readable metrics.json (the run renames it into place last), so an
interrupted or crashed job never looks finished; neither does one whose metrics.json is damaged (truncated,
empty, not a JSON object).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

PARTIAL = "completions.partial.jsonl"
META = "completions.partial.meta.json"
RUN_OUTPUTS = ("metrics.json", "metrics.json.tmp", "completions.jsonl", "completions.jsonl.tmp", PARTIAL, META,
               "error.json")
# an earlier run's results (the partial file: an interrupted run's finished requests): set aside as NAME.prev
KEPT_OUTPUTS = ("metrics.json", "completions.jsonl", PARTIAL, META)


def json_kind(value) -> str:
    """What a JSON value that is not an object is, in words ("a JSON array", "null")."""
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
        return None, f"{path.name} is not a JSON object (it holds {json_kind(value)})"
    return value, None


def write_json(path: Path, obj: dict) -> None:
    """Write path through a temporary file renamed into place, so it is never seen half written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


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
