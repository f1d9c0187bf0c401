"""A cross-request corpus for n-gram drafting: the newest finished requests' tokens.

Prompt lookup only sees the request's own context. Served traffic repeats itself across requests
(the same boilerplate, tool calls, code idioms), so SuffixDecoding and vLLM's `suffix` method also
match against earlier responses. Here the corpus is flat: finished texts, oldest first, each ended
by `SEP`, that `NgramDrafter.propose(..., corpus=cache.tokens)` reads as if it came before every
request's history. Whole texts are dropped, oldest first, to stay within `capacity` tokens, so the
per-step matching cost (a scan, linear in batch x capacity) stays bounded.

Outputs do not depend on the cache (verification is lossless); only the acceptance length does.
"""
from __future__ import annotations

from collections import deque
from typing import Sequence

import numpy as np
import torch

from specpipe.drafters.ngram_trie import SEP


class SuffixCache:
    def __init__(self, capacity: int, device=None):
        if capacity < 0:
            raise ValueError(f"cache capacity must be >= 0 tokens, got {capacity}")
        self.capacity = capacity
        self.device = device
        self.host_tokens = np.empty(0, dtype=np.int32)  # [Lc] texts, each followed by SEP (the numpy drafter's)
        self.tokens = torch.from_numpy(self.host_tokens).to(device)  # the same on the device (the same memory on a CPU)
        self._lengths: deque[int] = deque()  # per text, its separator included, oldest first
        self.texts_added = 0

    def __len__(self) -> int:
        return int(self.tokens.numel())

    def add(self, ids: Sequence[int]) -> None:
        """Append one finished text (its newest capacity-1 tokens); drop the oldest texts to fit."""
        keep = self.capacity - 1
        if keep < 1 or not len(ids):
            return
        text = list(ids)[-keep:]
        self.host_tokens = np.concatenate([self.host_tokens, np.asarray(text + [SEP], dtype=np.int32)])
        self._lengths.append(len(text) + 1)
        drop = 0
        while self.host_tokens.size - drop > self.capacity:
            drop += self._lengths.popleft()
        if drop:
            self.host_tokens = self.host_tokens[drop:].copy()  # copy: let the dropped prefix's memory go
        self.tokens = torch.from_numpy(self.host_tokens).to(self.device)  # (an upload per finished request elsewhere)
        self.texts_added += 1
