"""python -m specpipe.train [model=hf model.path=DIR] out=HEAD_DIR [head=eagle3|eagle1] [train.minutes=N] ...

Trains an EAGLE head for the target with Hydra's public API, as `python -m specpipe` runs: the overrides are
composed and checked first (a bad key or value is one paragraph, exit 2, no traceback), then @hydra.main runs the
job with out/ as its folder. Ctrl-C or SIGTERM saves a checkpoint; resume=true goes on from it.
"""
from __future__ import annotations

import shlex
import signal
import sys
import threading
from pathlib import Path
from typing import Optional

import hydra
from omegaconf import DictConfig

from specpipe.train.schema import register_train_schemas

TRAIN_CONF = Path(__file__).resolve().parent / "conf"


class Stopped(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C raises KeyboardInterrupt, so both save a checkpoint and say how to go on."""


def compose_train(overrides: list[str], hydra_node: bool = False):
    """The config `python -m specpipe.train` composes from `overrides` (Hydra's compose API on this app's folder,
    whose searchpath adds specpipe's conf/ for the model and device groups)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_train_schemas()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(TRAIN_CONF), job_name="train", version_base="1.3"):
            return compose(config_name="train", overrides=list(overrides), return_hydra_config=hydra_node)
    finally:
        GlobalHydra.instance().clear()


def config_problem(overrides: list[str]) -> Optional[str]:
    """One paragraph for the first problem of the command's config, or None: what Hydra cannot compose, then the
    model's and device's rules (specpipe.config.validate) and this app's ranges (train_problems)."""
    from omegaconf import OmegaConf

    from specpipe.config.compose import CONF_DIR
    from specpipe.config.override_errors import explain
    from specpipe.config.validate import expand_user_paths
    from specpipe.train.schema import train_problems

    try:
        cfg = compose_train(overrides, hydra_node=True)
    except Exception as e:
        return unknown_key_hint(explain(e, overrides, [TRAIN_CONF, CONF_DIR]).replace(
            "python -m specpipe ", "python -m specpipe.train "), overrides)
    expand_user_paths(cfg)
    missing = [k for k in cfg if k != "hydra" and OmegaConf.is_missing(cfg, k)]
    missing += sorted(m for k in cfg if k != "hydra" and not OmegaConf.is_missing(cfg, k)
                      and OmegaConf.is_config(cfg[k]) for m in OmegaConf.missing_keys(cfg[k]))
    if missing:
        return (f"specpipe: invalid configuration: {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                f"required but not set (add {missing[0]}=VALUE; e.g. python -m specpipe.train model=hf "
                f"model.path=DIR out=heads/mine)")
    problems = train_problems(cfg) + model_problems(cfg)
    if not problems:
        return None
    from specpipe.errors import ConfigError

    return str(ConfigError(problems))


def unknown_key_hint(msg: str, overrides: list[str]) -> str:
    """Hydra's "'x.y' is not a configuration key", with the keys that node of the train config does have."""
    import re

    from omegaconf import OmegaConf

    found = re.search(r"'([\w.]+)' is not a configuration key", msg)
    if found is None or "." not in found.group(1):
        return msg
    parent = found.group(1).rsplit(".", 1)[0]
    try:
        node = OmegaConf.select(compose_train([o for o in overrides if "=" in o and "/" not in o.split("=")[0]
                                               and o.split("=")[0].count(".") == 0]), parent)
        keys = sorted(k for k in node.keys() if k != "_target_")
    except Exception:
        return msg
    return msg.replace(" is not a configuration key", f" is not a configuration key (valid keys under {parent}: "
                       f"{', '.join(keys)})", 1)


def model_problems(cfg: DictConfig) -> list[str]:
    """The target folder exists and holds a config.json; device.dtype and model.dtype are known values."""
    from specpipe.config.validate import DTYPES

    e = []
    path = cfg.model.get("path")
    if path is not None and not (Path(path) / "config.json").is_file():
        e.append(f"model.path={path!r} is not a model folder (it needs config.json and safetensors weights; "
                 f"`make real-model` builds one)")
    if cfg.device.dtype not in DTYPES:
        e.append(f"device.dtype={cfg.device.dtype!r} is unknown (valid: {', '.join(DTYPES)})")
    if cfg.model.get("dtype") is not None and cfg.model.dtype not in (*DTYPES, "auto"):
        e.append(f"model.dtype={cfg.model.dtype!r} is unknown (valid: {', '.join(DTYPES)}, auto, or null)")
    if Path(cfg.out).exists() and not Path(cfg.out).is_dir():
        e.append(f"out={cfg.out!r} is a file; give a folder for the head (new or existing)")
    return e


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def hydra_main(cfg: DictConfig) -> None:
    from specpipe.errors import SpecpipeError
    from specpipe.train.app import train

    try:
        train(cfg)
    except KeyboardInterrupt as e:
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # a second Ctrl-C ends the process at once
        again = "python -m specpipe.train " + " ".join(shlex.quote(a) for a in sys.argv[1:] if a != "resume=true")
        how = "stopped by SIGTERM" if isinstance(e, Stopped) else "interrupted"
        ck = Path(cfg.out) / "checkpoint"
        if (ck / "data.pt").is_file():
            print(f"specpipe: training {how}; its data{' and head' if (ck / 'state.pt').is_file() else ''} are "
                  f"kept in {ck}. To go on: {again} resume=true", file=sys.stderr)
        else:
            print(f"specpipe: training {how} while making its data; nothing was kept", file=sys.stderr)
        sys.exit(143 if isinstance(e, Stopped) else 130)
    except SpecpipeError as e:
        print(str(e) if str(e).startswith("specpipe:") else f"specpipe: {e}", file=sys.stderr)
        sys.exit(e.exit_code)


def main() -> None:
    from specpipe.config.overrides import expand_home

    register_train_schemas()
    args = expand_home(sys.argv[1:])
    overrides = [a for a in args if not a.startswith("-")]
    if len(overrides) == len(args):  # flags (--cfg, --help, -m) go to Hydra as they are
        err = config_problem(overrides)
        if err:
            print(err, file=sys.stderr)
            sys.exit(2)
    sys.argv[1:] = args

    def stop(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise Stopped()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, stop)
    hydra_main()


if __name__ == "__main__":
    main()
