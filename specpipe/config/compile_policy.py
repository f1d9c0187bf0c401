"""The per-branch compile policy language and which device can run what. Imports no torch.

A policy is one short string per branch, set under `compile.<stage>.<branch>`:

    eager                          run the Python code as written
    compile                        torch.compile with the device's compiler
    compile(dynamic=false, fullgraph=true, mode=max-autotune-no-cudagraphs)
    compile(cpp_wrapper=true)      inductor's C++ wrapper around the kernels (less host time per call)
    graph                          capture at device.graph_batch_sizes, pad up, replay (CUDA/NPU graphs)
    auto                           time eager, compile (and graph) on the run's real inputs, keep the fastest
    auto(dynamic=false)            ... with these options for its compiled candidate

The words are device-independent; each Device translates them (devices/*.py) and
`DEVICE_SUPPORT` below says what each device accepts, so validation can refuse a policy before any
backend is imported. Errors quote the bad token, underline it with carets and list the valid words.
On the command line quote the value, or Hydra parses `compile(...)` as one of its own functions:
`python -m specpipe "compile.draft_topk.later='compile(dynamic=false)'"`.
"""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from typing import Any, Optional

MODES = ("eager", "compile", "graph", "auto")
TAKES_OPTIONS = ("compile", "auto")  # auto passes its options to its compiled candidate
COMPILE_OPTIONS = {
    "dynamic": (True, False, None),
    "fullgraph": (True, False),
    "mode": ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
    "backend": ("inductor", "aot_eager", "eager"),
    # inductor's cpp_wrapper: the compiled graph's wrapper (buffer views, size checks, kernel calls) in C++
    # instead of Python; on the shipped pair's compiled EAGLE rounds on CPU, 9 % less time per round
    # (scripts/bench_compile_overhead.py), for a longer first compile
    "cpp_wrapper": (True, False),
}
INDUCTOR_ONLY = ("mode", "cpp_wrapper")  # options of inductor itself, which other backends ignore
_WORDS = {"true": True, "false": False, "none": None, "null": None}
_TOKEN = re.compile(r"\s*(?:(?P<word>[A-Za-z_][\w-]*)|(?P<punct>[(),=])|(?P<bad>[^\s(),=]+|\S))")


class PolicyError(ValueError):
    """A policy string that does not parse; `str()` shows the text with the bad token underlined."""

    def __init__(self, text: str, pos: int, length: int, reason: str):
        self.text, self.pos, self.length, self.reason = text, pos, max(1, length), reason
        super().__init__(str(self))

    def __str__(self) -> str:
        return f"{self.reason}\n    {self.text}\n    {' ' * self.pos}{'^' * self.length}"


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
        return f"{self.mode}({', '.join(f'{k}={_fmt(v)}' for k, v in self.options)})"


