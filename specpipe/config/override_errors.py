"""One paragraph for an override Hydra could not parse or compose, naming the bad key or value and what is valid.

Hydra's own errors print with exit code 1 and a page of text; specpipe promises exit code 2 and a message that
names the bad value and what would be valid. The messages are built from the exceptions' attributes: OmegaConf's
errors carry `.full_key`, `.value` and `.child_node` (the node that refused the value), Hydra's
`MissingConfigException` `.missing_cfg_file` and `.options`, `OverrideParseException` `.override` and
`.message`. Text is read only where Hydra keeps the information in no attribute: ANTLR's syntax errors, the
config file a composition error comes from, and a few ConfigCompositionExceptions raised without a cause.
"""
from __future__ import annotations

import re
from typing import Optional

from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig
from omegaconf.errors import (ConfigAttributeError, ConfigKeyError, ConfigTypeError, InterpolationResolutionError,
                              OmegaConfBaseException, ValidationError)
from omegaconf.nodes import BooleanNode, FloatNode, IntegerNode

from specpipe.config.compose import config_groups, default_value, group_options, keys_hint, valid_keys
from specpipe.config.hydra_settings import missing_plugin, plugin_key_problem
from specpipe.config.overrides import last_value, override_key, parsed_value

KINDS = {IntegerNode: "an integer", FloatNode: "a number", BooleanNode: "true or false"}  # what a node takes
PLAIN_KEY = re.compile(r"[+~]*[\w./@-]+", re.ASCII)  # the characters the override grammar takes in a key
# value characters the grammar reads otherwise (a space, a letter outside ASCII, parentheses, '=')
GRAMMAR_CHARS = re.compile(r"[^\x21-\x7e]|[()=]")


def explain(exc: BaseException, overrides: list[str], dirs: Optional[list] = None) -> str:
    """One paragraph naming the bad key/value and what would be valid. `overrides`: the ones composed; `dirs`:
    the config folders searched (the package's and a user's), whose options are the valid ones."""
    for reason in (parse_problem, group_value_problem, uncaused_problem, missing_config_problem,
                   interpolation_problem, value_problem, key_problem):
        said = reason(exc, overrides, dirs)
        if said:
            return said
    return fallback(exc)


def chain(exc: BaseException) -> list[BaseException]:
    """`exc` and the exceptions behind it (__cause__, else __context__), outermost first."""
    seen: list[BaseException] = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


def find(exc: BaseException, kind: type) -> Optional[BaseException]:
    """The first exception of type `kind` in `exc`'s chain."""
    return next((e for e in chain(exc) if isinstance(e, kind)), None)


def omegaconf_error(exc: BaseException) -> Optional[OmegaConfBaseException]:
    """The OmegaConf error behind `exc` that names the key it is about (its full_key), or None."""
    return next((e for e in chain(exc) if isinstance(e, OmegaConfBaseException) and e.full_key), None)


def source_config(exc: BaseException) -> Optional[str]:
    """The config file a composition error comes from (`experiment/badkey`), None for a command-line override.
    Hydra names the file only in its message ("In 'experiment/badkey': ..."), so it is read from there."""
    found = re.match(r"In '([^']+)':", str(exc))
    return found.group(1) if found else None


def failing_override(key: str, overrides: list[str]) -> Optional[str]:
    """The override that set `key` (a full key), a node above it, or a key below it (Hydra applies them in
    order, so the first one failed)."""
    return next((o for o in overrides if override_key(o) == key or key.startswith(override_key(o) + ".")
                 or override_key(o).startswith(key + ".")), None)


