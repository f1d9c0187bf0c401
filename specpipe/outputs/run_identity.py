"""What makes stored results this run's: the resolved config they ran (compared setting by setting) and the
prompts they decoded (a digest). resume=true compares both before it takes a finished job's metrics.json or a
stopped run's finished requests."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from specpipe.config.validate import PATH_KEYS, to_container

NOT_RUN_KEYS = ("resume", "latency_limit_ms")  # change how a job is scored or skipped, not what it computes


def schema_default(cfg: Optional[DictConfig], path: tuple) -> tuple[bool, Any]:
    """(True, the default) of the setting at `path` from the dataclass schema of its parent node in `cfg`, or
    (False, None) when no schema says."""
    if cfg is None:
        return False, None
    parent = OmegaConf.select(cfg, ".".join(path[:-1])) if len(path) > 1 else cfg
    schema = OmegaConf.get_type(parent) if isinstance(parent, DictConfig) else None
    if not dataclasses.is_dataclass(schema):
        return False, None
    for f in dataclasses.fields(schema):
        if f.name == path[-1]:
            if f.default is not dataclasses.MISSING:
                return True, f.default
            if f.default_factory is not dataclasses.MISSING:
                value = f.default_factory()
                return True, to_container(OmegaConf.structured(value)) if dataclasses.is_dataclass(value) else value
    return False, None


def config_differences(stored: dict, current: dict, job: Optional[DictConfig] = None) -> list:
    """The settings two resolved configs ran differently, as (dotted key, stored value, current value): every
    setting both hold must be equal; a setting only the job holds must be at its schema default (a newer specpipe
    added it: a sweep started before an upgrade still resumes; every finished job ran again, its results gone,
    when the upgrade added sampling.min_p); a setting only the stored run holds (an older specpipe's, since
    dropped) is left out."""
    out = []

    def walk(a, b, path: tuple) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for k in a:
                if k in b:
                    walk(a[k], b[k], path + (k,))
            for k in b.keys() - a.keys():
                known, default = schema_default(job, path + (k,))
                if not (known and default == b[k]):
                    out.append((".".join(path + (k,)), None, b[k]))
        elif a != b and not same_file(".".join(path), a, b):
            out.append((".".join(path), a, b))

    strip = lambda c: {k: v for k, v in c.items() if k not in NOT_RUN_KEYS}  # noqa: E731
    walk(strip(stored), strip(current), ())
    return out


def same_file(key: str, a: Any, b: Any) -> bool:
    """Whether two values of a path setting name one file from here (relative and absolute, through a symlink). The
    path is only the name: what resume relies on, the prompts' and the model files' contents, is compared apart."""
    if key not in PATH_KEYS or not (isinstance(a, str) and isinstance(b, str)) or "-" in (a, b):
        return False
    return os.path.realpath(os.path.expanduser(a)) == os.path.realpath(os.path.expanduser(b))


def prompts_digest(items: list) -> str:
    """sha256 of the prompts a run decoded (each one's JSON object, keys sorted), kept in metrics.json as
    `prompts_sha256`: resume=true compares it, so a prompts file rewritten under the same name runs again."""
    h = hashlib.sha256()
    for it in items:
        h.update(json.dumps(it, sort_keys=True, default=str).encode() + b"\n")
    return h.hexdigest()
