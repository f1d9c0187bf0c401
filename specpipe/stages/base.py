"""Stages declare their branches; the compile policy decides how each branch runs.

`@branch` only tags a method. `Stage.bind(wrap)` replaces each branch with `wrap(stage, branch, fn)`,
once, at pipeline build time. Branch bodies are pure tensor code: no `.item()`, no allocator
calls, no Python state, so any of them can be compiled or graph-captured.
"""
from __future__ import annotations

from typing import Callable


def branch(fn: Callable) -> Callable:
    fn.__specpipe_branch__ = True
    return fn


class Stage:
    name = "stage"
    model_branches: frozenset = frozenset()  # branches that run a model forward (timed as model time)

    @classmethod
    def branch_names(cls) -> list[str]:
        return sorted(n for n in dir(cls) if getattr(getattr(cls, n, None), "__specpipe_branch__", False))

    def bind(self, wrap: Callable[[str, str, Callable], Callable]) -> None:
        self.wrapped = set()  # branches that no longer run as plain eager Python (compiled, graphed, timed)
        for b in self.branch_names():
            fn = getattr(self, b)
            out = wrap(self.name, b, fn)
            if out is not fn:
                self.wrapped.add(b)
            setattr(self, b, out)