def parse_problem(exc, overrides, dirs) -> Optional[str]:
    """An override the grammar refuses. The kind of error is in ANTLR's text only (no attribute holds it)."""
    err = find(exc, OverrideParseException)
    if err is None:
        return None
    bad, text = err.override, err.message
    key, eq, value = bad.partition("=")
    lexer = "LexerNoViableAltException" in text  # a character no token starts with
    syntax = lexer or any(s in text for s in ("mismatched input", "no viable alternative", "extraneous input"))
    if lexer and not PLAIN_KEY.fullmatch(key):
        return (f"specpipe: invalid override {bad!r}: the key {key!r} holds a character keys cannot have (a "
                f"space, or a letter outside ASCII); keys are like draft.topk or allocator, and `python -m specpipe "
                f"--cfg job` lists them.")
    if syntax and eq and value[:1] not in ("'", '"') and GRAMMAR_CHARS.search(value):
        quoted = ",".join(f'"{v}"' if GRAMMAR_CHARS.search(v) else v for v in value.split(","))
        return (f"specpipe: invalid override {bad!r}: its value holds a character the override grammar reads "
                f"otherwise (a space, a letter outside ASCII, a parenthesis, '='); quote it, for the shell too: "
                f"'{key}={quoted}'{' (a comma still separates sweep values)' if ',' in value else ''}.")
    if not eq and not bad.startswith("~"):
        return (f"specpipe: invalid override {bad!r}: overrides are key=value (e.g. draft.topk=4) or "
                f"group=option (e.g. allocator=paged); `python -m specpipe --help` lists the groups.")
    if "(" in bad and eq and bad.lstrip("+").startswith("compile"):
        return (f"specpipe: invalid override {bad}: the command line treats parentheses and commas specially, "
                f"so quote a policy expression with options, e.g. '{key}=\"{value}\"' (valid policies: eager, "
                f"compile, compile(dynamic=false, fullgraph=true, mode=...), graph, auto).")
    return None


def group_value_problem(exc, overrides, dirs) -> Optional[str]:
    """A config group given null or a number: Hydra raises a bare ValueError, so the override says which."""
    if type(exc) is not ValueError:
        return None
    bad = next((o for o in overrides if "=" in o and group_options(override_key(o), dirs)
                and not isinstance(parsed_value(o), (str, list))), None)
    if bad is None:
        return None
    group = override_key(bad)
    return (f"specpipe: invalid override {bad}: config group '{group}' needs one of its options "
            f"(valid: {', '.join(group_options(group, dirs))}).")


def uncaused_problem(exc, overrides, dirs) -> Optional[str]:
    """Hydra errors raised as a plain ConfigCompositionException, their subject in the text only."""
    if not isinstance(exc, ConfigCompositionException) or exc.__cause__ is not None:
        return None
    unchosen = re.match(r"Could not override '([\w/]+)'\. No match in the defaults list", str(exc))
    if unchosen is not None:  # `experiment=foo` for a group the config has no option of (Hydra asks for a '+')
        group = unchosen.group(1)
        given = next((o for o in overrides if o.partition("=")[0] == group), f"{group}=...")
        return (f"specpipe: invalid override {given}: the config chooses no {group} option, so there is none to "
                f"change; add one with a '+': +{given}.")
    chosen = re.search(r"Multiple values for ([\w/]+)\. To override a value use 'override", str(exc))
    if chosen is None:
        return None
    group = chosen.group(1)
    added = next((o for o in overrides if o.startswith("+") and o.lstrip("+").startswith(group + "=")),
                 f"+{group}=...")
    return (f"specpipe: invalid override {added}: the config already chooses a {group} option; write "
            f"{added.lstrip('+')} to change it ('+' adds a key or group the config does not have).")


def missing_config_problem(exc, overrides, dirs) -> Optional[str]:
    """A group option (or a group) that no config folder has."""
    err = find(exc, MissingConfigException)
    if err is None or "/" not in (err.missing_cfg_file or ""):
        return None
    group, option = err.missing_cfg_file.rsplit("/", 1)
    if group.startswith("hydra/"):
        return missing_plugin(group, option, err.options, overrides)
    valid = group_options(group, dirs)
    if not valid:
        return (f"specpipe: invalid override {group}={option}: there is no config group '{group}' in the config "
                f"folders searched (groups: {', '.join(config_groups(dirs))}); a group of your own, such as "
                f"myconf/{group}/{option}.yaml, is added with -cd myconf.")
    if not option:
        return (f"specpipe: invalid override {group}=: config group '{group}' needs one of its options "
                f"(valid: {', '.join(valid)}).")
    return (f"specpipe: invalid override {group}={option}: config group '{group}' has no option '{option}' "
            f"(valid: {', '.join(valid)}).")


