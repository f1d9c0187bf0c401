"""Check command-line overrides before Hydra starts, and reword its errors as one paragraph.

Hydra's own errors print with exit code 1; specpipe promises exit code 2 and a message that
names the bad value and what would be valid. Composing each override combination up front
(cheap: no torch work) also means a multirun with one bad point fails before any job runs.
"""
from __future__ import annotations

import itertools
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

CONF_DIR = Path(__file__).resolve().parent / "conf"  # in the package, so an installed wheel has it (conf/ links here)
FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p", "--config-name", "-cn", "--config-path", "-cp",
                    "--config-dir", "-cd", "--experimental-rerun", "--info", "-i"}
SKIP_FLAGS = {"--help", "-h", "--hydra-help", "--config-path", "-cp", "--shell-completion", "-sc", "--version",
              "--experimental-rerun"}  # Hydra answers these itself (or they name configs the check cannot find)
PRINT_FLAGS = {"--cfg", "-c", "--info", "-i"}  # print a config: its overrides must compose, the run rules wait
OPTIONAL_VALUE = {"--info", "-i"}  # the value may be left out


@dataclass
class CommandLine:
    overrides: list = field(default_factory=list)
    multirun: bool = False  # -m / --multirun
    skip: bool = False
    prints: bool = False  # --cfg / --info
    config_dir: Optional[str] = None  # -cd: searched before the package's conf/
    config_name: str = "config"


def words(argv: list[str]) -> list[list[str]]:
    """argv grouped as Hydra's parser reads it: a flag with the value it takes, or one override."""
    out, i = [], 0
    while i < len(argv):
        a, nxt = argv[i], argv[i + 1] if i + 1 < len(argv) else None
        takes = a in FLAGS_WITH_VALUE and nxt is not None and not (
            a in OPTIONAL_VALUE and ("=" in nxt or nxt.startswith("-")))
        out.append(argv[i:i + 1 + takes])
        i += 1 + takes
    return out


def parse_command(argv: list[str]) -> CommandLine:
    c = CommandLine()
    for w in words(argv):
        flag, eq, inline = w[0].partition("=")
        value = inline if eq else (w[1] if len(w) > 1 else None)
        if w[0] in ("-m", "--multirun"):
            c.multirun = True
        elif w[0].startswith("-"):
            c.skip |= flag in SKIP_FLAGS
            c.prints |= flag in PRINT_FLAGS
            if flag in ("--config-dir", "-cd"):
                c.config_dir = value
            elif flag in ("--config-name", "-cn"):
                c.config_name = value or "config"
        else:
            c.overrides.append(w[0])
    return c


def split_args(argv: list[str]) -> tuple[list[str], bool, bool]:
    """(overrides, multirun flag, skip): skip when Hydra is asked for help or a config path."""
    c = parse_command(argv)
    return c.overrides, c.multirun, c.skip


def flags_first(argv: list[str]) -> list[str]:
    """Hydra's parser takes flags only before the overrides (`draft.topk=2 -m x=1,2` is an argparse error);
    move every flag, with its value, in front."""
    flags, rest, last = [], [], []
    for w in words(argv):
        # a bare --info goes last: in front of the overrides it would take the first one as its value
        (rest if not w[0].startswith("-") else last if len(w) == 1 and w[0] in OPTIONAL_VALUE else flags).extend(w)
    return flags + rest + last


def group_options(group: str, dirs: Optional[list] = None) -> list[str]:
    """The options of a config group: its YAML files in the package's config folder (and `dirs`, a user's)."""
    found = {p.stem for d in (dirs or [CONF_DIR]) if (Path(d) / group).is_dir() for p in (Path(d) / group).glob("*.yaml")}
    return sorted(found)


def last_value(overrides: list[str], key: str) -> Optional[str]:
    """The value `key` was given last in `overrides` (Hydra's: a key given twice takes the last), or None."""
    return next((o.split("=", 1)[1] for o in reversed(overrides) if o.split("=", 1)[0].lstrip("+") == key), None)


