"""The newest sweep's points, retraced from its multirun.yaml as the basic sweeper makes them: how many jobs it
has, and whether a job folder's overrides are one of them (a re-sweep stopped by Ctrl-C leaves the jobs it did
not reach as they were)."""
from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Optional

import yaml

from specpipe.sweep.overrides import hydra_value

def newest_sweep_size(sweep_dir: Path) -> Optional[int]:
    """How many jobs the newest sweep into sweep_dir has, from its multirun.yaml (Hydra rewrites it at every
    sweep's start): the command line's sweeps and a preset's hydra.sweeper.params, the command line winning,
    as the basic sweeper combines them. None when that cannot be told (no file, another sweeper, glob())."""
    try:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        hydra = (yaml.safe_load((sweep_dir / "multirun.yaml").read_text(encoding="utf-8")) or {}).get("hydra") or {}
        sweeper = hydra.get("sweeper") or {}
        if "BasicSweeper" not in str(sweeper.get("_target_", "")) or \
                (hydra.get("sweep") or {}).get("subdir", "${hydra.job.num}") != "${hydra.job.num}":
            return None  # another sweeper, or job folders not named by job number: keep them all
        task = [str(o) for o in ((hydra.get("overrides") or {}).get("task") or [])]
        params = [f"{k}={v}" for k, v in (sweeper.get("params") or {}).items() if v is not None]
        counts = {}
        for o in OverridesParser.create().parse_overrides(params + task):  # later (the command line) wins
            key = o.get_key_element()  # prefix kept, as the sweeper keys them: ++k and k are two sweeps
            counts[key] = len(list(o.sweep_string_iterator())) if o.is_sweep_override() else 1
    except Exception:  # unreadable, or a sweep the check cannot count: every job dir is kept
        return None
    return math.prod(counts.values())


def newest_sweep_points(sweep_dir: Path, most: int = 100_000) -> Optional[list[dict]]:
    """The newest sweep's points (key -> canonical text of the value as Hydra parses it), from its multirun.yaml, as
    the basic sweeper makes them; None when that cannot be told (another sweeper, a key given with two prefixes
    such as seed= and ++seed=, too many points), in the sweeper's order (job i runs point i). A value that holds
    ${...} (resolved only by the sweeper) is None, which any value matches. A job folder whose overrides are none
    of them is not this sweep's point: a re-sweep stopped by Ctrl-C leaves the jobs it did not reach as they were."""
    try:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        hydra = (yaml.safe_load((sweep_dir / "multirun.yaml").read_text(encoding="utf-8")) or {}).get("hydra") or {}
        sweeper = hydra.get("sweeper") or {}
        if "BasicSweeper" not in str(sweeper.get("_target_", "")):
            return None
        task = [str(o) for o in ((hydra.get("overrides") or {}).get("task") or [])]
        params = [f"{k}={v}" for k, v in (sweeper.get("params") or {}).items() if v is not None]
        if any("shuffle(" in o for o in params + task):  # drawn anew by every parse: neither order nor safe match
            return None
        values: dict[str, list] = {}
        prefixes: dict[str, str] = {}
        for o in OverridesParser.create().parse_overrides(params + task):
            element = o.get_key_element()
            key = element.lstrip("+~")
            if prefixes.setdefault(key, element[:len(element) - len(key)]) != element[:len(element) - len(key)]:
                return None  # the sweeper applies seed= and ++seed= apart: not retraced here
            if key == "resume":
                continue
            found = [hydra_value(key, v) for v in o.sweep_string_iterator()] if o.is_sweep_override() \
                else [o.value()]
            values[key] = [None if "${" in x else x for x in map(_canonical, found)]  # None: any value matches
        if math.prod(len(v) for v in values.values()) > most:
            return None
        return [dict(zip(values, combo)) for combo in itertools.product(*values.values())]  # job i: point i
    except Exception:
        return None


def _canonical(value) -> str:
    """A parsed override value as text that compares equal when the values are (NaN included)."""
    try:
        return json.dumps(value, sort_keys=True, default=str)
    except (TypeError, ValueError):
        return repr(value)


def is_point(overrides: Optional[dict], points: list[dict]) -> bool:
    """Whether a job's overrides (key -> text) are one of the newest sweep's points (none known: not told, so yes)."""
    return overrides is None or not points or any(matches(overrides, point) for point in points)


def matches(overrides: dict, point: dict) -> bool:
    mine = {k: _canonical(hydra_value(k, v)) for k, v in overrides.items()}
    return all(v is None or mine.get(k) == v for k, v in point.items())
