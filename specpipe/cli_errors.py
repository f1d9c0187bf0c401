"""Check command-line overrides before Hydra starts, and reword its errors as one paragraph.

Hydra's own errors print with exit code 1; specpipe promises exit code 2 and a message that
names the bad value and what would be valid. Composing each override combination up front
(cheap: no torch work) also means a multirun with one bad point fails before any job runs.
"""
from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Optional

CONF_DIR = Path(__file__).resolve().parent / "conf"  # in the package, so an installed wheel has it (conf/ links here)
FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p", "--config-name", "-cn", "--config-path", "-cp",
                    "--config-dir", "-cd", "--experimental-rerun"}
SKIP_FLAGS = {"--cfg", "-c", "--info", "-i", "--help", "-h", "--hydra-help", "--config-name", "-cn",
              "--config-path", "-cp", "--config-dir", "-cd", "--shell-completion", "-sc", "--version"}


def group_options(group: str) -> list[str]:
    d = CONF_DIR / group
    return sorted(p.stem for p in d.glob("*.yaml")) if d.is_dir() else []


def split_args(argv: list[str]) -> tuple[list[str], bool, bool]:
    """(overrides, multirun, skip): skip when Hydra is asked for help/info or a different config."""
    overrides, multirun, skip, i = [], False, False, 0
    while i < len(argv):
        a = argv[i]
        if a in ("-m", "--multirun"):
            multirun = True
        elif a.split("=")[0] in SKIP_FLAGS:
            skip = True
            if a in FLAGS_WITH_VALUE:
                i += 1
        elif a in FLAGS_WITH_VALUE:
            i += 1
        elif not a.startswith("-"):
            overrides.append(a)
        i += 1
    return overrides, multirun, skip