def reword(exc: Exception, overrides: list[str], dirs: Optional[list] = None) -> str:
    """One paragraph naming the bad key/value and what would be valid. `dirs`: the config folders searched (the
    package's and a user's), whose options are the valid ones."""
    msg = str(exc)
    cause = exc.__cause__
    if "Error merging override" in msg and cause is not None and "full_key" in str(cause):
        msg = str(cause)  # the validation error behind it names the key and the expected type
        m = re.search(r"Value '(.*)' of type '\w+' could not be converted to (\w+)\s+full_key: ([\w.]+)", msg, re.S)
        if m:
            val, typ, key = m.groups()
            kind = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false"}.get(typ, typ)
            typed = last_value(overrides, key)
            shown = repr(typed) if typed is not None and typed != val else repr(val)
            if typed is not None and typed != val:  # 1e3 is read as the float 1000.0
                shown += f" (read as {val})"
            return f"specpipe: invalid value for {key}: {shown} is not {kind}; give {key}=<{kind}>."
    typed = re.search(r"Invalid type assigned: \w+ is not a subclass of \w+\. value: (.*?)\s+full_key: ([\w.]+)",
                      str(cause) if cause is not None else msg, re.S)
    if typed:  # a plain value for a node that holds settings (compile.draft_topk=compile)
        val, key = typed.groups()
        hint = keys_hint([], key)
        return (f"specpipe: invalid override {key}={val}: {key} holds several settings{hint}, not one value; set "
                f"one of them ({key}.KEY=VALUE).")
    outer = re.search(r"Could not override '([^']+)'", msg)
    inner = re.search(r"Key '[^']+' (?:is )?not in .*full_key: ([\w.]+)", str(cause), re.S) if cause else None
    if outer and inner and inner.group(1).startswith(outer.group(1) + ".") and not outer.group(1).startswith("hydra"):
        msg = str(cause)  # a {dict} value with a key the schema lacks: the cause names the inner key
    odd_key = next((o for o in overrides if not re.fullmatch(r"[+~]*[\w./@-]+", o.split("=", 1)[0], re.ASCII)), None)
    if "LexerNoViableAltException" in msg and odd_key is not None:
        key = odd_key.split("=", 1)[0]
        return (f"specpipe: invalid override {odd_key!r}: the key {key!r} holds a character keys cannot have (a "
                f"space, or a letter outside ASCII); keys are like draft.topk or allocator, and `python -m specpipe "
                f"--cfg job` lists them.")
    odd_value = next((o for o in overrides if "=" in o and o.split("=", 1)[1][:1] not in ("'", '"')
                      and re.search(r"[^\x21-\x7e]|[()=]", o.split("=", 1)[1])), None)
    if ("LexerNoViableAltException" in msg or "mismatched input" in msg or "no viable alternative" in msg
            or "extraneous input" in msg) and odd_value is not None and odd_key is None:
        key, value = odd_value.split("=", 1)
        quoted = ",".join(f'"{v}"' if re.search(r"[^\x21-\x7e]|[()=]", v) else v for v in value.split(","))
        return (f"specpipe: invalid override {odd_value!r}: its value holds a character the override grammar reads "
                f"otherwise (a space, a letter outside ASCII, a parenthesis, '='); quote it, for the shell too: "
                f"'{key}={quoted}'{' (a comma still separates sweep values)' if ',' in value else ''}.")
    no_eq = next((o for o in overrides if "=" not in o and not o.startswith("~")), None)
    if "missing EQUAL" in msg and no_eq is not None:
        return (f"specpipe: invalid override {no_eq!r}: overrides are key=value (e.g. draft.topk=4) or "
                f"group=option (e.g. allocator=paged); `python -m specpipe --help` lists the groups.")
    m = re.search(r"Config group override must be a string or a list", msg)
    null = next((o for o in overrides if o.split("=", 1)[-1] in ("null", "None", "~")), None) or next(
        (o for o in overrides if "=" in o and group_options(o.split("=", 1)[0].lstrip("+"), dirs)
         and not isinstance(_parsed_value(o), (str, list))), None)
    if m and null is not None:
        group = null.split("=", 1)[0].lstrip("+")
        return (f"specpipe: invalid override {null}: config group '{group}' needs one of its options "
                f"(valid: {', '.join(group_options(group))}).")
    m = re.search(r"Multiple values for ([\w/]+)\. To override a value use 'override", msg)
    if m:
        added = next((o for o in overrides if o.startswith("+") and o.lstrip("+").startswith(m.group(1) + "=")),
                     f"+{m.group(1)}=...")
        return (f"specpipe: invalid override {added}: the config already chooses a {m.group(1)} option; write "
                f"{added.lstrip('+')} to change it ('+' adds a key or group the config does not have).")
    deleted = next((o for o in overrides if o.startswith("~")), None)
    if "does not support deletion" in msg and deleted is not None:
        return (f"specpipe: invalid override {deleted}: a setting cannot be removed (the schema needs every key); "
                f"set a value instead, {deleted[1:].split('=')[0]}=VALUE.")
    bad = next((o for o in overrides if "(" in o and "=" in o), None)
    if ("Error parsing override" in msg or "no viable alternative" in msg) and bad is not None \
            and bad.lstrip("+").startswith("compile"):
        key, val = bad.split("=", 1)
        return (f"specpipe: invalid override {bad}: the command line treats parentheses and commas specially, "
                f"so quote a policy expression with options, e.g. '{key}=\"{val}\"' (valid policies: eager, "
                f"compile, compile(dynamic=false, fullgraph=true, mode=...), graph, auto).")
    msg = re.sub(r"\s*Set the environment variable HYDRA_FULL_ERROR=1.*", "", msg, flags=re.S).strip()
    m = re.search(r"Could not (?:find|load) '([\w/]+)/([^']+)'", msg)
    if m:
        group, opt = m.group(1), m.group(2)
        if group.startswith("hydra/"):
            kind = group.split("/")[-1]
            extra = {"joblib": "joblib", "ray": "ray", "ray_local": "ray", "ray_aws": "ray", "slurm": "slurm",
                     "submitit_slurm": "slurm", "submitit_local": "slurm", "optuna": "optuna"}.get(opt)
            here = sorted(set(o for o in hydra_options(group) + group_options(group) if not o.startswith("base_")))
            have = f" (valid here: {', '.join(here)})" if here else ""
            if extra is None:
                more = {"launcher": "joblib, ray or slurm", "sweeper": "optuna"}.get(kind, "joblib, ray, slurm, optuna")
                return (f"specpipe: invalid override {group}={opt}: there is no {kind} '{opt}'{have}; the optional "
                        f"extras ({more}) add plugins, e.g. pip install -e '.[{more.split(',')[0]}]'.")
            typed = last_value(overrides, group)
            preset = next((o for o in overrides if o.lstrip("+").startswith("sweep=")), None)
            what = f"{group}={typed or opt}" if typed in (None, opt) else f"{group}={typed} (it extends '{opt}')"
            if typed is None and preset is not None:
                what = f"{preset.lstrip('+')} (it uses {group}={opt})"
            return (f"specpipe: invalid override {what}: the plugin for '{opt}' is not installed{have}. "
                    f"Install the optional extra first: pip install -e '.[{extra}]'.")
        valid = group_options(group, dirs)
        if not valid:
            groups = sorted({p.name for d in (dirs or [CONF_DIR]) if Path(d).is_dir() for p in Path(d).iterdir()
                             if p.is_dir() and p.name != "hydra" and any(p.glob("*.yaml"))})
            return (f"specpipe: invalid override {group}={opt}: there is no config group '{group}' in the config "
                    f"folders searched (groups: {', '.join(groups)}); a group of your own, such as "
                    f"myconf/{group}/{opt}.yaml, is added with -cd myconf.")
        return (f"specpipe: invalid override {group}={opt}: config group '{group}' has no option '{opt}' "
                f"(valid: {', '.join(valid)}).")
    m = re.search(r"Key '([^']+)' (?:is )?not in (?:struct|'([^']+)')", msg) or \
        re.search(r"Could not override '([^']+)'", msg)
    appended = next((o for o in overrides if o.startswith("hydra.") and o.split("=")[0] in msg
                     and not re.match(r"hydra\.(launcher|sweeper)\.", o)), None)
    if m and appended is not None and "To append to your config use +" in msg:
        return (f"specpipe: invalid override {appended}: '{appended.split('=')[0]}' is not in Hydra's config yet; add "
                f"it with a '+': +{appended}.")
    plugin = next((o.split("=")[0].lstrip("+") for o in overrides if re.match(r"\+*hydra\.(launcher|sweeper)\.", o)),
                  None)
    if m and plugin is not None:
        kind = plugin.split(".")[1]
        chosen = next((o.split("=", 1)[1] for o in overrides if o.lstrip("+").startswith(f"hydra/{kind}=")), None)
        if chosen is not None:
            rest = [o for o in overrides if not o.lstrip("+~").startswith(f"hydra.{kind}.")]
            hint = keys_hint(rest, f"hydra.{kind}")
            return (f"specpipe: invalid override: '{plugin}' is not a setting of hydra/{kind}={chosen}{hint}; "
                    f"`python -m specpipe --cfg hydra -p hydra.{kind} hydra/{kind}={chosen}` lists them with their "
                    f"values.")
        return (f"specpipe: invalid override: '{plugin}' is not a setting of the {kind} in use (each hydra/{kind} "
                f"has its own, e.g. hydra.launcher.n_jobs belongs to hydra/launcher=joblib); choose the {kind} in "
                f"the same command, and `python -m specpipe --cfg hydra -p hydra.{kind}` lists its settings.")
    if m:
        key = m.group(1)
        keys = [o.split("=")[0].lstrip("+~") for o in overrides]
        full = next((k for k in keys if k == key), None) or next((k for k in keys if k.endswith("." + key)), key)
        named = re.search(r"full_key: ([\w.]+)", msg)
        full = named.group(1) if named and named.group(1).endswith(key) else full
        source = re.match(r"In '([^']+)':", msg)
        if source and full not in keys:  # a key in a config file of the user's, not on the command line
            valid = valid_keys(full)
            hint = f" (valid keys there: {', '.join(valid)})" if valid else ""
            return (f"specpipe: invalid configuration: {source.group(1)}.yaml sets '{full}', which is not a "
                    f"configuration key{hint}. Use `python -m specpipe --cfg job` to see every key.")
        valid = valid_keys(full)
        hint = f" (valid keys there: {', '.join(valid)})" if valid else ""
        group = full.split(".")[0]
        chosen = last_value(overrides, group)
        if chosen is not None and "." in full and group_options(group):  # the key belongs to other options of the group (a sweep's point)
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


