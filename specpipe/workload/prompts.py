"""Prompts: a built-in set or a JSON-lines file: per line a "prompt" string, "prompt_ids", or chat "messages"."""
from __future__ import annotations

import json
import sys
from functools import lru_cache
from pathlib import Path
from typing import Optional

from specpipe.workload.chat_template import CHAT_FIELDS, check_chat_options, check_messages
from specpipe.workload.constraints import FIELDS as CONSTRAINT_FIELDS, constraint_fields
from specpipe.workload.lines import prompt_lines
from specpipe.workload.prompt_values import nesting_problem
from specpipe.config.stop_strings import check_stop
from specpipe.errors import InputError
from specpipe.config.schema import (PROMPT_SET_NAMES, GREEDY_TEMPERATURE, SAMPLING_RULES, is_int, is_number,
                                    sampling_problem)

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "prompts"
HELDOUT = ASSETS / "heldout.jsonl"  # code contexts from stdlib files the shipped pair never trained on
# (written by scripts/make_heldout_prompts.py)
# built-in sets of chats ({"messages": [...]} lines, hand-written for this project): rendered with the model's chat
# template, so they need a model that has one (the shipped byte-level pair has none: each request then fails, naming
# the set, the message saying the folder has no chat template)
CHAT_SETS = {"chat": ASSETS / "chat.jsonl", "code": ASSETS / "code.jsonl"}
PROMPT_SETS = {  # name -> its plain prompts ([] for the sets stored as files above)
    "heldout": [],
    "chat": [],
    "code": [],
    "code_prefixes": [
        "def fibonacci(n):\n    ",
        "import os\nimport sys\n\n\ndef main():\n",
        "class Stack:\n    def __init__(self):\n        ",
        "    def __repr__(self):\n        return ",
        "# Copyright (C) 2001 Python Software Foundation\n",
        "def read_config(path):\n    \"\"\"Read a configuration file and return a dict.\"\"\"\n    ",
        "        if not isinstance(key, str):\n            raise TypeError(",
        "for i in range(len(items)):\n    ",
        "try:\n    import threading\nexcept ImportError:\n    ",
        "    @property\n    def name(self):\n        ",
        "def _check_arg(value, name):\n    if value is None:\n        ",
        "class Error(Exception):\n    \"\"\"Base class for exceptions in this module.\"\"\"\n",
    ],
}
assert tuple(PROMPT_SETS) == PROMPT_SET_NAMES  # config names them without importing this module


def load_prompts(prompts_file: Optional[str], prompt_set: str, num_prompts: Optional[int]) -> list[dict]:
    """Returns [{"prompt": str} | {"messages": [...], ...} | {"error": str}] in input order; a bad line becomes a
    per-request error."""
    if prompts_file is None and prompt_set == "heldout":
        items = [{"prompt": json.loads(line)["prompt"]}
                 for line in HELDOUT.read_text(encoding="utf-8").splitlines() if line]
    elif prompts_file is None and prompt_set in CHAT_SETS:
        items = chat_set(prompt_set)
    elif prompts_file is None:
        items = [{"prompt": p} for p in PROMPT_SETS[prompt_set]]
    else:
        items = read_prompts_file(prompts_file, limit=num_prompts)
    return items[:num_prompts] if num_prompts is not None else items


def chat_set(name: str) -> list[dict]:
    """A built-in chat set's items, parsed as a prompts file's lines are; each is named "workload.prompt_set=NAME,
    prompt N" in errors (a model without a chat template fails every one of them so)."""
    lines = [line for line in CHAT_SETS[name].read_text(encoding="utf-8").splitlines() if line]
    return [parse_prompt_line(json.loads(line), f"workload.prompt_set={name}, prompt {n}")
            for n, line in enumerate(lines, 1)]


