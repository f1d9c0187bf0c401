"""The scheduler: admit waiting requests as rows and KV allow, step the running batch, collect results."""
from __future__ import annotations

import time
from collections import deque

import torch

from specpipe.pipeline import OutOfKVMemory, Pipeline, Request


def run_requests(pipe: Pipeline, requests: list[Request], batch_size: int, progress=None) -> float:
    """Decode every request to completion; returns wall seconds. Requests keep their input order."""
    waiting = deque(r for r in requests if not r.finished)
    t0 = time.perf_counter()
    for r in waiting:
        r.t_submit = t0
    with torch.no_grad():
        while waiting or pipe.reqs:
            room = batch_size - len(pipe.reqs)
            if room > 0 and waiting:
                group = [waiting.popleft() for _ in range(min(room, len(waiting)))]
                if not pipe.admit(group):
                    if not pipe.reqs:
                        raise OutOfKVMemory(
                            f"the KV pool cannot hold even {len(group)} new request(s); "
                            "raise allocator.num_slots or lower workload.batch_size")
                    waiting.extendleft(reversed(group))
            if pipe.reqs:
                ts = time.perf_counter()
                before = pipe.metrics.generated_tokens
                pipe.step()
                pipe.metrics.step_s.append(time.perf_counter() - ts)
                if progress is not None:
                    progress(pipe.metrics.generated_tokens - before, sum(r.finished for r in requests))
    return time.perf_counter() - t0
