"""The per-branch compile policy language: `eager`, `compile`, `compile(k=v, ...)`, `graph`, `auto`.

A policy string is device-independent; each Device translates it (devices/*.py). Parsing errors
point at the bad token and list the valid words.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

MODES = ("eager", "compile", "graph", "auto")
COMPILE_OPTIONS = {
    "dynamic": (True, False, None),
    "fullgraph": (True, False),
    "mode": ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
    "backend": ("inductor", "aot_eager", "eager"),
}


class PolicyError(ValueError):
    pass


@dataclass(frozen=True)
class BranchPolicy:
    mode: str = "eager"
    options: tuple = field(default_factory=tuple)  # sorted (key, value) pairs

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.options)

    def __str__(self) -> str:
        if not self.options:
            return self.mode
        inner = ", ".join(f"{k}={_fmt(v)}" for k, v in self.options)
        return f"{self.mode}({inner})"


def _fmt(v: Any) -> str:
    return "none" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def _value(key: str, raw: str, text: str) -> Any:
    low = raw.strip().lower()
    conv = {"true": True, "false": False, "none": None, "null": None}.get(low, raw.strip())
    valid = COMPILE_OPTIONS[key]
    if conv not in valid:
        shown = ", ".join(_fmt(v) for v in valid)
        raise PolicyError(f"{text!r}: value {raw.strip()!r} for {key} is not valid (valid: {shown})")
    return conv


def parse_policy(text: str) -> BranchPolicy:
    """Parse one policy expression, e.g. ``compile(dynamic=false, mode=max-autotune-no-cudagraphs)``."""
    if not isinstance(text, str):
        raise PolicyError(f"{text!r} is not a policy string (valid: {', '.join(MODES)})")
    m = re.fullmatch(r"\s*([A-Za-z_][\w-]*)\s*(?:\((.*)\))?\s*", text)
    if not m:
        raise PolicyError(f"{text!r} is not a policy expression (valid: {', '.join(MODES)}, "
                          f"optionally with options as in compile(dynamic=false))")
    mode, args = m.group(1), m.group(2)
    if mode not in MODES:
        raise PolicyError(f"{text!r}: unknown mode {mode!r} (valid: {', '.join(MODES)})")
    opts: dict[str, Any] = {}
    if args is not None and args.strip():
        if mode != "compile":
            raise PolicyError(f"{text!r}: only compile(...) takes options, {mode!r} takes none")
        for part in args.split(","):
            if "=" not in part:
                raise PolicyError(f"{text!r}: option {part.strip()!r} must look like key=value "
                                  f"(valid keys: {', '.join(COMPILE_OPTIONS)})")
            key, raw = (s.strip() for s in part.split("=", 1))
            if key not in COMPILE_OPTIONS:
                raise PolicyError(f"{text!r}: unknown option {key!r} (valid keys: {', '.join(COMPILE_OPTIONS)})")
            opts[key] = _value(key, raw, text)
    return BranchPolicy(mode, tuple(sorted(opts.items())))
