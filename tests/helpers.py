"""Shared test helpers (importable as `helpers`: pytest puts tests/ on sys.path)."""
from __future__ import annotations

import json


def compose(*overrides: str):
    from specpipe.cli_errors import compose_config

    return compose_config(list(overrides))


def write_prompts(path, prompts) -> str:
    path.write_text("".join(json.dumps({"prompt": x}) + "\n" for x in prompts))
    return str(path)
