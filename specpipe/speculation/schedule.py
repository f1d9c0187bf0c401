"""speculation=schedule: most draft tokens per request by batch size and by context length (0: off), the
schedules vLLM and TensorRT-LLM offer. Within a request's budget the most probable nodes go first."""
from __future__ import annotations

import numpy as np

from specpipe.speculation.base import Policy


def lookup(steps, values: np.ndarray) -> np.ndarray:
    """The draft tokens of the last [from, tokens] row whose `from` each value reaches (before the first: the
    first row's)."""
    starts = np.asarray([a for a, _ in steps], dtype=np.int64)
    tokens = np.asarray([b for _, b in steps], dtype=np.int64)
    return tokens[np.maximum(np.searchsorted(starts, values, side="right") - 1, 0)]


class SchedulePolicy(Policy):
    def __init__(self, s, num_draft_tokens: int, num_steps: int):
        super().__init__(s, num_draft_tokens, num_steps)
        self.batch_steps = [tuple(map(int, r)) for r in s.by_batch]
        self.context_steps = [tuple(map(int, r)) for r in s.by_context]

    def batch_limit(self, B: int, L: np.ndarray) -> np.ndarray:
        by_batch = lookup(self.batch_steps, np.asarray([B]))[0]
        return np.minimum(np.minimum(lookup(self.context_steps, L + 1), by_batch), self.N - 1)