def interpolation_problem(exc, overrides, dirs) -> Optional[str]:
    """An interpolation with no value (`seed='${seed}'`, `${nope}`). OmegaConf raises it where a check reads the
    key, without naming the key (no full_key), so the config is composed again and read key by key to find it."""
    err = find(exc, InterpolationResolutionError)
    if err is None or getattr(err, "full_key", None):
        return None  # (one that names its key: value_problem / fallback quote it)
    why = str(err).splitlines()[0].strip().rstrip(".")
    found = None
    try:
        from specpipe.config.compose import compose_config

        found = unresolved_value(compose_config(overrides))
    except Exception:
        pass
    if found is None:  # it did not compose again: the last override that interpolates, as typed
        typed = next((o for o in reversed(overrides) if "${" in o.partition("=")[2]), None)
        found = (override_key(typed), typed.partition("=")[2]) if typed else None
    if found is None:
        return None
    key, raw = found
    shown = repr(raw if len(raw) <= 80 else raw[:80] + "...")
    if "Recursive interpolation" in why:
        return (f"specpipe: invalid value for {key}: {shown} leads back to {key} itself, so it has no value; give "
                f"{key} a value, or an interpolation of another key that has one.")
    return f"specpipe: invalid value for {key}: {shown} cannot be resolved ({why})."


def unresolved_value(cfg, where: str = "") -> Optional[tuple[str, str]]:
    """(key, its text as written) of the first value under `cfg` whose interpolation does not resolve, or None
    (Hydra's own `hydra` node is left out)."""
    from omegaconf import ListConfig

    for k in (cfg.keys() if isinstance(cfg, DictConfig) else range(len(cfg))):
        key = f"{where}.{k}" if where else str(k)
        if key == "hydra":
            continue
        try:
            value = cfg[k]
        except InterpolationResolutionError:
            return key, str(cfg._get_node(k)._value())
        if isinstance(value, (DictConfig, ListConfig)):
            inner = unresolved_value(value, key)
            if inner is not None:
                return inner
    return None


def value_problem(exc, overrides, dirs) -> Optional[str]:
    """A value the schema's node refuses: the wrong type, null where null is not allowed, a removal."""
    err = omegaconf_error(exc)
    if err is None or isinstance(err, (ConfigAttributeError, ConfigKeyError)):
        return None
    key, node, source = err.full_key, getattr(err, "child_node", None), source_config(exc)
    given = failing_override(key, overrides)
    if isinstance(err, ConfigTypeError) and given is not None and given.startswith("~"):
        return (f"specpipe: invalid override {given}: a setting cannot be removed (the schema needs every key); "
                f"set a value instead, {override_key(given)}=VALUE.")
    if isinstance(err, ConfigTypeError) and given is not None and re.search(r"=\s*[\[{]", given):
        return (f"specpipe: invalid value in {given}: its shape ({'a dict' if '={' in given else 'a list'}) "
                f"is not what that setting holds; `python -m specpipe --cfg job` shows each key's value.")
    if not isinstance(err, ValidationError) or node is None:
        return None
    if err.value is None:
        return null_problem(key, overrides)
    if isinstance(node, DictConfig) and not isinstance(err.value, (dict, DictConfig)):
        # a plain value for a node that holds settings (compile.draft_topk=compile)
        return (f"specpipe: invalid override {key}={err.value}: {key} holds several settings{keys_hint([], key)}, "
                f"not one value; set one of them ({key}.KEY=VALUE).")
    kind = KINDS.get(type(node))
    if isinstance(node, BooleanNode):
        return (f"specpipe: invalid value for {key}: {str(err.value)!r} is not true or false; give {key}=true or "
                f"{key}=false.")
    if kind is None:
        return None
    if source is not None:
        return f"specpipe: invalid configuration: {source}.yaml sets {key}={str(err.value)!r}, which is not {kind}."
    read, typed = str(err.value), last_value(overrides, key)
    shown = repr(typed) + f" (read as {read})" if typed is not None and typed != read else repr(read)  # 1e3: 1000.0
    return f"specpipe: invalid value for {key}: {shown} is not {kind}; give {key}=<{kind}>."