def reword(exc: Exception, overrides: list[str]) -> str:
    """One paragraph naming the bad key/value and what would be valid."""
    msg = str(exc)
    cause = exc.__cause__
    if "Error merging override" in msg and cause is not None and "full_key" in str(cause):
        msg = str(cause)  # the validation error behind it names the key and the expected type
        m = re.search(r"Value '(.*)' of type '\w+' could not be converted to (\w+)\s+full_key: ([\w.]+)", msg, re.S)
        if m:
            val, typ, key = m.groups()
            kind = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false"}.get(typ, typ)
            return f"specpipe: invalid value for {key}: {val!r} is not {kind}; give {key}=<{kind}>."
    no_eq = next((o for o in overrides if "=" not in o and not o.startswith("~")), None)
    if "missing EQUAL" in msg and no_eq is not None:
        return (f"specpipe: invalid override {no_eq!r}: overrides are key=value (e.g. draft.topk=4) or "
                f"group=option (e.g. allocator=paged); `python -m specpipe --help` lists the groups.")
    m = re.search(r"Config group override must be a string or a list", msg)
    null = next((o for o in overrides if o.split("=", 1)[-1] in ("null", "None", "~")), None)
    if m and null is not None:
        group = null.split("=", 1)[0].lstrip("+")
        return (f"specpipe: invalid override {null}: config group '{group}' needs one of its options "
                f"(valid: {', '.join(group_options(group))}).")
    deleted = next((o for o in overrides if o.startswith("~")), None)
    if "does not support deletion" in msg and deleted is not None:
        return (f"specpipe: invalid override {deleted}: a setting cannot be removed (the schema needs every key); "
                f"set a value instead, {deleted[1:].split('=')[0]}=VALUE.")
    bad = next((o for o in overrides if "(" in o and "=" in o), None)
    if ("Error parsing override" in msg or "no viable alternative" in msg) and bad is not None:
        key, val = bad.split("=", 1)
        return (f"specpipe: invalid override {bad}: the command line treats parentheses and commas specially, "
                f"so quote a policy expression with options, e.g. '{key}=\"{val}\"' (valid policies: eager, "
                f"compile, compile(dynamic=false, fullgraph=true, mode=...), graph, auto).")
    msg = re.sub(r"\s*Set the environment variable HYDRA_FULL_ERROR=1.*", "", msg, flags=re.S).strip()
    m = re.search(r"Could not (?:find|load) '([\w/]+)/([^']+)'", msg)
    if m:
        group, opt = m.group(1), m.group(2)
        if group.startswith("hydra/"):
            extra = {"launcher": "joblib, ray or slurm", "sweeper": "optuna"}.get(group.split("/")[-1], "")
            return (f"specpipe: invalid override {group}={opt}: the plugin for '{opt}' is not installed or has no "
                    f"such option. Install the optional extra first, e.g. pip install -e '.[{opt}]' "
                    f"(extras: {extra or 'joblib, ray, slurm, optuna'}).")
        return (f"specpipe: invalid override {group}={opt}: config group '{group}' has no option '{opt}' "
                f"(valid: {', '.join(group_options(group))}).")
    m = re.search(r"Key '([^']+)' (?:is )?not in (?:struct|'([^']+)')", msg) or \
        re.search(r"Could not override '([^']+)'", msg)
    if m:
        key = m.group(1)
        keys = [o.split("=")[0].lstrip("+~") for o in overrides]
        full = next((k for k in keys if k == key), None) or next((k for k in keys if k.endswith("." + key)), key)
        valid = valid_keys(full)
        hint = f" (valid keys there: {', '.join(valid)})" if valid else ""
        group = full.split(".")[0]
        chosen = next((o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0].lstrip("+") == group), None)
        if chosen is not None and "." in full:  # the key belongs to other options of the group (a sweep's point)
            return (f"specpipe: invalid override: '{full}' is not a setting of {group}={chosen}{hint}; in a sweep every "
                    f"point gets every override, so sweep the {group} options that take it in a command of their "
                    f"own. `python -m specpipe --cfg job {group}={chosen}` shows its keys.")
        return (f"specpipe: invalid override: '{full}' is not a configuration key{hint}. "
                f"Use `python -m specpipe --cfg job` to see every key.")
    if "Cannot merge" in msg:  # a {dict} or [list] where the schema has the other (or a scalar)
        shaped = next((o for o in overrides if re.search(r"=\s*[\[{]", o)), None)
        if shaped is not None:
            return (f"specpipe: invalid value in {shaped}: its shape ({'a dict' if '={' in shaped else 'a list'}) "
                    f"is not what that setting holds; `python -m specpipe --cfg job` shows each key's value.")
    m = re.search(r"full_key: ([\w.]+)", msg)
    if m and re.search(r"is not a valid bool", msg):
        val = re.search(r"Value '(.*)' is not a valid bool", msg)
        shown = repr(val.group(1)) if val else "the value"
        return (f"specpipe: invalid value for {m.group(1)}: {shown} is not true or false; give {m.group(1)}=true or "
                f"{m.group(1)}=false.")
    if m and "is not Optional" in msg:
        key = m.group(1)
        default = default_value(key, [o for o in overrides if o.lstrip("+").split("=")[0] != key])
        kind = ("true or false" if isinstance(default, bool) else "an integer" if isinstance(default, int)
                else "a number" if isinstance(default, float) else "a value")
        shown = str(default).lower() if isinstance(default, bool) else repr(default)
        was = f" (its default is {shown})" if default is not None else ""
        return f"specpipe: invalid value for {key}: it cannot be null; give {key}=<{kind}>{was}."
    first = " ".join(line.strip() for line in msg.splitlines() if line.strip() and not line.strip().startswith(
        ("full_key", "object_type", "reference_type")))
    if m:
        return f"specpipe: invalid value for {m.group(1)}: {first}."
    return f"specpipe: invalid override: {first}"


def default_value(key: str, overrides: list[str]):
    """`key`'s value when composed with `overrides` (the groups chosen), or None when that fails."""
    try:
        from omegaconf import OmegaConf

        return OmegaConf.select(compose_config(overrides), key, default=None)
    except Exception:
        return None


def valid_keys(dotted: str) -> list[str]:
    """Keys of the parent node of a dotted key in the default config (for 'did you mean' lists)."""
    try:
        cfg = compose_config([])
    except Exception:
        return []
    parent = dotted.rsplit(".", 1)[0] if "." in dotted else ""
    node = cfg
    for part in parent.split(".") if parent else []:
        if part not in node:
            return []
        node = node[part]
    try:
        return sorted(k for k in node.keys() if k != "_target_")
    except AttributeError:
        return []


def expand_home(overrides: list[str]) -> list[str]:
    """`key=~/dir` -> `key=/home/me/dir`: the shell leaves a "~" after "key=" alone, and the override grammar
    has no unquoted "~" in values (Hydra's own error is a lexer exception)."""
    import os

    out = []
    for o in overrides:
        key, eq, value = o.partition("=")
        if eq and not key.startswith("-") and re.match(r"~[\w.-]*(/|$)", value) and value != "~":
            path = os.path.expanduser(value)
            if path != value and re.fullmatch(r"[\w/.+@%:-]+", path):
                o = f"{key}={path}"
            elif path != value and "'" not in path:
                o = f"{key}='{path}'"
        out.append(o)
    return out