def _fmt(v: Any) -> str:
    return "none" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def _hint(word: str, valid) -> str:
    close = difflib.get_close_matches(word, [str(v) for v in valid], n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _tokens(text: str) -> list[tuple[str, int, str]]:
    """(kind, position, token) for words, punctuation and stray characters, then ("end", len, "")."""
    out, i = [], 0
    while True:
        m = _TOKEN.match(text, i)
        if not m:
            return out + [("end", len(text), "")]
        kind = m.lastgroup
        out.append((kind, m.start(kind), m.group(kind)))
        i = m.end()


def parse_policy(text: Any) -> BranchPolicy:
    """Parse one policy, e.g. ``compile(dynamic=false, mode=max-autotune-no-cudagraphs)``.

    Raises PolicyError pointing at the first bad token.
    """
    if not isinstance(text, str):
        shown = repr(text)
        raise PolicyError(shown, 0, len(shown), f"{shown} is not a policy string (valid: {', '.join(MODES)})")
    toks = _tokens(text)
    kind, pos, mode = toks[0]
    if kind == "end":
        raise PolicyError(text, 0, 1, f"empty policy (valid: {', '.join(MODES)})")
    if kind != "word" or mode not in MODES:
        raise PolicyError(text, pos, len(mode),
                          f"unknown mode {mode!r} (valid: {', '.join(MODES)}){_hint(mode, MODES)}")
    opts: dict[str, Any] = {}
    k = 1
    if toks[k][2] == "(":
        if mode not in TAKES_OPTIONS:
            raise PolicyError(text, toks[k][1], len(text) - toks[k][1],
                              f"{mode!r} takes no options (only {' and '.join(TAKES_OPTIONS)} do)")
        k = _options(text, toks, k + 1, opts)
    kind, pos, tok = toks[k]
    if kind != "end":
        want = "'(' or the end" if k == 1 else "the end"
        raise PolicyError(text, pos, len(tok), f"unexpected {tok!r} after {text[:pos].strip()!r} (expected {want})")
    for key in INDUCTOR_ONLY:  # torch.compile only warns, and ignores them
        if key in opts and opts.get("backend", "inductor") != "inductor":
            at = max(text.find(key), 0)
            raise PolicyError(text, at, len(key), f"{key}={_fmt(opts[key])} is an inductor setting, which "
                              f"backend={opts['backend']} ignores; drop {key}, or leave backend unset (inductor)")
    return BranchPolicy(mode, tuple(sorted(opts.items())))


def _options(text: str, toks: list, k: int, opts: dict) -> int:
    """Parse `key=value, ...)` starting at token k; returns the index after ')'."""
    keys = ", ".join(COMPILE_OPTIONS)
    if toks[k][2] == ")":
        return k + 1
    while True:
        kind, pos, key = toks[k]
        if kind != "word" or key not in COMPILE_OPTIONS:
            what = "end of text" if kind == "end" else repr(key)
            raise PolicyError(text, pos, len(key),
                              f"unknown option {what} (valid keys: {keys}){_hint(key, COMPILE_OPTIONS)}")
        if key in opts:
            raise PolicyError(text, pos, len(key), f"option {key!r} is given twice")
        if toks[k + 1][2] != "=":
            raise PolicyError(text, toks[k + 1][1], len(toks[k + 1][2]),
                              f"expected '=' after {key!r} (as in {key}=...)")
        kind, pos, raw = toks[k + 2]
        opts[key] = _value(text, key, kind, pos, raw)
        kind, pos, sep = toks[k + 3]
        if sep == ")":
            return k + 4
        if sep != ",":
            raise PolicyError(text, pos, len(sep), f"expected ',' or ')' after {key}={raw} but found "
                              f"{'the end of the text' if kind == 'end' else repr(sep)}")
        k += 4


def _value(text: str, key: str, kind: str, pos: int, raw: str) -> Any:
    valid = COMPILE_OPTIONS[key]
    shown = ", ".join(_fmt(v) for v in valid)
    val = _WORDS.get(raw.lower(), raw) if kind == "word" else raw
    if kind != "word" or val not in valid:
        what = "nothing" if kind == "end" else repr(raw)
        raise PolicyError(text, pos, len(raw), f"{what} is not a valid value for {key} "
                          f"(valid: {shown}){_hint(raw, [_fmt(v) for v in valid])}")
    return val


# ---- what each device accepts (validation reads this without importing any backend) --------------
@dataclass(frozen=True)
class DeviceSupport:
    modes: frozenset  # policy modes the device runs or translates
    compile_modes: frozenset  # values accepted for compile(mode=...)
    backends: frozenset  # values accepted for compile(backend=...)
    refusals: dict = field(default_factory=dict)  # mode / option value -> why not, shown in errors
    translations: dict = field(default_factory=dict)  # documented substitutions the device may make


_ALL_MODES = frozenset(COMPILE_OPTIONS["mode"])
DEVICE_SUPPORT = {
    "cpu": DeviceSupport(
        frozenset({"eager", "compile", "auto"}), _ALL_MODES - {"reduce-overhead"},
        frozenset(COMPILE_OPTIONS["backend"]),
        refusals={"graph": "a CPU has no graph capture (that needs CUDA or NPU graphs); use compile or eager here, "
                           "or run with device=cuda or device=npu",
                  "reduce-overhead": "mode=reduce-overhead means CUDA graphs, which a CPU lacks; use compile or "
                                     "compile(mode=max-autotune-no-cudagraphs)"}),
    "cuda": DeviceSupport(frozenset(MODES), _ALL_MODES, frozenset(COMPILE_OPTIONS["backend"])),
    "npu": DeviceSupport(
        frozenset(MODES), _ALL_MODES, frozenset({"eager", "aot_eager"}),
        refusals={"inductor": "an NPU compiles through torchair, not inductor; leave backend unset "
                              "(aot_eager and eager remain for debugging)"},
        translations={"compile": "eager when torchair is not installed (logged once)",
                      "mode": "CompilerConfig.mode: reduce-overhead stays, every other mode becomes max-autotune",
                      "cpp_wrapper": "ignored: torchair builds its own graph (logged once)"}),
}


def device_problem(policy: BranchPolicy, device: str) -> Optional[str]:
    """Why `device` cannot run `policy`, or None. Unknown devices accept eager, compile and auto."""
    sup = DEVICE_SUPPORT.get(device)
    if sup is None:
        return None if policy.mode in ("eager", "compile", "auto") else f"device {device} cannot run {policy.mode!r}"
    if policy.mode not in sup.modes:
        why = sup.refusals.get(policy.mode, "")
        return (f"device {device} cannot run {policy.mode!r}" + (f": {why}" if why else "")
                + f" (valid on {device}: {', '.join(m for m in MODES if m in sup.modes)})")
    opts = policy.kwargs
    for key, allowed in (("mode", sup.compile_modes), ("backend", sup.backends)):
        val = opts.get(key)
        if val is not None and val not in allowed:
            why = sup.refusals.get(val, "")
            return (f"device {device} cannot run {key}={val}" + (f": {why}" if why else "")
                    + f" (valid on {device}: {', '.join(sorted(allowed))})")
    return None
