"""Per-request sampling state on the device, and target-only sampling of single tokens.

Every request carries temperature/top_p/top_k and its own seed; coins are counter-based
(`verify_sampling.uniform_coins`), so a request's output depends only on its seed, never on
which other requests share the batch. Temperature 0 is greedy.
"""
from __future__ import annotations

import zlib
from typing import Optional

import torch
from torch import Tensor

from specpipe.stages.verify_sampling import process_logits, sample_tokens, uniform_coins

STREAM_PLAIN = 4  # coins of tokens sampled outside a verify tree (prefill, draft=none); 1-3 are the verifier's


def request_seed(base_seed: int, index: int, explicit=None) -> int:
    """A request's own seed: the prompt file's "seed" if given, else derived from the run seed and index."""
    if explicit is not None:
        return int(explicit) & 0x7FFFFFFFFFFFFFFF
    return zlib.crc32(f"{base_seed}:{index}".encode()) | (base_seed << 32) & 0x7FFFFFFFFFFFFFFF


class SamplingState:
    """temperature/top_p/top_k/seed per running request [B], joined and filtered with the batch."""

    def __init__(self, temperature: float, top_p: float, top_k: int, device, greedy: Optional[bool] = None):
        """Run-level settings; `greedy` (default: temperature <= 0) is False when any request samples, even if
        the run's default is greedy (greedy rows then go through the sampling path as one-hots)."""
        self.params = (float(temperature), float(top_p), int(top_k))
        self.greedy = temperature <= 0 if greedy is None else greedy
        self.dev = device
        self.temperature = torch.zeros(0, device=device)
        self.top_p = torch.zeros(0, device=device)
        self.top_k = torch.zeros(0, dtype=torch.int64, device=device)
        self.seed = torch.zeros(0, dtype=torch.int64, device=device)

    def join(self, seeds: list[int], params: Optional[list] = None) -> None:
        """New requests: their seeds, and their own (temperature, top_p, top_k) where given (None: the run's)."""
        rows = [q if q is not None else self.params for q in (params or [None] * len(seeds))]
        t, p, k = (list(c) for c in zip(*rows)) if rows else ([], [], [])
        self.temperature = torch.cat([self.temperature, torch.tensor(t, dtype=torch.float32, device=self.dev)])
        self.top_p = torch.cat([self.top_p, torch.tensor(p, dtype=torch.float32, device=self.dev)])
        self.top_k = torch.cat([self.top_k, torch.tensor(k, dtype=torch.int64, device=self.dev)])
        self.seed = torch.cat([self.seed, torch.tensor(seeds, dtype=torch.int64, device=self.dev)])

    def keep(self, keep_t: Tensor) -> None:
        self.temperature, self.top_p = self.temperature[keep_t], self.top_p[keep_t]
        self.top_k, self.seed = self.top_k[keep_t], self.seed[keep_t]

    def sample_next(self, logits: Tensor, position: Tensor, rows: Tensor | None = None) -> Tensor:
        """logits [B, V] -> the token at `position` [B] (argmax when greedy). rows: subset of the batch."""
        if self.greedy:
            return logits.argmax(-1)
        sel = (lambda x: x) if rows is None else (lambda x: x[rows])
        probs = process_logits(logits[:, None], sel(self.temperature), sel(self.top_p), sel(self.top_k))[:, 0]
        u = uniform_coins(sel(self.seed), position, 1, STREAM_PLAIN)[:, 0]
        return sample_tokens(probs, u)