def compose_config(overrides: list[str]):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from specpipe.schema import register_schemas

    register_schemas()
    GlobalHydra.instance().clear()
    from specpipe.validate import expand_user_paths

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    expand_user_paths(cfg)
    return cfg


def expand(overrides: list[str], limit: int = 64) -> list[list[str]]:
    """Override lists for the sweep's points (all of them when few, else each value once)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    choices = []
    for o in parsed:
        key = o.get_key_element()
        vals = [f"{key}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override() else [o.input_line]
        choices.append(vals)
    total = 1
    for c in choices:
        total *= len(c)
    if total <= limit:
        return [list(p) for p in itertools.product(*choices)]
    firsts = [c[0] for c in choices]
    return [firsts[:i] + [v] + firsts[i + 1:] for i, c in enumerate(choices) for v in c]


def usage() -> str:
    """`python -m specpipe --help`: how to run it and every config group's options (Hydra's own help lists
    the schemas' base_* entries too, which are not options)."""
    from omegaconf import OmegaConf

    defaults = {}
    for d in OmegaConf.load(CONF_DIR / "config.yaml").defaults:
        if isinstance(d, dict) or OmegaConf.is_dict(d):
            (group, option), = dict(d).items()
            defaults[group] = option
    groups = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir() and p.name != "hydra")
    width = max(map(len, groups))
    lines = []
    for g in groups:
        default = defaults.get(g)
        opts = [o for o in group_options(g) if o != default]
        first = [f"{default} (default)"] if default else ["(none by default)"]
        lines.append(f"  {g:<{width}}  {', '.join(first + opts)}")
    return "\n".join([
        "specpipe: config-driven speculative decoding (EAGLE trees, n-gram / suffix, standalone drafts).",
        "",
        "Usage:",
        "  python -m specpipe [group=option ...] [key=value ...]    one run (outputs/DATE/TIME/)",
        "  python -m specpipe -m key=v1,v2 group=a,b ...            a sweep, one job per combination (multirun/)",
        "  python -m specpipe --cfg job [overrides]                 print the composed config: every key and value",
        "  python -m specpipe.report SWEEP_DIR                      a sweep's table (CSV, markdown) and plot",
        "",
        "Config groups (group=option):",
        *lines,
        "",
        "Examples:",
        "  python -m specpipe draft.topk=4 draft.num_steps=5 allocator=paged",
        "  python -m specpipe model=hf model.path=DIR draft.path=HEAD_DIR workload.prompts_file=prompts.jsonl",
        "  python -m specpipe -m draft.topk=1,4,8 allocator=token,paged",
        "",
        "README.md documents every option and metric. Hydra's own help: python -m specpipe --hydra-help",
    ])


def precheck(argv: list[str]) -> Optional[str]:
    """The reworded error for the first bad override combination, or None when all compose and validate."""
    overrides, multirun, skip = split_args(argv)
    if skip:
        return None
    for o in overrides:  # Hydra would fail creating the output folder, with a traceback
        key, _, value = o.lstrip("+").partition("=")
        if key in ("hydra.run.dir", "hydra.sweep.dir") and value and Path(value).exists() and not Path(value).is_dir():
            return (f"specpipe: invalid configuration: {key}={value!r} is a file, not a folder; outputs need a "
                    f"folder (a new or existing one)")
    launcher = next((o.split("=", 1)[1] for o in overrides if o.lstrip("+").startswith("hydra/launcher=")), "basic")
    if multirun and launcher != "basic" and any(o.lstrip("+") == "workload.prompts_file=-" for o in overrides):
        return (f"specpipe: invalid configuration: workload.prompts_file=- (standard input) reaches only this "
                f"process, and hydra/launcher={launcher} runs the jobs in other processes; write the prompts to a "
                f"file (workload.prompts_file=prompts.jsonl), or use the default in-process launcher")
    own = [o for o in overrides if not o.lstrip("+~").startswith("hydra")]
    try:
        combos = expand(own) if multirun else [own]
    except Exception as e:
        return reword(e, own)
    from specpipe.errors import ConfigError
    from specpipe.validate import validate

    for combo in combos:
        try:
            cfg = compose_config(combo)
        except Exception as e:
            return reword(e, combo)
        if not multirun:
            try:
                validate(cfg)
            except ConfigError as e:
                return str(e)
            except Exception as e:  # an override the rules did not foresee: still no traceback
                return reword(e, combo)
    return None
