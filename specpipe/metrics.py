"""Run metrics: acceptance (vLLM's conventions: acceptance length counts the bonus token), throughput, stage time."""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import numpy as np


def recompile_count() -> int:
    """Dynamo graph compilations so far in this process (0 when nothing was compiled)."""
    try:
        from torch._dynamo.utils import counters
    except Exception:  # pragma: no cover - dynamo unavailable
        return 0
    return int(counters["stats"]["unique_graphs"])


class Metrics:
    def __init__(self, num_steps: int, topk: int = 1):
        self.num_steps = num_steps
        self.topk = topk
        self.num_verify_steps = 0  # decode rounds of the whole batch
        self.accepted = []  # drafts accepted per (request, verify step)
        self.stage_s: dict[str, float] = defaultdict(float)
        self.generated_tokens = 0
        self.first_token_s: list[float] = []
        self.step_s: list[float] = []
        self.t0 = time.perf_counter()

    @contextmanager
    def stage(self, name: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.stage_s[name] += time.perf_counter() - t

    def record_accepts(self, counts: list[int]) -> None:
        self.accepted.extend(counts)

    def summary(self, wall_s: float, recompiles: int) -> dict:
        acc = np.asarray(self.accepted, dtype=np.int64)
        n = max(1, len(acc))
        per_pos = [float((acc >= d).sum() / n) for d in range(1, self.num_steps + 1)] if len(acc) else \
            [0.0] * self.num_steps
        steps = max(1, self.num_verify_steps)
        hist = np.bincount(acc + 1, minlength=self.num_steps + 2)[1:].tolist() if len(acc) else []
        return {
            "generated_tokens": self.generated_tokens,
            "wall_s": wall_s,
            "tokens_per_s": self.generated_tokens / wall_s if wall_s > 0 else 0.0,
            "accept_length_mean": float(acc.mean() + 1) if len(acc) else None,
            "accept_length_histogram": hist,  # index i: rounds that committed i+1 tokens
            "acceptance_rate_per_position": per_pos,
            "draft_acceptance_rate": float(acc.sum() / (n * self.num_steps)) if len(acc) else None,
            "num_verify_steps": self.num_verify_steps,
            "stage_host_ms": {k: 1000 * v / steps for k, v in sorted(self.stage_s.items())},
            "time_to_first_token_s_mean": float(np.mean(self.first_token_s)) if self.first_token_s else None,
            "step_latency_ms_p50": float(np.percentile(self.step_s, 50) * 1000) if self.step_s else None,
            "step_latency_ms_p90": float(np.percentile(self.step_s, 90) * 1000) if self.step_s else None,
            "recompiles": recompiles,
        }
