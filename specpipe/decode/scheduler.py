"""The scheduler: admit waiting requests as rows and KV allow, step the running batch, re-queue retractions."""
from __future__ import annotations

import sys
import time
from collections import deque
from typing import Callable, Optional

import torch

from specpipe.decode.pipeline import Pipeline
from specpipe.decode.request import Request

PROGRESS_AFTER_S = 2.0  # show a progress bar only for runs longer than this


class Progress:
    """A rich progress bar over generated tokens, shown once a run has lasted a couple of seconds."""

    def __init__(self, total_tokens: int, enabled: bool):
        self.total, self.enabled = total_tokens, enabled
        self.t0 = time.perf_counter()
        self.bar = self.task = None

    def update(self, tokens: int, done: int, total_reqs: int) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            if time.perf_counter() - self.t0 < PROGRESS_AFTER_S:
                return
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeRemainingColumn

            self.bar = Bar(TextColumn("decoding"), BarColumn(), MofNCompleteColumn(), TextColumn("tokens"),
                           TextColumn("{task.fields[reqs]}"), TimeRemainingColumn(), transient=True)
            self.bar.start()
            self.task = self.bar.add_task("decode", total=self.total, reqs="")
        self.bar.update(self.task, completed=tokens, reqs=f"{done}/{total_reqs} requests")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def run_requests(pipe: Pipeline, requests: list[Request], batch_size: int, show_progress: Optional[bool] = None,
                 on_finish: Optional[Callable[[list[Request]], None]] = None,
                 on_step: Optional[Callable[[list[Request]], None]] = None) -> float:
    """Decode every request to completion; returns wall seconds. Requests keep their input order.
    `on_finish` gets the requests that finished, as they finish (to save them before the run ends);
    `on_step`, after every step, the running requests and those that just finished (for streaming)."""
    waiting = deque(r for r in requests if not r.finished)
    t0 = time.perf_counter()
    for r in waiting:
        r.t_submit = t0
    if show_progress is None:
        show_progress = sys.stderr.isatty()
    progress = Progress(sum(r.max_new_tokens for r in waiting), show_progress)
    done = len(requests) - len(waiting)  # failed before the run (bad prompts); counted as they finish after
    try:
        with torch.no_grad():
            while waiting or pipe.reqs:
                room = batch_size - len(pipe.reqs)
                if room > 0 and waiting:
                    group = [waiting.popleft() for _ in range(min(room, len(waiting)))]
                    admitted = admit_some(pipe, group)
                    waiting.extendleft(reversed(group[admitted:]))
                if pipe.reqs:
                    pipe.waiting = len(waiting)
                    running, pipe.metrics.step_plain = len(pipe.reqs), None
                    ts = time.perf_counter()
                    retracted = pipe.step()
                    waiting.extendleft(reversed(retracted))
                    pipe.metrics.step_s.append(time.perf_counter() - ts)
                    if pipe.metrics.step_plain:
                        pipe.metrics.plain_step_s[running].append(pipe.metrics.step_s[-1])
                if on_step is not None:
                    on_step(pipe.reqs + pipe.finished_log)
                if pipe.finished_log:
                    done += len(pipe.finished_log)
                    if on_finish is not None:
                        on_finish(pipe.finished_log)
                    pipe.finished_log = []
                progress.update(pipe.metrics.generated_tokens, done, len(requests))
    finally:
        progress.close()
    return time.perf_counter() - t0


def admit_some(pipe: Pipeline, group: list[Request]) -> int:
    """Admit the longest prefix of `group` that fits; a request that cannot fit even alone fails."""
    n = pipe.fitting_prefix(group)
    while n > 0 and not pipe.admit(group[:n]):
        n -= 1
    if n == 0 and not pipe.reqs:
        pipe.fail_too_big(group[0])
        pipe.finished_log.append(group[0])
        return 1
    return n
