"""Hydra's own settings that would fail inside Hydra with a traceback: plugins that are not installed, plugin
settings of another launcher, output folders that cannot be made, ${...} that cannot be resolved."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

from specpipe.config.compose import group_options, hydra_options, keys_hint
from specpipe.config.overrides import last_value

# the optional extra (pyproject's [project.optional-dependencies]) that installs each plugin option
PLUGIN_EXTRAS = {"joblib": "joblib", "ray": "ray", "ray_local": "ray", "ray_aws": "ray", "slurm": "slurm",
                 "submitit_slurm": "slurm", "submitit_local": "slurm", "optuna": "optuna"}


def missing_plugin(group: str, option: str, options: Optional[list], overrides: list[str]) -> str:
    """hydra/launcher=ray and the like without the plugin (or an option no plugin has). `options`: the
    options Hydra found for `group` (MissingConfigException.options)."""
    kind = group.split("/")[-1]
    extra = PLUGIN_EXTRAS.get(option)
    here = sorted(set(o for o in list(options or hydra_options(group)) + group_options(group)
                      if not o.startswith("base_")))
    have = f" (valid here: {', '.join(here)})" if here else ""
    if extra is None:
        more = {"launcher": "joblib, ray or slurm", "sweeper": "optuna"}.get(kind, "joblib, ray, slurm, optuna")
        return (f"specpipe: invalid override {group}={option}: there is no {kind} '{option}'{have}; the optional "
                f"extras ({more}) add plugins, e.g. pip install -e '.[{more.split(',')[0]}]'.")
    typed = last_value(overrides, group)
    preset = next((o for o in overrides if o.lstrip("+").startswith("sweep=")), None)
    what = f"{group}={typed or option}" if typed in (None, option) else f"{group}={typed} (it extends '{option}')"
    if typed is None and preset is not None:
        what = f"{preset.lstrip('+')} (it uses {group}={option})"
    return (f"specpipe: invalid override {what}: the plugin for '{option}' is not installed{have}. "
            f"Install the optional extra first: pip install -e '.[{extra}]'.")


def plugin_key_problem(key: str, overrides: list[str]) -> str:
    """A hydra.launcher.* / hydra.sweeper.* key the launcher or sweeper in use does not have."""
    kind = key.split(".")[1]
    chosen = next((o.split("=", 1)[1] for o in overrides if o.lstrip("+").startswith(f"hydra/{kind}=")), None)
    if chosen is not None:
        rest = [o for o in overrides if not o.lstrip("+~").startswith(f"hydra.{kind}.")]
        hint = keys_hint(rest, f"hydra.{kind}")
        return (f"specpipe: invalid override: '{key}' is not a setting of hydra/{kind}={chosen}{hint}; "
                f"`python -m specpipe --cfg hydra -p hydra.{kind} hydra/{kind}={chosen}` lists them with their "
                f"values.")
    return (f"specpipe: invalid override: '{key}' is not a setting of the {kind} in use (each hydra/{kind} "
            f"has its own, e.g. hydra.launcher.n_jobs belongs to hydra/launcher=joblib); choose the {kind} in "
            f"the same command, and `python -m specpipe --cfg hydra -p hydra.{kind}` lists its settings.")


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


def interpolation_problem(cfg, key: str) -> Optional[str]:
    """Why `key`'s ${...} cannot be resolved at all (Hydra would stop with a traceback), or None. Keys that
    Hydra fills in only once the job runs (hydra.job.num, hydra.runtime.*) are not the user's mistake.
    OmegaConf names the resolver, the key or the environment variable only in its message, so it is read there."""
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
