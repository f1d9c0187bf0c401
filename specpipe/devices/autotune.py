"""`auto`: time eager against compiled (and graph) on the run's own inputs, then keep the fastest.

Which policy wins depends on device and size (on a 2-core CPU eager beats every compiled draft
top-k at H=256, while at H=4096, b=64 compiled is ~9x faster), so `auto` measures instead of guessing.

Warm-up is the first `trials` calls of the branch. On each, AutoBranch
1. runs eager and returns its result, so warm-up output is eager output;
2. runs every other candidate once, untimed (this call compiles or captures), and drops a
   candidate whose output differs from eager's (integers and bools exactly, floats within
   torch.testing's default tolerance) or that raises;
3. times the survivors on the same inputs, interleaved over several rounds, median per call.
After the last trial it keeps the candidate with the lowest mean time; a non-eager one must beat
eager by more than `margin` (noise on a busy machine), so ties go to the simpler eager path.
The decision, with every timing, is in `.decision`; `collect_decisions(pipe)` gathers them.
Running a branch several times on one input relies on branches being pure (house style 8.4);
idempotent writes, such as a forward storing K/V into the same slots, are fine.
"""
from __future__ import annotations

import logging
import statistics
import time
from typing import Any, Callable, Optional

import torch

log = logging.getLogger(__name__)


def same_outputs(out: Any, ref: Any) -> Optional[str]:
    """None when `out` matches `ref`, else what differs (first difference only)."""
    from specpipe.devices.graphs import split_tensors

    a: list = []
    b: list = []
    if split_tensors(out, a) != split_tensors(ref, b):
        return "outputs have a different structure than eager's"
    for i, (x, y) in enumerate(zip(a, b)):
        if x.shape != y.shape or x.dtype != y.dtype:
            return f"output {i} is {x.dtype}{list(x.shape)}, eager gives {y.dtype}{list(y.shape)}"
        if x.is_floating_point() or x.is_complex():
            try:
                torch.testing.assert_close(x, y, equal_nan=True)
            except AssertionError:
                return f"output {i} differs from eager beyond float tolerance"
        elif not torch.equal(x, y):
            return f"output {i} differs from eager"
    return None


class AutoBranch:
    """A branch under `auto`: measures while warming up, then calls the chosen candidate directly."""

    def __init__(self, name: str, candidates: dict[str, Callable], synchronize: Optional[Callable] = None,
                 trials: int = 3, rounds: int = 5, round_s: float = 2e-4, max_reps: int = 64,
                 margin: float = 0.05, clock: Callable[[], float] = time.perf_counter):
        assert "eager" in candidates, "eager is the reference every candidate is checked against"
        self.name = name
        self.candidates = dict(candidates)
        self.sync = synchronize or (lambda: None)
        self.trials, self.rounds, self.round_s, self.max_reps = trials, rounds, round_s, max_reps
        self.margin, self.clock = margin, clock
        self.per_trial: dict[str, list[float]] = {c: [] for c in self.candidates}  # median s per call, per trial
        self.decision: dict[str, Any] = {
            "branch": name, "status": "not called", "choice": None, "candidates": list(self.candidates),
            "timings_us": {}, "first_call_s": {}, "rejected": {}, "trials": 0, "margin": margin}
        self._call = self._trial

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def _time(self, fn: Callable, args, kwargs, reps: int) -> float:
        self.sync()
        t0 = self.clock()
        for _ in range(reps):
            fn(*args, **kwargs)
        self.sync()
        return (self.clock() - t0) / reps

    def _trial(self, *args, **kwargs):
        d = self.decision
        d["status"] = "measuring"
        eager = self.candidates["eager"]
        ref = eager(*args, **kwargs)
        t_eager = self._time(eager, args, kwargs, 1)  # also calibrates the repetitions below
        for name, fn in list(self.candidates.items()):
            if name == "eager":
                continue
            t0 = self.clock()
            try:
                out = fn(*args, **kwargs)
                self.sync()
                problem = same_outputs(out, ref)
            except Exception as e:  # a compile or capture failure only disqualifies the candidate
                problem = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            d["first_call_s"][name] = d["first_call_s"].get(name, 0.0) + self.clock() - t0
            if problem:
                d["rejected"][name] = problem
                del self.candidates[name]
        reps = max(1, min(self.max_reps, int(self.round_s / max(t_eager, 1e-7))))
        samples: dict[str, list[float]] = {c: [] for c in self.candidates}
        order = list(self.candidates)
        for r in range(self.rounds):
            for name in order[r % len(order):] + order[: r % len(order)]:  # rotate: no fixed first slot
                samples[name].append(self._time(self.candidates[name], args, kwargs, reps))
        for name, s in samples.items():
            self.per_trial[name].append(statistics.median(s))
        d["trials"] += 1
        if d["trials"] >= self.trials:
            self._decide()
        return ref

    def _decide(self) -> None:
        d = self.decision
        mean = {c: statistics.fmean(self.per_trial[c]) for c in self.candidates}
        d["timings_us"] = {c: round(1e6 * statistics.fmean(v), 3) for c, v in self.per_trial.items() if v}
        best = min(mean, key=mean.get)
        if best != "eager" and mean[best] > (1 - self.margin) * mean["eager"]:
            best = "eager"
        d["choice"], d["status"] = best, "decided"
        self.candidates = {best: self.candidates[best]}  # release the losers (graphs, compiled code)
        self._call = self.candidates[best]
        log.info("auto %s -> %s (%s)", self.name, best,
                 ", ".join(f"{c} {t:.1f} us" for c, t in d["timings_us"].items()))


def collect_decisions(pipe_or_stages: Any) -> dict[str, dict]:
    """Every `auto` branch's decision, keyed `stage.branch`, from a pipeline (its `.stages`) or a list
    of stages. Call after the run, e.g. `summary["autotune"] = collect_decisions(pipe)`; {} when no
    branch used `auto`."""
    stages = getattr(pipe_or_stages, "stages", pipe_or_stages)
    out: dict[str, dict] = {}
    for st in stages or []:
        for value in vars(st).values():
            value = getattr(value, "__wrapped__", value)  # Metrics.model_branch wraps model-running branches
            if isinstance(value, AutoBranch):
                out[value.name] = dict(value.decision)
    return out