# fields other engines take per request that would silently do nothing here: refused unless they hold their
# neutral value (OpenAI batch files often carry "presence_penalty": 0 or "n": 1, replayed vLLM requests
# "ignore_eos": false); other fields (e.g. "id") pass
UNSUPPORTED_FIELDS = {  # field -> (its neutral values, or a test of the prompt's object; what to do instead)
    "presence_penalty": ((0, 0.0, None), "use \"repetition_penalty\" (HF's rule) instead"),
    "frequency_penalty": ((0, 0.0, None), "use \"repetition_penalty\" (HF's rule) instead"),
    "logit_bias": (({}, None), "logit biases are not applied"),
    "typical_p": ((1, 1.0, None), "typical sampling is not applied (\"min_p\" and \"top_p\" are)"),
    "n": ((1, None), "one completion per line: repeat the line with different \"seed\" values"),
    "best_of": ((1, None), "one completion per line: repeat the line with different \"seed\" values"),
    "min_tokens": ((0, None), "EOS is never suppressed; workload.ignore_eos=true runs every request to its limit"),
    "top_logprobs": ((0, None), "only the sampled token's log-probability is recorded (workload.logprobs=true)"),
    "logprobs": ((False, None), "log-probabilities are recorded for the whole run: workload.logprobs=true (the API: "
                                "generate(logprobs=True))"),
    "stop_sequences": (([], None), 'use "stop" (a string or a list of strings)'),
    "max_length": ((None,), 'use "max_new_tokens" (HF\'s max_length counts the prompt too)'),
    "n_predict": ((None,), 'use "max_new_tokens"'),
    "num_predict": ((None,), 'use "max_new_tokens"'),
    "max_new_length": ((None,), 'use "max_new_tokens"'),
    # without its own temperature, the run's decides (make_requests checks it); a temperature that is not a
    # number is that field's error
    "do_sample": (lambda d: d["do_sample"] is None or (isinstance(d["do_sample"], bool) and (
        not is_number(d.get("temperature")) or d["do_sample"] == (d["temperature"] >= GREEDY_TEMPERATURE))),
                  'use "temperature" (0 is greedy); do_sample is accepted only where it agrees with the temperature'),
    "ignore_eos": ((False, None), "it is run-wide here: workload.ignore_eos=true"),
    "add_generation_prompt": ((True, None), "the chat template always gets add_generation_prompt=true"),
    "continue_final_message": ((False, None), "the chat template always gets add_generation_prompt=true"),
    # vLLM's constraint fields: ours are OpenAI's "response_format", and "regex" / "grammar" (docs/structured.md)
    "guided_json": ((None,), 'use "response_format": {"type": "json_schema", "json_schema": {"schema": ...}}'),
    "guided_regex": ((None,), 'use "regex"'),
    "guided_grammar": ((None,), 'use "grammar" (a Lark grammar)'),
    "guided_choice": ((None,), 'use "regex" with the choices joined by "|"'),
}


# fields the run sets for all its requests: a prompt's own `true` does what it asks where the run's is on too, so
# only make_requests (which knows the run's settings) can tell whether it would be ignored
RUN_WIDE_FIELDS = ("logprobs", "ignore_eos")


def unsupported_field(obj: dict, deferred=()) -> Optional[str]:
    """Why a field of a prompt's object would silently do nothing here (it holds a non-neutral value), or None.
    `deferred`: fields make_requests checks against the run's settings instead."""
    for k, (neutral, instead) in UNSUPPORTED_FIELDS.items():
        if k not in obj or k in deferred:
            continue
        ok = neutral(obj) if callable(neutral) else any(type(obj[k]) is type(v) and obj[k] == v for v in neutral)
        if not ok:
            return f'field "{k}"={show(obj[k])} is not supported per prompt and would be ignored; {instead}'
    return None


LIMIT_FIELDS = ("max_new_tokens", "max_tokens", "max_completion_tokens")  # ours, OpenAI's older and newer names
SPECULATION_FIELDS = ("speculate", "max_spec_tokens")  # this request's own speculation limits
KNOWN_FIELDS = ("prompt", "prompt_ids", "messages", "seed", *LIMIT_FIELDS, "stop", "stop_token_ids",
                *SPECULATION_FIELDS, *CONSTRAINT_FIELDS, *SAMPLING_RULES, *CHAT_FIELDS, *UNSUPPORTED_FIELDS)


def _spelt(key: str) -> str:
    return key.lower().replace("-", "_").replace(" ", "_")


