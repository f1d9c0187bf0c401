"""A sweep job's point: the overrides Hydra saved for it (overrides.yaml in its Hydra folder) or that the job
recorded itself (metrics.json, error.json), parsed as Hydra parses them."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import yaml

from specpipe.outputs.run_files import read_json_object

HYDRA_FILES = ("overrides.yaml", "config.yaml", "hydra.yaml")  # what Hydra saves in a job's hydra.output_subdir


def mtime(p: Path) -> float:
    try:
        return p.stat().st_mtime
    except OSError:
        return float("-inf")


def hydra_dir(job_dir: Path) -> Optional[Path]:
    """The job's Hydra folder: .hydra, or the folder hydra.output_subdir named instead (one holding overrides.yaml,
    config.yaml and hydra.yaml); None when Hydra saved none (hydra.output_subdir=null)."""
    try:
        found = [d for d in sorted(job_dir.iterdir()) if d.name == ".hydra" and (d / "overrides.yaml").is_file()
                 or all((d / f).is_file() for f in HYDRA_FILES)]
    except OSError:
        return None
    # a re-sweep with another hydra.output_subdir leaves the earlier one's folder beside it: the newest is the job's
    return max(found, key=lambda d: mtime(d / "overrides.yaml"), default=None)


def hydra_overrides(hydra: Optional[Path]) -> dict[str, str]:
    """key -> value from Hydra's per-job overrides.yaml ('+', '++' and '~' prefixes dropped)."""
    if hydra is None:
        return {}
    try:
        items = yaml.safe_load((hydra / "overrides.yaml").read_text(encoding="utf-8")) or []
    except (OSError, yaml.YAMLError):
        return {}
    return parse_overrides(items)


def error_overrides(job_dir: Path, metrics: Optional[dict] = None) -> dict[str, str]:
    """key -> value from the overrides a job recorded, in metrics.json (a finished job) or error.json (a failed one,
    sweep.write_error): its point when Hydra saved no overrides.yaml (hydra.output_subdir=null). Values are
    written as the config's would be ("0.5" for "0.50"), so they compare with the finished jobs' settings."""
    items = (metrics or {}).get("overrides")
    if not isinstance(items, list):
        err, _ = read_json_object(job_dir / "error.json")
        items = (err or {}).get("overrides")
    if not isinstance(items, list):
        return {}
    out = {}
    for key, value in parse_overrides(items).items():
        parsed = hydra_value(key, value)
        out[key] = value if isinstance(parsed, dict) else override_text(parsed)
    return out


def hydra_value(key: str, text: str):
    """An override's value as Hydra reads it ("010" is the text 010, which the schema makes 10; YAML 1.1 would read
    octal 8), or the text itself when Hydra cannot parse it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return OverridesParser.create().parse_override(f"{key}={text}").value()
    except Exception:
        return text


def parse_overrides(items) -> dict[str, str]:
    out = {}
    if not isinstance(items, list):
        return out
    for item in items:
        key, _, value = str(item).partition("=")
        if key.lstrip("+~") != "resume":  # how the job was launched, not what it ran; a resumed sweep has it everywhere
            out[key.lstrip("+~")] = value
    return out


def override_text(v) -> str:
    """A config value as an override writes it ("" for a config group: its choice names it)."""
    if isinstance(v, list):
        return "[" + ",".join(map(override_text, v)) + "]"
    if isinstance(v, dict):
        return ""
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def config_leaves(node, prefix: str = "") -> dict[str, str]:
    """"draft.topk" -> "2" for every setting of a resolved config."""
    if not isinstance(node, dict):
        return {prefix[:-1]: override_text(node)} if prefix else {}
    return {k: v for key, sub in node.items() for k, v in config_leaves(sub, f"{prefix}{key}.").items()}


def recorded_overrides(job_dir: Path) -> Optional[dict[str, str]]:
    """The overrides metrics.json records (a job run by this version): what its results came from, even beside
    an earlier sweep's .hydra folder (a re-sweep with hydra.output_subdir=null or another name leaves it)."""
    metrics, _ = read_json_object(job_dir / "metrics.json")
    items = (metrics or {}).get("overrides")
    return parse_overrides(items) if isinstance(items, list) else None
