"""Compose a config the way `python -m specpipe` does, through Hydra's public compose API.

The precheck, SpecPipe(...) and the scripts all compose here, so they see the config a run would get: the
package's conf/ first, then a user's `-cd DIR` and `hydra.searchpath` folders. The helpers below answer what
the error messages need to know about a config (a group's options, the keys of a node, a key's default).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

# in the package, so an installed wheel has it (conf/ at the repository's root links here)
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
JOB_NAME = "specpipe"  # hydra.job.name, as @hydra.main names the job of `python -m specpipe`


def compose_config(overrides: list[str], config_name: str = "config", hydra: bool = False,
                   config_dir: Optional[str] = None):
    """The config these overrides give (with its `hydra` node when asked). `config_dir` (a user's `-cd`) goes on
    the search path before the primary config is loaded, where Hydra puts it, so `-cn` may name a config there;
    `hydra.searchpath` in the overrides adds folders as on the command line."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.plugins import Plugins

    from specpipe.config.schema import register_schemas
    from specpipe.config.validate import expand_user_paths

    register_schemas()
    Plugins.instance().register(UserConfigDir)  # (once: Hydra keeps a class it has)
    held = GlobalHydra.instance().hydra  # a running Hydra app's own (SpecPipe inside @hydra.main): put back after
    GlobalHydra.instance().clear()
    UserConfigDir.folder = None if config_dir is None else str(Path(config_dir).expanduser().absolute())
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), job_name=JOB_NAME, version_base="1.3"):
            cfg = compose(config_name=config_name, overrides=list(overrides), return_hydra_config=hydra)
    finally:
        UserConfigDir.folder = None
        if held is not None:
            GlobalHydra.instance().clear()
            GlobalHydra.instance().initialize(held)
    expand_user_paths(cfg)
    return cfg


class UserConfigDir(SearchPathPlugin):
    """Adds a user's `-cd` folder to the search path while compose_config runs, after the package's conf/ and
    the plugins' folders, as `python -m specpipe -cd DIR` does. Hydra's compose API takes no `-cd`, and a
    `hydra.searchpath` override cannot stand in for it: Hydra looks for the primary config (`-cn NAME`) before
    it reads hydra.searchpath, so a primary config of the user's own would not be found. A search path plugin,
    registered with Plugins.register, is Hydra's public way to add a folder."""

    folder: Optional[str] = None  # set only while compose_config runs: Hydra's own runs see no extra folder

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        if UserConfigDir.folder is not None:
            search_path.append(provider="command-line", path=f"file://{UserConfigDir.folder}")


def config_dirs(config_dir: Optional[str], overrides: list[str]) -> list[Path]:
    """The package's config folder and the user's: `-cd`, and `file://` entries of hydra.searchpath."""
    dirs = [CONF_DIR] + ([Path(config_dir).expanduser()] if config_dir else [])
    for o in overrides:
        key, _, value = o.lstrip("+").partition("=")
        if key == "hydra.searchpath":
            dirs += [Path(p) for p in re.findall(r"file://([^,\]\s'\"]+)", value)]
    return dirs


def group_options(group: str, dirs: Optional[list] = None) -> list[str]:
    """The options of a config group: its YAML files in the package's config folder (and `dirs`, a user's)."""
    folders = [Path(d) / group for d in (dirs or [CONF_DIR])]
    return sorted({p.stem for f in folders if f.is_dir() for p in f.glob("*.yaml")})


def config_groups(dirs: Optional[list] = None) -> list[str]:
    """The config groups a user chooses from (folders of YAML files; Hydra's own hydra/ is not one)."""
    return sorted({p.name for d in (dirs or [CONF_DIR]) if Path(d).is_dir() for p in Path(d).iterdir()
                   if p.is_dir() and p.name != "hydra" and any(p.glob("*.yaml"))})


def hydra_options(group: str) -> list[str]:
    """The options Hydra knows for one of its own groups (hydra/launcher: basic, joblib, ...): the installed
    plugins' configs."""
    try:
        from hydra.core.config_store import ConfigStore
        from hydra.core.plugins import Plugins

        Plugins.instance()  # registers the installed plugins' configs
        return sorted(name.removesuffix(".yaml") for name in ConfigStore.instance().list(group))
    except Exception:
        return []


def node_keys(overrides: list[str], node: str) -> list[str]:
    """The keys of the config node at dotted `node` composed with `overrides` ([] when it cannot be told)."""
    from omegaconf import OmegaConf

    try:
        found = OmegaConf.select(compose_config(overrides, hydra=node.startswith("hydra")), node)
        return sorted(k for k in found.keys() if k != "_target_")
    except Exception:
        return []


def keys_hint(overrides: list[str], node: str) -> str:
    """" (valid keys there: a, b)" for the config node at dotted `node` composed with `overrides`; "" when it
    cannot be told."""
    keys = node_keys(overrides, node)
    return f" (valid keys there: {', '.join(keys)})" if keys else ""


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


def default_value(key: str, overrides: list[str]):
    """`key`'s value when composed with `overrides` (the groups chosen), or None when that fails."""
    try:
        from omegaconf import OmegaConf

        return OmegaConf.select(compose_config(overrides), key, default=None)
    except Exception:
        return None


def default_options() -> dict[str, str]:
    """group -> the option the primary config's defaults list chooses."""
    from omegaconf import OmegaConf

    chosen = {}
    for d in OmegaConf.load(CONF_DIR / "config.yaml").defaults:
        if isinstance(d, dict) or OmegaConf.is_dict(d):
            (group, option), = dict(d).items()
            chosen[group] = option
    return chosen
