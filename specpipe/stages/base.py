"""Stages declare their branches; the compile policy decides how each branch runs.

`@branch` only tags a method. `Stage.bind(wrap)` replaces each branch with `wrap(stage, branch, fn)`,
once, at pipeline build time. Branch bodies are pure tensor code: no `.item()`, no allocator
calls, no Python state, so any of them can be compiled or graph-captured.
"""
from __future__ import annotations

import types
from typing import Callable, Hashable


def branch(fn: Callable) -> Callable:
    fn.__specpipe_branch__ = True
    return fn


_PER_SHAPE: dict = {}


def per_shape(method: Callable, key: Hashable) -> Callable:
    """`method` (a bound branch) rebound to a copy of its function with a code object of its own per `key`.

    For branches whose graph unrolls a Python loop over the tree shape (draft steps, accepted depths): Dynamo keeps
    its compiled graphs per code object, at most `recompile_limit` (8) of them, so one code object shared by every
    shape of an in-process sweep ran eager from the ninth shape on. One code object per shape keeps each shape's
    graph, which a later job of the same shape reuses."""
    f = method.__func__
    k = (f.__module__, f.__qualname__, key)
    if k not in _PER_SHAPE:
        g = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__, f.__closure__)
        g.__qualname__, g.__doc__, g.__dict__ = f.__qualname__, f.__doc__, dict(f.__dict__)
        _PER_SHAPE[k] = g
    return types.MethodType(_PER_SHAPE[k], method.__self__)


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