def respelt(key) -> Optional[str]:
    """The field of ours a key spells differently only in case, "-" or spaces ("Temperature", "top-p",
    "MAX_TOKENS"), or None: no dataset column is named so, so such a key is refused, never ignored. Fields we
    take from other engines only to refuse them are left out ("N" is a count column, not "n")."""
    if not isinstance(key, str) or key in KNOWN_FIELDS:
        return None
    spelt = _spelt(key)
    return spelt if spelt in KNOWN_FIELDS and spelt not in UNSUPPORTED_FIELDS else None


def near_miss(key, obj: dict) -> Optional[str]:
    """The field of ours a key of a prompt's object looks like a typo of ("max_new_token", "temprature"), or None.
    Only noted, never refused: datasets carry columns of their own ("prompt_idx", "n_tokens"), which a typo test
    cannot tell from typos, and a prompt must not fail for its metadata. Only fields that would act on this prompt
    are suggested (not another engine's, nor a chat's on a plain prompt)."""
    if not isinstance(key, str) or key in KNOWN_FIELDS or len(key) <= 4:
        return None
    return _near_miss(key, "messages" in obj)


@lru_cache(maxsize=4096)
def _near_miss(key: str, chat: bool) -> Optional[str]:
    """`near_miss` once per key: a file's lines repeat its dataset's columns, and difflib on every line of a
    million-line file cost most of its reading time."""
    import difflib

    spelt = _spelt(key)
    if spelt in ("stop_token_id", "stop_id", "stop_ids"):  # ("prompt_id" is a dataset's identifier column)
        return "stop_token_ids"
    if spelt.endswith(("id", "idx", "uid", "_n", "num", "number", "count")):  # an identifier or a count of one
        return None
    useful = [f for f in KNOWN_FIELDS if f not in UNSUPPORTED_FIELDS and (f not in CHAT_FIELDS or chat)]
    near = difflib.get_close_matches(spelt, useful, n=1, cutoff=0.85)
    return near[0] if near else None


def show(value) -> str:
    """A value for an error message: JSON where it is JSON, else its repr (numpy / torch values, sets), short."""
    try:
        return json.dumps(value)[:40]
    except (TypeError, ValueError):
        return repr(value)[:40]