def hide_schemas_from_completion() -> None:
    """Shell completion lists a group's options from Hydra's config store too, where the schemas' base_* entries
    live; they are not options (the precheck refuses them), so completion leaves them out."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    listed = ConfigLoaderImpl.get_group_options
    if getattr(listed, "_specpipe", False):
        return

    def options(self, *args, **kwargs):
        return [o for o in listed(self, *args, **kwargs) if not o.startswith("base_")]

    options._specpipe = True
    ConfigLoaderImpl.get_group_options = options


def keys_hint(overrides: list[str], node: str) -> str:
    """" (valid keys there: a, b)" for the config node at dotted `node` composed with `overrides`; "" when it
    cannot be told."""
    from omegaconf import OmegaConf

    try:
        found = OmegaConf.select(compose_config(overrides, hydra=node.startswith("hydra")), node)
        keys = sorted(k for k in found.keys() if k != "_target_")
    except Exception:
        keys = []
    return f" (valid keys there: {', '.join(keys)})" if keys else ""


def hydra_options(group: str) -> list[str]:
    """The options Hydra knows for one of its own groups (hydra/launcher: basic, joblib, ...): the installed
    plugins' configs."""
    try:
        from hydra.core.plugins import Plugins
        from hydra.core.config_store import ConfigStore

        Plugins.instance()  # registers the installed plugins' configs
        return sorted(name.removesuffix(".yaml") for name in ConfigStore.instance().list(group))
    except Exception:
        return []