def null_problem(key: str, overrides: list[str]) -> str:
    """`key=null` for a setting that must have a value: what kind of value, and its default."""
    default = default_value(key, [o for o in overrides if o.lstrip("+").split("=")[0] != key])
    kind = ("true or false" if isinstance(default, bool) else "an integer" if isinstance(default, int)
            else "a number" if isinstance(default, float) else "a value")
    shown = str(default).lower() if isinstance(default, bool) else repr(default)
    was = f" (its default is {shown})" if default is not None else ""
    return f"specpipe: invalid value for {key}: it cannot be null; give {key}=<{kind}>{was}."


def key_problem(exc, overrides, dirs) -> Optional[str]:
    """A key the config does not have: typed on the command line, in a sweep's point, or in a config file."""
    err = omegaconf_error(exc)
    if not isinstance(err, (ConfigAttributeError, ConfigKeyError)):
        return None
    given = failing_override(err.full_key, overrides)
    full = override_key(given) if given and override_key(given).startswith(err.full_key + ".") else err.full_key
    source = source_config(exc)
    if full.startswith("hydra.") and source is None:
        return hydra_key_problem(full, given, overrides)
    removed = next((o for o in overrides if o.startswith("~") and override_key(o) == full.split(".")[0]), None)
    if removed is not None and "." in full:  # the default config's keys there would list the very key refused
        group = override_key(removed)
        options = group_options(group, dirs)
        choose = f"choose one ({group}={{{','.join(options)}}})" if options else "give it a value"
        return (f"specpipe: invalid override {removed}: it removes {group}, so '{full}' has no {group} to be "
                f"set in; a run needs its {group}: {choose} instead of removing it, and set {full} there.")
    valid = valid_keys(full)
    hint = f" (valid keys there: {', '.join(valid)})" if valid else ""
    if source and full not in [override_key(o) for o in overrides]:  # a key in a config file of the user's
        return (f"specpipe: invalid configuration: {source}.yaml sets '{full}', which is not a "
                f"configuration key{hint}. Use `python -m specpipe --cfg job` to see every key.")
    group = full.split(".")[0]
    chosen = last_value(overrides, group)
    if chosen is not None and "." in full and group_options(group):  # other options of the group have it (a sweep)
        return (f"specpipe: invalid override: '{full}' is not a setting of {group}={chosen}{hint}; in a sweep every "
                f"point gets every override, so sweep the {group} options that take it in a command of their "
                f"own. `python -m specpipe --cfg job {group}={chosen}` shows its keys.")
    return (f"specpipe: invalid override: '{full}' is not a configuration key{hint}. "
            f"Use `python -m specpipe --cfg job` to see every key.")


def hydra_key_problem(full: str, given: Optional[str], overrides: list[str]) -> Optional[str]:
    """A hydra.* key Hydra's config does not have: a plugin's setting, or a key to add with '+'."""
    if re.match(r"hydra\.(launcher|sweeper)\.", full):
        return plugin_key_problem(full, overrides)
    if given is not None and not given.startswith("+"):
        return (f"specpipe: invalid override {given}: '{given.split('=')[0]}' is not in Hydra's config yet; add "
                f"it with a '+': +{given}.")
    return (f"specpipe: invalid override: '{full}' is not a configuration key. "
            f"Use `python -m specpipe --cfg job` to see every key.")


def fallback(exc: BaseException) -> str:
    """Hydra's or OmegaConf's own words on one line, for errors no rule above knows."""
    err = omegaconf_error(exc)
    text = str(err) if err is not None and source_config(exc) is None else str(exc)
    text = re.sub(r"\s*Set the environment variable HYDRA_FULL_ERROR=1.*", "", text, flags=re.S).strip()
    first = " ".join(line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith(
        ("full_key", "object_type", "reference_type")))
    if err is not None:
        return f"specpipe: invalid value for {err.full_key}: {first}."
    return f"specpipe: invalid override: {first}"