def not_unicode(value, field: str = "") -> Optional[str]:
    """Where a JSON value holds a string that is not Unicode text (a lone UTF-16 surrogate, which JSON's
    "\\ud800" escape allows and no tokenizer can encode), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
            return None
        except UnicodeEncodeError as e:
            where = f'field "{field}"' if field else "the text"
            return (f"{where} holds a lone UTF-16 surrogate ({value[e.start]!r} at character {e.start}), which is "
                    f"not Unicode text; a character outside the BMP is written as a pair (\\ud83d\\ude00)")
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        key = f"{field}.{k}" if field and isinstance(k, str) else f"{field}[{k}]" if field else str(k)
        why = not_unicode(k, field) if isinstance(k, str) else None
        why = why or not_unicode(v, key)
        if why:
            return why
    return None


def parse_prompt_line(obj, where) -> dict:
    """See `_parse_prompt_line`; a request refused for another field keeps its prompt text in its completion."""
    why = nesting_problem(obj, where if isinstance(where, str) else f"line {where}")
    if why:  # a cycle (an API dict) or a nesting past the cap: no walk below would end, or end well
        return {"error": why, "prompt": ""}
    try:
        item = _parse_prompt_line(obj, where)
    except RecursionError:  # a value nested thousands deep (an API dict; a file's line fails in json.loads)
        n = where if isinstance(where, str) else f"line {where}"
        return {"error": f"{n}: nested too deeply to read", "prompt": ""}
    if "error" in item and isinstance(obj, dict) and isinstance(obj.get("prompt"), str) \
            and not_unicode(obj["prompt"]) is None:
        item["prompt"] = obj["prompt"]
    return item


def speculation_fields(d: dict, extra: dict) -> Optional[str]:
    """A prompt's "speculate" (false: it decodes plainly) and "max_spec_tokens" (draft tokens it verifies per
    step at most) into `extra`; why they are unusable."""
    if d.get("speculate") is not None:
        if not isinstance(d["speculate"], bool):
            return f'"speculate" must be true or false, got {show(d["speculate"])}'
        extra["speculate"] = d["speculate"]
    if d.get("max_spec_tokens") is not None:
        m = d["max_spec_tokens"]
        if not is_int(m) or m < 0:
            return f'"max_spec_tokens" must be an integer >= 0 (0: no drafts), got {show(m)}'
        extra["max_spec_tokens"] = int(m)
    return None


def _parse_prompt_line(obj, where) -> dict:
    """One request's item from a JSON value: "prompt", "prompt_ids" or "messages", plus optional "seed",
    "max_new_tokens" (or "max_tokens", "max_completion_tokens"), "stop", "temperature", "top_p", "top_k",
    "repetition_penalty", "min_p", "speculate", "max_spec_tokens", one of "response_format" / "regex" / "grammar"
    (`workload.constraints`); or its error.

    `where` names it in errors: a line number of a prompts file, or a string (the API's "prompt 3"); a good
    item keeps that name as "where", for the errors found once it is tokenized."""
    n = where if isinstance(where, str) else f"line {where}"
    deferred = [k for k in RUN_WIDE_FIELDS if obj.get(k) is True] if isinstance(obj, dict) else []
    why = unsupported_field(obj, deferred) if isinstance(obj, dict) else None
    if why:
        return {"error": f"{n}: {why}", "prompt": ""}
    if not isinstance(obj, dict):
        kind = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean"}.get(
            type(obj), "null" if obj is None else type(obj).__name__)
        return {"error": f'{n}: is {kind}; each prompt is a JSON object: {{"prompt": "..."}}, {{"prompt_ids": '
                         f'[...]}} or {{"messages": [...]}}', "prompt": ""}
    why = not_unicode(obj)
    if why:
        return {"error": f"{n}: {why}", "prompt": ""}
    # a null prompt or chat field is an absent one, as the other fields' null is: pandas and datasets exports write
    # null for the columns a row does not use ({"prompt": "x", "prompt_ids": null})
    obj = {k: v for k, v in obj.items() if v is not None or k not in ("prompt", "prompt_ids", "messages", *CHAT_FIELDS)}
    given = [k for k in ("prompt", "prompt_ids", "messages") if k in obj]
    if len(given) > 1:
        return {"error": f'{n}: has both {given[0]!r} and {given[1]!r}; give one of "prompt", "prompt_ids" and '
                         f'"messages"', "prompt": ""}
    extra = {}  # what the request takes besides its prompt
    if deferred:  # "logprobs": true / "ignore_eos": true: fine where the run records logprobs / ignores EOS too
        extra["run_wide"] = deferred
    respelt_key = next((k for k in obj if respelt(k)), None)
    if respelt_key is not None:
        return {"error": f'{n}: field "{respelt_key}" is not one specpipe reads, so it would be ignored; write it '
                         f'"{respelt(respelt_key)}"', "prompt": ""}
    if isinstance(obj.get("do_sample"), bool) and obj.get("temperature") is None:
        extra["do_sample"] = obj["do_sample"]  # the run's temperature decides whether it agrees (make_requests)
    typos = {k: like for k, like in ((k, near_miss(k, obj)) for k in obj) if like}
    if typos:  # noted for the run (`ignored_fields`), the prompt runs
        extra["ignored_fields"] = typos
    d = obj
    if d.get("seed") is not None:
        if not is_int(d["seed"]) or not 0 <= d["seed"] <= 2 ** 63 - 1:  # torch's generator seeds are 64-bit
            return {"error": f'{n}: "seed" must be an integer between 0 and 2**63-1, got {d["seed"]!r}',
                    "prompt": ""}
        extra["seed"] = int(d["seed"])
    own = {}  # this request's sampling, where it sets some (the run's sampling.* fills the rest)
    for key in SAMPLING_RULES:
        if d.get(key) is not None:
            why = sampling_problem(key, d[key])
            if why:
                return {"error": f'{n}: "{key}" {why}, got {d[key]!r}', "prompt": ""}
            own[key] = int(d[key]) if key == "top_k" else float(d[key])
    if own:
        extra["sampling"] = own
    for key in LIMIT_FIELDS:  # this request's own limit (<= the run's); OpenAI's names too (null: the run's)
        if d.get(key) is not None:
            m = d[key]
            if not is_int(m) or m < 1:
                return {"error": f'{n}: "{key}" must be an integer >= 1, got {m!r}', "prompt": ""}
            if extra.get("max_new_tokens", m) != m:
                given = [k for k in LIMIT_FIELDS if d.get(k) is not None]
                return {"error": f'{n}: "{given[0]}" and "{key}" disagree; give one', "prompt": ""}
            extra["max_new_tokens"] = int(m)
    why = speculation_fields(d, extra) or constraint_fields(d, extra)
    if why:
        return {"error": f"{n}: {why}", "prompt": ""}
    if d.get("stop_token_ids") is not None:  # vLLM's: ids that end the request as EOS does, besides the model's
        ids = d["stop_token_ids"]
        if not isinstance(ids, list) or not all(is_int(t) and t >= 0 for t in ids):
            return {"error": f'{n}: "stop_token_ids" must be a list of token ids (integers >= 0), got '
                             f'{show(ids)}', "prompt": ""}
        if ids:
            extra["stop_token_ids"] = [int(t) for t in ids]
    if d.get("stop") is not None:  # (null, as OpenAI clients send it: no stop strings of its own)
        why = check_stop(d["stop"])
        if why:
            return {"error": f"{n}: {why}", "prompt": ""}
        extra["stop"] = [d["stop"]] if isinstance(d["stop"], str) else list(d["stop"])
    if isinstance(obj, dict) and "prompt" not in obj:
        if "prompt_ids" in obj:
            ids = obj["prompt_ids"]
            if not isinstance(ids, list) or not all(map(is_int, ids)):
                return {"error": f'{n}: "prompt_ids" must be a list of integers', "prompt": ""}
            return {"prompt": "", "prompt_ids": [int(t) for t in ids], **extra, "where": n}
        if "messages" in obj:
            why = check_messages(obj["messages"]) or check_chat_options(obj)
            if why:
                return {"error": f"{n}: {why}", "prompt": ""}
            chat = {k: obj[k] for k in CHAT_FIELDS if obj.get(k) is not None}
            return {"prompt": "", "messages": obj["messages"], **({"chat": chat} if chat else {}), **extra, "where": n}
    stray = [k for k in CHAT_FIELDS if k in obj]
    if stray:
        return {"error": f'{n}: "{stray[0]}" goes with "messages" (a chat), not with a plain prompt', "prompt": ""}
    if not isinstance(obj, dict) or "prompt" not in obj:
        import difflib

        like = next((f'; did you mean "{m[0]}" for "{k}"?' for k in obj if isinstance(k, str) for m in
                     [difflib.get_close_matches(_spelt(k), ["prompt", "prompt_ids", "messages"], n=1, cutoff=0.75)]
                     if m), "")
        return {"error": f'{n}: missing the "prompt" field (or "prompt_ids", or "messages"){like}', "prompt": ""}
    if not isinstance(obj["prompt"], str):
        return {"error": f'{n}: "prompt" must be a string', "prompt": ""}
    return {"prompt": obj["prompt"], **extra, "where": n}


def is_json_array(raw: bytes) -> bool:
    """Whether the whole file is one JSON array (of prompts written as a .json file, not JSON lines)."""
    if not raw.lstrip().startswith(b"["):
        return False
    try:
        return isinstance(json.loads(raw), list)
    except (ValueError, RecursionError):
        return False


BOM = b"\xef\xbb\xbf"  # a UTF-8 byte-order mark (Windows editors save one; `cat` joins files that have one)
NOT_JSON_PROBE = 1000  # non-blank lines that are all no JSON object: the file is refused without reading on
ARRAY_CHECK_BYTES = 64 * 2 ** 20  # a file that starts with "[" is read up to this far to tell a JSON array


def wrong_encoding(path: str, first_line: bytes) -> None:
    encoded = {b"\x1f\x8b": "gzip-compressed (give it as a pipe: workload.prompts_file=<(zcat FILE))",
               b"\xff\xfe": "UTF-16 text (PowerShell's default; save it as UTF-8)",
               b"\xfe\xff": "UTF-16 text (save it as UTF-8)"}.get(first_line.removeprefix(BOM)[:2])
    if encoded:
        raise InputError(f"workload.prompts_file={path!r} is {encoded}; specpipe reads UTF-8 JSON lines, one "
                         f'{{"prompt": "..."}} object per line')


def line_item(line: bytes, n: int) -> tuple[dict, bool]:
    """One line's item, and whether the line is no JSON object (a prompts file of only such lines is refused)."""
    try:
        obj = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError:
        return {"error": f"line {n}: not valid UTF-8", "prompt": ""}, True
    except json.JSONDecodeError as e:  # its msg alone lost the place ("Invalid control character at")
        place = f"column {e.colno}" if e.lineno == 1 else f"character {e.pos + 1}"
        return {"error": f"line {n}: not valid JSON ({e.msg.removesuffix(' at')} at {place})", "prompt": ""}, True
    except ValueError:  # an integer of more than sys.get_int_max_str_digits() digits (4300): Python refuses it
        return {"error": f"line {n}: not valid JSON here (it holds a number of more than "
                         f"{sys.get_int_max_str_digits()} digits)", "prompt": ""}, True
    except RecursionError:
        return {"error": f"line {n}: JSON nested too deeply to read", "prompt": ""}, True
    return parse_prompt_line(obj, n), not isinstance(obj, dict)  # a number, a string, an array: no prompt either


def read_prompts_file(path: str, limit: Optional[int] = None) -> list[dict]:
    """`path` "-" reads standard input (`... | python -m specpipe workload.prompts_file=-`). `limit`: the lines
    after that many prompts are not read (workload.num_prompts=5 of a million-line file). Lines are streamed
    (`workload.lines`), none longer than MAX_LINE_BYTES."""
    items, not_json = [], 0
    first = None  # the first non-blank line
    array: Optional[list[bytes]] = None  # a file that starts with "[": its lines, to tell whether it is one array
    array_bytes = 0
    for n, line in enumerate(prompt_lines(path), 1):
        if n == 1:
            wrong_encoding(path, line)
        if array is not None and n > 1:
            array.append(line)
            array_bytes += len(line)
            if array_bytes > ARRAY_CHECK_BYTES:  # (rarely more than a line: JSON lines never start so)
                array = None
        if array is None and (limit is not None and len(items) >= limit and not_json < len(items)
                              or not_json == len(items) >= NOT_JSON_PROBE):  # (all bad so far: the file is read on
            break                                                              # to tell its format, up to the probe)
        line = line.removeprefix(BOM)
        if not line.strip():
            continue
        if first is None:
            first = line
            array, array_bytes = ([line], len(line)) if line.lstrip().startswith(b"[") else (None, 0)
        item, bad = line_item(line, n)
        items.append(item)
        not_json += bad
    if not items:
        if path == "-":
            raise InputError("workload.prompts_file='-': standard input held no prompts; pipe a JSON-lines file "
                             'with one {"prompt": "..."} object per line into it')
        raise InputError(f"workload.prompts_file={path!r} holds no prompts (only blank lines); give one "
                         f'{{"prompt": "..."}} object per line')
    if first.strip() == b"[" or (array is not None and is_json_array(b"\n".join(array))):
        raise InputError(f"workload.prompts_file={path!r} holds a JSON array, not JSON lines (one object per line, no "
                         f"brackets or commas between them); convert it once: python -c 'import json,sys; "
                         f"[print(json.dumps(x)) for x in json.load(sys.stdin)]' < {Path(path).name} > prompts.jsonl")
    if not_json == len(items):  # plain text, CSV, ...: not one request's typo but the wrong format
        some = f"first {len(items)}" if len(items) >= NOT_JSON_PROBE else f"{len(items)}"
        raise InputError(f"workload.prompts_file={path!r} is not a JSON-lines file: none of its {some} "
                         f"non-blank lines is a UTF-8 JSON object (the first reads "
                         f"{first[:60].decode('utf-8', 'replace')!r}). Give one JSON object per line, "
                         f'e.g. {{"prompt": "def fib(n):"}} or {{"prompt_ids": [1, 2, 3]}}; to convert a '
                         f"one-prompt-per-line text file: python -c 'import json,sys; [print(json.dumps("
                         f'{{"prompt": l.rstrip(chr(10))}})) for l in sys.stdin]\' < prompts.txt > prompts.jsonl')
    return items