def _parsed_value(override: str):
    """An override's value as Hydra parses it (3 is an int, null None); the text when it does not parse."""
    try:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        return OverridesParser.create().parse_override(override).value()
    except Exception:
        return override.split("=", 1)[-1]


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
    has no unquoted "~" in values (Hydra's own error is a lexer exception). A sweep's values are expanded one
    by one: `choice(~/a, ~/b)` (also sort/shuffle), and `key=~/a,~/b` when every item is a path (starts with
    ~ or /, no "=") and the whole value is not an existing one; anything else is one path, commas included."""

    def one(value: str) -> str:
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

    def items(text: str) -> list[str]:  # split at commas, not at escaped ones (\,)
        return re.split(r"(?<!\\),", text)

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
        if eq and not key.startswith("-") and value[:1] not in ("'", '"') \
                and not re.fullmatch(r"[\w/.+@%:~-]*", value, re.ASCII) \
                and os.path.exists(os.path.expanduser(value)) and not ("'" in value and '"' in value):
            # an existing file or folder whose name holds characters the override grammar reads otherwise (a
            # space, a letter outside ASCII, parentheses, a comma): it can only mean that path, so quote it
            quote = "'" if "'" not in value else '"'
            out.append(f"{key}={quote}{os.path.expanduser(value)}{quote}")
            continue
        if eq and not key.startswith("-") and "~" in value:
            fn = re.fullmatch(r"(choice|sort|shuffle)\((.*)\)", value, re.S)
            parts = items(value)
            if fn and not re.search(r"[\[\]{}'\"]", fn.group(2)):
                value = f"{fn.group(1)}({','.join(map(one, items(fn.group(2))))})"
            elif len(parts) > 1 and all(re.match(r"\s*[~/]", p) and "=" not in p for p in parts) \
                    and not os.path.exists(os.path.expanduser(value)):
                value = ",".join(map(one, parts))
            else:
                value = one(value)
            o = f"{key}={value}"
        out.append(o)
    return out


def compose_config(overrides: list[str], config_name: str = "config", hydra: bool = False,
                   config_dir: Optional[str] = None):
    """The config these overrides give (with its `hydra` node when asked). `config_dir` (a user's `-cd`) goes on
    the search path before the primary config is loaded, where Hydra puts it, so `-cn` may name a config there;
    `hydra.searchpath` in the overrides adds folders as on the command line."""
    from hydra import compose
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path
    from hydra.core.config_search_path import SearchPathQuery
    from hydra.core.global_hydra import GlobalHydra

    from specpipe.schema import register_schemas
    from specpipe.validate import expand_user_paths

    register_schemas()
    GlobalHydra.instance().clear()
    search_path = create_config_search_path(f"file://{CONF_DIR}")
    if config_dir is not None:
        search_path.prepend(provider="command-line", path=f"file://{Path(config_dir).expanduser().absolute()}",
                            anchor=SearchPathQuery(provider="schema"))
    Hydra.create_main_hydra2(task_name="specpipe", config_search_path=search_path)
    try:
        cfg = compose(config_name=config_name, overrides=overrides, return_hydra_config=hydra)
    finally:
        GlobalHydra.instance().clear()
    expand_user_paths(cfg)
    return cfg


def config_dirs(c: "CommandLine", overrides: list[str]) -> list[Path]:
    """The package's config folder and the user's: `-cd`, and `file://` entries of hydra.searchpath."""
    dirs = [CONF_DIR] + ([Path(c.config_dir).expanduser()] if c.config_dir else [])
    for o in overrides:
        key, _, value = o.lstrip("+").partition("=")
        if key == "hydra.searchpath":
            dirs += [Path(p) for p in re.findall(r"file://([^,\]\s'\"]+)", value)]
    return dirs


def expand(overrides: list[str], limit: int = 64, sampled: bool = False, dirs: Optional[list] = None) -> list[list[str]]:
    """Override lists for the sweep's points (all of them when few, else each value once). `sampled`: a
    sweeper that samples (Optuna) runs interval() itself, so the check leaves that key at its default."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import Glob, IntervalSweep

    choices = []
    for o in OverridesParser.create().parse_overrides(overrides):
        key = o.get_key_element()
        if isinstance(o.value(), Glob) and group_options(key.lstrip("+~"), dirs):  # expand_globs found no match
            raise ValueError(f"specpipe: invalid override {o.input_line}: it matches none of {key.lstrip('+~')}'s "
                             f"options ({', '.join(group_options(key.lstrip('+~'), dirs))}).")
        if isinstance(o.value(), Glob):  # what expand_globs left: not a config group
            raise ValueError(f"specpipe: invalid override {o.input_line}: glob() picks options of a config group "
                             f"(e.g. allocator=glob(t*)), and {key} is not one; list its values ({key}=1,2).")
        if isinstance(o.value(), IntervalSweep):
            if sampled:
                continue
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
        choices.append(vals)
    total = 1
    for c in choices:
        total *= len(c)
    if total <= limit:
        return [list(p) for p in itertools.product(*choices)]
    firsts = [c[0] for c in choices]
    return [firsts[:i] + [v] + firsts[i + 1:] for i, c in enumerate(choices) for v in c]


def expand_globs(argv: list[str]) -> list[str]:
    """`allocator=glob(t*)` -> `allocator=token`: Hydra's glob would also match the schemas' base_* entries
    that every group holds in the ConfigStore, and its check here has no config loader to list options."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import Glob

    c = parse_command(argv)
    dirs = config_dirs(c, c.overrides)
    out = []
    for a in argv:
        if not a.startswith("-") and "glob(" in a:
            try:
                o = OverridesParser.create().parse_override(a)
            except Exception:
                o = None  # the check names the problem
            options = group_options(o.get_key_element().lstrip("+~"), dirs) if o is not None else []
            if o is not None and isinstance(o.value(), Glob) and options:
                picked = o.value().filter(options)
                a = f"{o.get_key_element()}={','.join(picked)}" if picked else a
        out.append(a)
    return out


def usage(argv: Optional[list] = None) -> str:
    """`python -m specpipe --help`: how to run it and every config group's options (Hydra's own help lists
    the schemas' base_* entries too, which are not options). `argv`: the command, whose `-cd` and
    hydra.searchpath folders add groups and options."""
    from omegaconf import OmegaConf

    c = parse_command(list(argv or []))
    dirs = [d for d in config_dirs(c, c.overrides) if d.is_dir()]
    defaults = {}
    for d in OmegaConf.load(CONF_DIR / "config.yaml").defaults:
        if isinstance(d, dict) or OmegaConf.is_dict(d):
            (group, option), = dict(d).items()
            defaults[group] = option
    groups = sorted({p.name for d in dirs for p in d.iterdir()
                     if p.is_dir() and p.name != "hydra" and any(p.glob("*.yaml"))})
    width = max(map(len, groups))
    lines = []
    for g in groups:
        default = defaults.get(g)
        opts = [o for o in group_options(g, dirs) if o != default]
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


def output_folder_problem(key: str, value: str) -> Optional[str]:
    """Why Hydra could not make `value` its output folder (it would fail with a traceback), or None."""
    literal = value.split("${", 1)[0]
    if "${" in value:
        literal = literal.rsplit("/", 1)[0] if "/" in literal else ""
    try:
        path = Path(literal or ".").expanduser().absolute()
        if path.exists() and not path.is_dir():
            return (f"specpipe: invalid configuration: {key}={value!r} is a file, not a folder; outputs need a "
                    f"folder (a new or existing one)")
        existing = next(p for p in (path, *path.parents) if p.exists())
    except OSError as e:  # a name too long, a loop of links
        return f"specpipe: invalid configuration: {key}={value[:80]!r}... cannot be a folder ({e.strerror})"
    if not existing.is_dir():
        return (f"specpipe: invalid configuration: {key}={value!r} lies under {str(existing)!r}, which is a file; "
                f"outputs need a folder")
    if not os.access(existing, os.W_OK | os.X_OK) or os.statvfs(existing).f_flag & os.ST_RDONLY:
        return (f"specpipe: invalid configuration: {key}={value!r}: {str(existing)!r} cannot be written (no "
                f"permission or a read-only file system); give a folder you can write to")
    if existing != path:  # permissions are not all: /proc and /sys refuse new folders to root too (a traceback)
        import tempfile

        try:
            os.rmdir(tempfile.mkdtemp(prefix=".specpipe-probe-", dir=existing))
        except OSError as e:
            return (f"specpipe: invalid configuration: {key}={value!r}: no folder can be made in {str(existing)!r} "
                    f"({e.strerror or e}); give a folder you can write to (a new or existing one)")
    return None


def hydra_problem(cfg, multirun: bool, hydra_keys: tuple = ()) -> Optional[str]:
    """Launcher and output-folder settings that would fail inside Hydra, with a traceback. `hydra_keys`: the
    hydra.* keys the command sets, whose interpolations are checked too."""
    import shutil

    from omegaconf import OmegaConf

    launcher = str(OmegaConf.select(cfg, "hydra.launcher._target_", default="") or "")
    if multirun and "SlurmLauncher" in launcher and shutil.which("srun") is None and shutil.which("sbatch") is None:
        return ("specpipe: invalid configuration: hydra/launcher=slurm submits jobs to SLURM, and this machine has "
                "no SLURM (neither srun nor sbatch is on the PATH); run it on a cluster's login node, or try the "
                "same sweep here with hydra/launcher=submitit_local or joblib")
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    for k in [key, "hydra.sweep.subdir", "hydra.job.name", *hydra_keys]:
        why = interpolation_problem(cfg, k)
        if why:
            return why
    try:
        value = OmegaConf.select(cfg, key, default=None)
    except Exception:  # an interpolation Hydra resolves only once the job runs
        return None
    return None if value is None else output_folder_problem(key, str(value))


def interpolation_problem(cfg, key: str) -> Optional[str]:
    """Why `key`'s ${...} cannot be resolved at all (Hydra would stop with a traceback), or None. Keys that
    Hydra fills in only once the job runs (hydra.job.num, hydra.runtime.*) are not the user's mistake."""
    from omegaconf import OmegaConf
    from omegaconf.errors import InterpolationKeyError, InterpolationResolutionError, UnsupportedInterpolationType

    try:
        OmegaConf.select(cfg, key, default=None, throw_on_resolution_failure=True)
        return None
    except UnsupportedInterpolationType as e:
        name = re.search(r"Unsupported interpolation type (\S+)", str(e))
        what = f"the resolver '{name.group(1)}', which does not exist" if name else "an unknown resolver"
    except InterpolationKeyError as e:
        name = re.search(r"Interpolation key '([^']+)' not found", str(e))
        if name is None or name.group(1).startswith("hydra"):
            return None
        what = f"${{{name.group(1)}}}, which is not a configuration key"
    except InterpolationResolutionError as e:
        name = re.search(r"Environment variable '([^']+)' not found", str(e))
        if name is None:
            return None
        what = (f"the environment variable {name.group(1)}, which is not set (a default goes after a comma: "
                f"${{oc.env:{name.group(1)},outputs}})")
    except Exception:
        return None
    try:
        raw = OmegaConf.to_container(OmegaConf.select(cfg, key.rsplit(".", 1)[0]), resolve=False)[key.rsplit(".", 1)[1]]
    except Exception:
        raw = "..."
    return (f"specpipe: invalid configuration: {key}={raw!r} refers to {what}; `python -m specpipe --cfg job` lists "
            f"the keys, and ${{oc.env:NAME}} reads an environment variable")


def preset_problem(msg: str, from_preset: list[str], base) -> str:
    """`msg` about a key that a sweep preset sweeps (not one the user typed) names the preset instead."""
    key = next((o.split("=", 1)[0] for o in from_preset if f"'{o.split('=', 1)[0]}'" in msg), None)
    if key is None:
        return msg
    name = base.hydra.runtime.choices.get("sweep") or "?"
    group = key.split(".")[0]
    chosen = base.hydra.runtime.choices.get(group)
    hint = keys_hint([f"{group}={chosen}"], group)
    return (f"specpipe: invalid override {group}={chosen}: the ready sweep sweep={name} sweeps {key}, which is not "
            f"a setting of {group}={chosen}{hint}; keep the sweep's own {group} option, or sweep {group}={chosen}'s "
            f"keys yourself (python -m specpipe -m {group}={chosen} {group}.KEY=v1,v2).")


NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def number_for_a_bool(parsed, base) -> Optional[str]:
    """OmegaConf reads a number given for a true/false setting as its truth (workload.ignore_eos=2 is true): the
    error for the first such override, or None."""
    from omegaconf import OmegaConf

    for p in parsed:
        key = p.get_key_element().lstrip("+~")
        if key.startswith("hydra"):
            continue
        try:
            if not isinstance(OmegaConf.select(base, key, default=None), bool):
                continue
            values = list(p.sweep_string_iterator()) if p.is_sweep_override() else [p.value()]
        except Exception:  # not a plain key (a group, a glob): composing names what is wrong
            continue
        bad = next((v for v in values if not isinstance(v, bool) and NUMBER.fullmatch(str(v).strip())), None)
        if bad is not None:
            return (f"specpipe: invalid value for {key}: {str(bad)!r} is not true or false; give {key}=true or "
                    f"{key}=false.")
    return None


# workload keys that choose the CLI's prompts: SpecPipe's calls take theirs as arguments
API_UNREAD = ("workload.prompts_file", "workload.prompt_set", "workload.num_prompts")


def precheck(argv: list[str], api: bool = False) -> Optional[str]:
    """The reworded error for the first bad override combination, or None when all compose and validate.
    `api`: overrides of SpecPipe(...), which writes no Hydra output folder."""
    c = parse_command(argv)
    if any(a in ("--shell-completion", "-sc") for a in argv):  # Hydra reads what to do from the overrides
        todo = [o for o in c.overrides if o.partition("=")[0] in ("install", "uninstall", "query")]
        if len(todo) != 1:
            return (f"specpipe: invalid command: --shell-completion needs one of install=SHELL, uninstall=SHELL "
                    f"(SHELL: bash, zsh or fish), and got {' '.join(todo) if todo else 'none'}; e.g. "
                    f"eval \"$(python -m specpipe -sc install=bash)\"")
        verb, _, shell = todo[0].partition("=")
        if verb != "query" and shell not in ("bash", "zsh", "fish"):
            return (f"specpipe: invalid command: --shell-completion {todo[0]}: completion is available for bash, zsh "
                    f"and fish, not {shell or 'an unnamed shell'!r}; e.g. eval \"$(python -m specpipe -sc "
                    f"{verb}=bash)\"")
    if c.skip:
        return None
    if c.config_dir is not None:
        where = Path(c.config_dir).expanduser()
        if not where.is_dir():
            return (f"specpipe: invalid configuration: --config-dir {c.config_dir!r} is not a folder; give the "
                    f"folder that holds your config groups (e.g. myconf/ with myconf/experiment/foo.yaml)")
    overrides = list(c.overrides)
    dirs = config_dirs(c, overrides)
    for o in overrides:
        key = o.lstrip("+").partition("=")[0]
        if not key.strip("~ "):
            return (f"specpipe: invalid override {o!r}: the key before '=' is missing; overrides are key=value "
                    f"(e.g. draft.topk=4) or group=option (e.g. allocator=paged)")
        name = key.lstrip("~")
        if o.startswith("~") and not name.startswith("hydra") and \
                not any((d / name).is_dir() for d in config_dirs(c, overrides)):
            return (f"specpipe: invalid override {o}: a setting cannot be removed (the schema needs every key); "
                    f"set a value instead, {key.lstrip('~')}=VALUE.")
    try:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception as e:
        return reword(e, overrides, dirs)
    for p in parsed:  # Hydra's own error for these is "Unexpected type: None" or "Could not override"
        if p.get_key_element().lstrip("+~") == "hydra.sweeper.params" and isinstance(p.value(), dict):
            plain = " ".join(f"{k}={v}" for k, v in p.value().items())
            return (f"specpipe: invalid override {p.input_line}: a sweep's values are given as plain keys, not as "
                    f"hydra.sweeper.params; write -m {plain}")
        if p.get_key_element().lstrip("+~").startswith("hydra.sweeper.params."):
            plain = p.input_line.lstrip("+~").removeprefix("hydra.sweeper.params.")
            return (f"specpipe: invalid override {p.input_line}: a sweep preset's values are replaced by the same "
                    f"key given plainly; write {plain} (with -m for several values).")
    for p in parsed:  # the schemas every option extends are in the group's namespace, but run nothing of their own
        group = p.get_key_element().lstrip("+~")
        try:
            values = list(p.sweep_string_iterator()) if p.is_sweep_override() else [str(p.value())]
        except Exception:
            values = []
        schema = next((v for v in values if v.startswith("base_") and v not in group_options(
            group, config_dirs(c, overrides))), None)  # (a YAML of that name is an option)
        if schema is not None and "." not in group and group_options(group, config_dirs(c, overrides)):
            return (f"specpipe: invalid override {group}={schema}: {schema} is the schema that {group} options "
                    f"extend (a user's {group} YAML lists it in its defaults), not an option (valid: "
                    f"{', '.join(group_options(group, config_dirs(c, overrides)))}).")
    first = []  # the first point: every override with its first value (a sweep's keys can need its groups)
    for p in parsed:
        try:
            first.append(f"{p.get_key_element()}={next(iter(p.sweep_string_iterator()))}" if p.is_sweep_override()
                         else p.input_line)
        except Exception:  # glob() on a key, interval(), an empty range: expand() names the problem
            pass
    try:
        base = compose_config(first, c.config_name, hydra=True, config_dir=c.config_dir)
    except Exception as e:
        if "Cannot find primary config" in str(e):
            mine = sorted({p.stem for d in dirs if d.is_dir() for p in d.glob("*.yaml")})
            return (f"specpipe: invalid command: --config-name {c.config_name!r}: no such config in the config "
                    f"folders searched (valid: {', '.join(mine)}); a primary config of your own is "
                    f"myconf/NAME.yaml, used as -cd myconf -cn NAME.")
        return reword(e, first, dirs)
    keys = [p.get_key_element().lstrip("+~") for p in parsed]
    lost = next((p for i, p in enumerate(parsed) if p.is_sweep_override() and keys[i] in keys[i + 1:]), None)
    if lost is not None:  # Hydra keeps the last one: `draft.topk=1,2 draft.topk=4` ran one job, silently
        key = lost.get_key_element().lstrip("+~")
        given = " ".join(p.input_line for p in parsed if p.get_key_element().lstrip("+~") == key)
        return (f"specpipe: invalid override: {key} is given more than once ({given}) and the sweep "
                f"{lost.input_line} is not the last, so it would be dropped (the last one counts). Give {key} once, "
                f"with every value to sweep.")
    bad_bool = number_for_a_bool(parsed, base)
    if bad_bool is not None:
        return bad_bool
    multirun = c.multirun or str(base.hydra.mode) == "RunMode.MULTIRUN"  # sweep presets set hydra.mode
    swept = [p for p in parsed if p.is_sweep_override()]
    if c.prints and (c.multirun or swept):
        return ("specpipe: invalid command: --cfg and --info print one composed config, and this command is a sweep "
                "(-m, or several values for a key); drop -m and give one value per key to see one job's config")
    if api and (multirun or swept):  # SpecPipe builds one pipeline: a sweep would run its first point silently
        what = next((p.input_line for p in swept), None) or next(
            (o for o in overrides if o.lstrip("+").startswith(("sweep=", "hydra.mode"))), "a sweep")
        return (f"specpipe: invalid override {what}: SpecPipe runs one configuration, and this is a sweep (several "
                f"values, a sweep preset or hydra.mode=MULTIRUN); give one value per key, and run sweeps with "
                f"python -m specpipe -m ... (or build one SpecPipe per point)")
    if api:  # keys SpecPipe never reads: taken silently, a user would think they did something
        unread = next((p.input_line for p, k in zip(parsed, keys) if k in API_UNREAD
                       or (k.startswith(("hydra.", "hydra/")) and k not in ("hydra.searchpath", "hydra.mode"))), None)
        if unread is not None:
            key = unread.lstrip("+~").partition("=")[0]
            why = ("generate() and stream() take the prompts as their argument); leave it out" if key in API_UNREAD
                   else "it writes no Hydra output folder and launches no jobs, so Hydra's own settings do nothing "
                        "here; generate(out_dir=...) writes metrics.json and completions.jsonl); leave it out (of "
                        "Hydra's settings, hydra.searchpath, for config folders of your own, is read)")
            return f"specpipe: invalid override {unread}: SpecPipe does not read {key} ({why}"
    if multirun and swept:  # Hydra composes a sweep's base config with its plain overrides and no swept value
        plain = [p.input_line for p in parsed if not p.is_sweep_override()]
        try:
            compose_config(plain, c.config_name, hydra=True, config_dir=c.config_dir)
        except Exception as e:
            key = re.search(r"full_key: ([\w.]+)", str(e.__cause__ or e))
            group = key.group(1).split(".")[0] if key else None
            groups = [p.input_line for p in swept if p.get_key_element().lstrip("+") == group]
            if groups:
                return (f"specpipe: invalid override {key.group(1)}: Hydra first composes a sweep's config without "
                        f"its swept values (so with the default {group} option), and {key.group(1)} is not a setting "
                        f"there; it belongs to only some of {groups[0]}. Sweep each {group} option in a command of "
                        f"its own (python -m specpipe -m {group}=OPTION {key.group(1)}=...).")
    presets = next((p for p in swept if p.get_key_element().lstrip("+") == "sweep"), None)
    if presets is not None:
        return (f"specpipe: invalid override {presets.input_line}: one ready sweep per command (each sets its own "
                f"hydra.sweeper.params); run them one after another, e.g. python -m specpipe sweep="
                f"{next(iter(presets.sweep_string_iterator()), 'tree_shape')}")
    if swept and not multirun:
        return (f"specpipe: invalid override {swept[0].input_line}: several values (or a sweep function) make a "
                f"sweep, so add -m: python -m specpipe -m {' '.join(argv)}")
    hydra_swept = next((p for p in swept if p.get_key_element().lstrip("+~").startswith("hydra")), None)
    if hydra_swept is not None:
        return (f"specpipe: invalid override {hydra_swept.input_line}: Hydra's own settings cannot be swept; sweep "
                f"the run's keys (e.g. draft.topk=1,2).")
    hydra_keys = tuple(p.get_key_element().lstrip("+~") for p in parsed
                       if p.get_key_element().lstrip("+~").startswith("hydra."))
    why = None if (api or c.prints) else hydra_problem(base, multirun, hydra_keys)
    if why:
        return why
    if multirun and "BasicLauncher" not in str(base.hydra.launcher.get("_target_", "")) \
            and base.workload.get("prompts_file") == "-":
        name = base.hydra.runtime.choices.get("hydra/launcher", "")
        return (f"specpipe: invalid configuration: workload.prompts_file=- (standard input) reaches only this "
                f"process, and hydra/launcher={name} runs the jobs in other processes; write the prompts to a "
                f"file (workload.prompts_file=prompts.jsonl), or use the default in-process launcher")
    own = [o for o in overrides if not o.lstrip("+~").startswith("hydra")]
    hydra_own = [o for o in overrides if o.lstrip("+~").startswith("hydra")]
    sampled = "BasicSweeper" not in str(base.hydra.sweeper.get("_target_", ""))
    from_preset = []
    if multirun:  # a sweep preset's own points (hydra.sweeper.params) meet the command's groups too
        given = {p.get_key_element().lstrip("+~") for p in parsed}
        preset = base.hydra.sweeper.get("params") or {}
        from_preset = [f"{k}={v}" for k, v in preset.items() if k not in given and v is not None]
        own = own + from_preset
    try:
        combos = expand(own, sampled=sampled, dirs=config_dirs(c, overrides)) if multirun else [own]
    except ValueError as e:
        return str(e) if str(e).startswith("specpipe:") else reword(e, own, dirs)
    except Exception as e:
        return reword(e, own, dirs)
    from specpipe.errors import ConfigError
    from specpipe.validate import validate

    for combo in combos:
        try:
            cfg = compose_config(combo + hydra_own, c.config_name, config_dir=c.config_dir)
        except Exception as e:
            return preset_problem(reword(e, combo, dirs), from_preset, base) if multirun else reword(e, combo, dirs)
        if not multirun and not c.prints:
            try:
                validate(cfg)
            except ConfigError as e:
                return str(e)
            except Exception as e:  # an override the rules did not foresee: still no traceback
                return reword(e, combo, dirs)
    return None
