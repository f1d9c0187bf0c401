"""Override strings as users type them: home folders in values, the value a key was given, a sweep's points.

Shared by the command line and SpecPipe(...), which take the same `key=value` overrides.
"""
from __future__ import annotations

import itertools
import os
import re
from typing import Optional

from specpipe.config.compose import group_options


def override_key(override: str) -> str:
    """The key an override sets, without its +/~ prefixes (`+draft.topk=2` -> `draft.topk`)."""
    return override.split("=", 1)[0].lstrip("+~")


def last_value(overrides: list[str], key: str) -> Optional[str]:
    """The value `key` was given last in `overrides` (Hydra's: a key given twice takes the last), or None."""
    return next((o.split("=", 1)[1] for o in reversed(overrides) if o.split("=", 1)[0].lstrip("+") == key), None)


def parsed_value(override: str):
    """An override's value as Hydra parses it (3 is an int, null None); the text when it does not parse."""
    try:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        return OverridesParser.create().parse_override(override).value()
    except Exception:
        return override.split("=", 1)[-1]


def expand_home(overrides: list[str]) -> list[str]:
    """`key=~/dir` -> `key=/home/me/dir`: the shell leaves a "~" after "key=" alone, and the override grammar
    has no unquoted "~" in values (Hydra's own error is a lexer exception). A sweep's values are expanded one
    by one: `choice(~/a, ~/b)` (also sort/shuffle), and `key=~/a,~/b` when every item is a path (starts with
    ~ or /, no "=") and the whole value is not an existing one; anything else is one path, commas included.
    An existing path with characters the grammar reads otherwise is quoted."""
    out = []
    for i, o in enumerate(overrides):
        if i and overrides[i - 1] in ("-cd", "--config-dir", "-cp", "--config-path") and o.startswith("~"):
            out.append(os.path.expanduser(o))  # a quoted '~/myconf' reaches Hydra as it is, which does not expand it
            continue
        if o.startswith(("--config-dir=~", "--config-path=~")):
            flag, _, where = o.partition("=")
            out.append(f"{flag}={os.path.expanduser(where)}")
            continue
        key, eq, value = o.partition("=")
        if eq and not key.startswith("-"):
            o = f"{key}={home_value(value)}"
        out.append(o)
    return out


def home_value(value: str) -> str:
    """One override's value with its home folders expanded (see expand_home)."""
    if value[:1] not in ("'", '"') and not re.fullmatch(r"[\w/.+@%:~-]*", value, re.ASCII) \
            and os.path.exists(os.path.expanduser(value)) and not ("'" in value and '"' in value):
        # an existing file or folder whose name holds characters the override grammar reads otherwise (a
        # space, a letter outside ASCII, parentheses, a comma): it can only mean that path, so quote it
        quote = "'" if "'" not in value else '"'
        return f"{quote}{os.path.expanduser(value)}{quote}"
    if "~" not in value:
        return value
    fn = re.fullmatch(r"(choice|sort|shuffle)\((.*)\)", value, re.S)
    parts = _items(value)
    if fn and not re.search(r"[\[\]{}'\"]", fn.group(2)):
        return f"{fn.group(1)}({','.join(map(_home_path, _items(fn.group(2))))})"
    if len(parts) > 1 and all(re.match(r"\s*[~/]", p) and "=" not in p for p in parts) \
            and not os.path.exists(os.path.expanduser(value)):
        return ",".join(map(_home_path, parts))
    return _home_path(value)


def _items(text: str) -> list[str]:
    """`text` split at commas, not at escaped ones (\\,)."""
    return re.split(r"(?<!\\),", text)


def _home_path(value: str) -> str:
    """One path: `~/x` or `~user/x` expanded (and quoted when the result needs it); anything else as it is."""
    lead, value = value[:len(value) - len(value.lstrip())], value.strip()
    if not re.match(r"~[\w.-]*(/|$)", value) or value == "~":
        return lead + value
    plain = re.sub(r"\\([ ()\[\]{}:=,\\])", r"\1", value)  # Hydra's escapes: quoted, the path needs none
    path = os.path.expanduser(plain)
    if path == plain:  # ~nosuchuser: left for the check to name
        return lead + value
    if re.fullmatch(r"[\w/.+@%:-]+", path, re.ASCII):
        return lead + path
    return lead + (f"'{path}'" if "'" not in path else value)


def sweep_points(overrides: list[str], limit: int = 64, sampled: bool = False,
                 dirs: Optional[list] = None) -> list[list[str]]:
    """Override lists for the sweep's points (all of them when few, else each value once). `sampled`: a
    sweeper that samples (Optuna) runs interval() itself, so the check leaves that key at its default.
    Raises ValueError with the message for a sweep that cannot run."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    choices = []
    for o in OverridesParser.create().parse_overrides(overrides):
        vals = _point_values(o, sampled, dirs)
        if vals is not None:
            choices.append(vals)
    total = 1
    for c in choices:
        total *= len(c)
    if total <= limit:
        return [list(p) for p in itertools.product(*choices)]
    firsts = [c[0] for c in choices]
    return [firsts[:i] + [v] + firsts[i + 1:] for i, c in enumerate(choices) for v in c]


def _point_values(o, sampled: bool, dirs: Optional[list]) -> Optional[list[str]]:
    """`key=value` for each value of one parsed override (None: left to a sampling sweeper)."""
    from hydra.core.override_parser.types import Glob, IntervalSweep

    key = o.get_key_element()
    if isinstance(o.value(), Glob) and group_options(key.lstrip("+~"), dirs):  # expand_globs found no match
        raise ValueError(f"specpipe: invalid override {o.input_line}: it matches none of {key.lstrip('+~')}'s "
                         f"options ({', '.join(group_options(key.lstrip('+~'), dirs))}).")
    if isinstance(o.value(), Glob):  # what expand_globs left: not a config group
        raise ValueError(f"specpipe: invalid override {o.input_line}: glob() picks options of a config group "
                         f"(e.g. allocator=glob(t*)), and {key} is not one; list its values ({key}=1,2).")
    if isinstance(o.value(), IntervalSweep):
        if sampled:
            return None
        raise ValueError(f"specpipe: invalid override {o.input_line}: interval() asks a sweeper to sample "
                         f"values from a range, and the default sweeper only enumerates; list the values "
                         f"({key}=1,2,4), use range() or choice(), or a sampling sweeper (hydra/sweeper=optuna, "
                         f"as sweep=optuna_tree does).")
    try:
        vals = [f"{key}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override() else [o.input_line]
    except Exception as e:  # range(1,4,0) and the like: Python's words, with the override named
        raise ValueError(f"specpipe: invalid override {o.input_line}: {e}.") from None
    if not vals:
        raise ValueError(f"specpipe: invalid override {o.input_line}: it gives no values, so the sweep would "
                         f"run no job; e.g. range(1,4) gives 1, 2 and 3.")
    return vals
