"""Run metrics. Conventions follow vLLM's where one exists: the acceptance length counts the bonus token.

Stage times are wall time around each stage; `model` time is measured around the forward calls of the
models (forward hooks) by the device's model clock: a host clock with the device synchronized around
each forward (CPU, NPU), or CUDA events (no sync: the GPU time between them). `stage_host_ms` = stage
time - model time is the host overhead (Python, small kernels, bookkeeping) per decode step.
"""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Optional

import numpy as np


def recompile_count() -> int:
    """Dynamo graph compilations so far in this process (0 when nothing was compiled)."""
    try:
        from torch._dynamo.utils import counters
    except Exception:  # pragma: no cover - dynamo unavailable
        return 0
    return int(counters["stats"]["unique_graphs"])


_TIMED: list = [None]  # the Metrics the models' forward hooks time into now (None: the hooks do nothing)


def _timer_pre(_module, _args) -> None:
    import torch

    if torch.compiler.is_compiling():  # first: a traced hook must read no global (Dynamo would guard on it)
        return
    m = _TIMED[0]
    if m is not None and not m._outer:
        m._forward_begins()


def _timer_post(_module, _args, _out) -> None:
    import torch

    if torch.compiler.is_compiling():  # first: a traced hook must read no global (Dynamo would guard on it)
        return
    m = _TIMED[0]
    if m is not None and not m._outer:
        m._forward_ends()


def recompile_limit_hits() -> int:
    """Times so far Dynamo gave up compiling a branch (its recompile limit): that branch then runs eager, which
    `recompiles` alone cannot show (it counts graphs compiled, and none is)."""
    try:
        from torch._dynamo.utils import counters
    except Exception:  # pragma: no cover - dynamo unavailable
        return 0
    return int(sum(n for k, n in counters["unimplemented"].items() if str(k).startswith("Dynamo recompile limit")))


