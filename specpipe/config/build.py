"""build(node): the only call of hydra.utils.instantiate, for exactly the class the node's schema names.

A `_target_` is a dotted name that Hydra imports and calls, so whatever a config may name, a user's override may
run. A prefix does not bound that: `specpipe.run.torch.load` starts with "specpipe." and is torch.load, reached
through a module that imports torch. So a node may name only the class its own schema names (the `_target_`
default of its dataclass in config/schema.py or config/drafts.py, registered in Hydra's ConfigStore for its
group), compared as strings. That is identity-safe without importing anything: each schema's qualname is the
module that defines the class plus its name, so the one string accepted resolves to that class, and any other
spelling (an alias through another module, a name that does not exist) is refused before Hydra imports it; the
check stays torch-free, as `config/` must.

Choosing the class is the config group's job (allocator=swa picks SWAAllocatorConf, which names SWAAllocator):
a class of another option of the same group is refused too, because the checks read the chosen option's schema
(a token allocator given page_size=16 would pass paged's), and a class of another group is never built.
"""
from __future__ import annotations

from typing import Any, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

from specpipe.errors import ConfigError, SpecpipeError

SHOWN = 120  # characters of a refused `_target_` that a message quotes (a hostile one can be megabytes)


def schema_target(schema: Any) -> Optional[str]:
    """The qualname a schema dataclass names (its `_target_` default), or None for a schema that names none."""
    target = getattr(schema, "_target_", None) if isinstance(schema, type) else None
    return target if isinstance(target, str) and target != MISSING else None


def group_targets(group: str) -> dict[str, str]:
    """option -> the qualname its schema names, for every option of config group `group`: the schemas specpipe
    ships and any a program registered in Hydra's ConfigStore as `<group>/base_<option>` (a drafter of the user's
    own, `tests/drafters/test_registry.py`); only Python code can register one, never a YAML file."""
    from hydra.core.config_store import ConfigStore

    from specpipe.config.schema import SCHEMAS, draft_schemas

    shipped = draft_schemas() if group == "draft" else SCHEMAS.get(group, {})
    found = {option: schema_target(s) for option, s in shipped.items()}
    stored = ConfigStore.instance().repo.get(group)
    for name, entry in (stored.items() if isinstance(stored, dict) else ()):
        node = getattr(entry, "node", None)
        if name.startswith("base_") and OmegaConf.is_config(node):
            found.setdefault(name.removeprefix("base_").removesuffix(".yaml"), schema_target(OmegaConf.get_type(node)))
    return {option: target for option, target in found.items() if target}


def option_of(target: str) -> Optional[tuple[str, str]]:
    """(group, option) whose schema names `target`, among the groups with classes; None for any other name."""
    for group in ("device", "allocator", "model", "draft"):
        option = next((o for o, t in group_targets(group).items() if t == target), None)
        if option is not None:
            return group, option
    return None


def check_target(node: Any, where: str) -> Optional[str]:
    """Why `node._target_` may not be built (one paragraph naming the value and the group's options), or None.
    `where`: the node's dotted key; a group's node (`allocator`) may name the class of its own schema, a node of
    no schema (a user's YAML without a base_* default) any class its group's schemas name, a nested one none."""
    target = node.get("_target_")
    group = where.split(".")[0]
    options = group_targets(group) if where and "." not in where else {}
    own = schema_target(OmegaConf.get_type(node)) if OmegaConf.is_config(node) else None
    allowed = [own] if own in options.values() else [] if own else list(options.values())
    if isinstance(target, str) and target in allowed:
        return None
    text = str(target)
    shown = repr(text if len(text) <= SHOWN else text[:SHOWN] + "...")
    if not options:
        return (f"{where or 'the config'}._target_={shown} is refused: only a config group's node (device, "
                f"allocator, model, draft) names a class, the one its option's schema names; remove this "
                f"_target_")
    chosen = next((o for o, t in options.items() if t == own), None)
    head = (f"{where}._target_={shown} is refused: a config builds only the class (or function) that its {group} "
            f"option's schema names{f' (the chosen {group}={chosen} builds {own})' if chosen else ''}")
    valid, owner = f"{group}={{{','.join(options)}}}", option_of(text)
    if owner is not None and owner[0] == group:
        return (f"{head}; {text} is {group}={owner[1]}'s class, so choose it with the config group: "
                f"{group}={owner[1]} (valid: {valid}), and leave {where}._target_ alone")
    article = "an" if group[:1] in "aeiou" else "a"
    why = f"{text} is {owner[0]}={owner[1]}'s class, not {article} {group}" if owner is not None else (
        f"no {group} option's schema names it (names are compared as written, so an alias through another module "
        f"is refused too)")
    return f"{head}; {why}. Choose the class with the config group ({valid}) and leave {where}._target_ alone"


def target_problems(node: Any, where: str) -> list[str]:
    """check_target's message for every `_target_` in `node` and the nodes below it (Hydra's instantiate builds
    nested ones too), outermost first."""
    found = []
    if isinstance(node, DictConfig):
        if "_target_" in node:
            err = check_target(node, where)
            if err:
                found.append(err)
        for k in node.keys():
            found += target_problems(node.get(k), f"{where}.{k}" if where else str(k))
    return found


def build(node: Any, where: str, **kwargs: Any) -> Any:
    """The object `node` describes, built by Hydra; ConfigError for any `_target_` check_target refuses (the run
    validated it already: this is the last gate before an import)."""
    from hydra.utils import instantiate

    errors = target_problems(node, where) if isinstance(node, DictConfig) else [check_target(node, where)]
    if any(errors):
        raise ConfigError([e for e in errors if e])
    try:
        return instantiate(node, **kwargs)
    except Exception as e:  # hydra wraps errors raised while building: surface the user-facing ones
        cause = e
        while cause is not None and not isinstance(cause, SpecpipeError):
            cause = cause.__cause__ or cause.__context__
        if cause is not None:
            raise cause from None
        raise