class Metrics:
    def __init__(self, num_steps: int, topk: int = 1, num_draft_tokens: int = 2):
        self.num_steps, self.topk, self.num_draft_tokens = num_steps, topk, num_draft_tokens
        self.num_verify_steps = 0  # decode rounds of the whole batch
        self.accepted: list[int] = []  # drafts accepted per (request, round)
        self.ranks: list[int] = []  # sibling rank (0 = the draft's top choice) of every accepted node
        self.linked: list[int] = []  # draft nodes linked into the verified tree per (request, round)
        self.stage_s: dict[str, float] = defaultdict(float)
        self.model_s: dict[str, float] = defaultdict(float)
        self.current = "other"
        self.generated_tokens = 0
        self.first_token_s: list[float] = []
        self.step_s: list[float] = []
        # steps that verified no draft, by batch size: a speculating run's floor, to hold against draft=none's steps
        self.plain_step_s: dict[int, list[float]] = defaultdict(list)
        self.step_plain: Optional[bool] = None  # the pipeline says, during each step, whether it verified no draft
        self.retractions = 0
        self._depth = [0, 0.0]  # timed forwards open, start of the outermost
        self._outer = 0  # > 0 inside a branch timed by model_branch: the hooks stand aside
        self._clock = None  # attach_model_timer's (devices/base.py HostClock, devices/cuda.py EventClock)
        self.timed = False  # attach_model_timer ran: model time was measured (else the split is unknown)

    @contextmanager
    def stage(self, name: str):
        t, prev = time.perf_counter(), self.current
        self.current = name
        try:
            yield
        finally:
            self.stage_s[name] += time.perf_counter() - t
            self.current = prev

    def attach_model_timer(self, modules, clock) -> None:
        """Time every forward of these modules with `clock` (a device's `model_clock()`, or a synchronize
        callable: the host clock with the device synchronized around each call).

        The hooks are registered once per module and stay: each run points them at its own Metrics and `detach`
        points them at nothing. Registering fresh hooks every run changed the modules' hook dicts, which a
        compiled branch that calls the module guards on: every API call and sweep job recompiled it, and
        after 8 Dynamo ran it eager. The hooks do nothing while Dynamo traces them (a clock read would break
        the graph, and a compiled branch never calls them again), nor inside a branch `model_branch` times."""
        from specpipe.devices.base import HostClock

        self._clock = clock if hasattr(clock, "begin") else HostClock(clock)
        self.timed = True
        # the logits come from a separate call (`model.logits(hidden)`), outside forward: the vocabulary
        # projection, the largest GEMM of a real model, is model time too (an EAGLE head may share the target's)
        heads = [getattr(m, "lm_head", None) for m in modules if m is not None]
        for mod in [*modules, *heads]:
            if mod is None or any(h is _timer_pre for h in mod._forward_pre_hooks.values()):
                continue  # hooked by an earlier run (shallow copies share hook dicts)
            mod.register_forward_pre_hook(_timer_pre)
            mod.register_forward_hook(_timer_post, always_call=True)
        _TIMED[0] = self

    def _forward_begins(self) -> None:
        if self._depth[0] == 0:
            self._depth[1] = self._clock.begin()
        self._depth[0] += 1

    def _forward_ends(self) -> None:
        if self._depth[0] == 0:
            return
        self._depth[0] -= 1
        if self._depth[0] == 0:  # a call inside a timed one (an lm_head inside a forward) is counted once
            self._clock.end(self._depth[1], self.current, self.model_s)

    def model_branch(self, fn):
        """`fn` (a compiled or captured branch that runs a model forward) timed as model time, as a whole
        (while the model timer is attached: untimed runs add no device syncs)."""
        def timed(*args, **kwargs):
            if not self.timed:
                return fn(*args, **kwargs)
            t = self._clock.begin()
            self._outer += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._outer -= 1
                self._clock.end(t, self.current, self.model_s)
        timed.__wrapped__ = fn
        return timed

    def detach(self) -> None:
        """The models' timer hooks stop timing into this run (they stay registered, doing nothing)."""
        if _TIMED[0] is self:
            _TIMED[0] = None

    def record_round(self, counts: list[int], ranks: list[list[int]], linked: list[int]) -> None:
        self.accepted.extend(counts)
        self.linked.extend(linked)
        for c, r in zip(counts, ranks):
            self.ranks.extend(r[:c])

    def _acceptance(self) -> dict:
        acc = np.asarray(self.accepted, dtype=np.int64)
        S = self.num_steps
        if not len(acc):  # nothing drafted (draft=none, or no round ran): no rate to give, not a rate of 0
            return {"accept_length_mean": None, "mean_acceptance_length": None, "accept_length_histogram": [],
                    "acceptance_rate_per_position": [None] * S, "acceptance_rate_by_depth": [None] * S,
                    "acceptance_by_rank": [], "draft_acceptance_rate": None, "tree_budget_use": None,
                    "num_drafts": 0, "num_rounds": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                    "num_accepted_tokens_per_pos": [0] * S}
        n = len(acc)
        drafted = int(np.count_nonzero(np.asarray(self.linked)))  # vLLM counts a draft only when one was proposed
        reached = [int((acc >= d).sum()) for d in range(0, S + 1)]
        # depth 1 is conditioned on a round having drafted at all (an n-gram miss has no depth 1 to lose), deeper
        # ones on the parent depth accepted
        parents = [drafted, *reached[1:S]]
        # a trie drafter (ngram, suffix) may give a node more than topk children: ranks past topk are kept
        ranks = np.bincount(np.asarray(self.ranks, dtype=np.int64), minlength=self.topk)
        return {
            "accept_length_mean": float(acc.mean() + 1),
            "mean_acceptance_length": float(acc.sum() / drafted + 1) if drafted else None,  # vLLM's
            "accept_length_histogram": np.bincount(acc + 1, minlength=S + 2)[1:].tolist(),  # i: rounds committing i+1
            "acceptance_rate_per_position": [reached[d] / n for d in range(1, S + 1)],
            # P(depth d | depth d-1): null (no data) where no round reached depth d-1, not a rate of 0
            "acceptance_rate_by_depth": [reached[d] / parents[d - 1] if parents[d - 1] else None
                                         for d in range(1, S + 1)],
            "acceptance_by_rank": (ranks / ranks.sum()).tolist() if ranks.sum() else [],  # nothing accepted: no shares
            "draft_acceptance_rate": float(acc.sum() / sum(self.linked)) if sum(self.linked) else None,
            "tree_budget_use": float(np.mean(self.linked) / max(1, self.num_draft_tokens - 1)),
            "num_drafts": drafted,
            "num_rounds": n,
            "num_draft_tokens": int(sum(self.linked)),
            "num_accepted_tokens": int(acc.sum()),
            "num_accepted_tokens_per_pos": reached[1:],
        }

    def summary(self, wall_s: float, recompiles: int) -> dict:
        if self._clock is not None:
            self._clock.settle(self.model_s)  # (CUDA events: read now, with one sync)
        steps = max(1, self.num_verify_steps)
        stage_ms = {k: 1000 * v / steps for k, v in sorted(self.stage_s.items())}
        model_ms = {k: 1000 * self.model_s.get(k, 0.0) / steps for k in stage_ms}
        total, model = sum(self.stage_s.values()), sum(self.model_s.values())
        def pct(q):
            return float(np.percentile(self.step_s, q) * 1000) if self.step_s else None
        return {
            "generated_tokens": self.generated_tokens,
            "wall_s": wall_s,
            "tokens_per_s": self.generated_tokens / wall_s if wall_s > 0 else 0.0,
            **self._acceptance(),
            "num_verify_steps": self.num_verify_steps,
            "stage_ms": stage_ms,
            # null when model timing was off (model_timing=false): no device-synchronized forwards to time
            "stage_model_ms": model_ms if self.timed else None,
            "stage_host_ms": {k: max(0.0, stage_ms[k] - model_ms[k]) for k in stage_ms} if self.timed else None,
            "model_share": model / total if total > 0 and self.timed else None,
            "time_to_first_token_s_mean": float(np.mean(self.first_token_s)) if self.first_token_s else None,
            "step_latency_ms_p50": pct(50),
            "step_latency_ms_p90": pct(90),
            "step_latency_ms_p99": pct(99),
            "plain_steps": {b: len(s) for b, s in sorted(self.plain_step_s.items())},
            "plain_step_ms_p50": {b: float(np.median(s) * 1000) for b, s in sorted(self.plain_step_s.items())},
            "retractions": self.retractions,
            "recompiles": recompiles,
        }
