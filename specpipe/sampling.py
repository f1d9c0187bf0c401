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
    """temperature/top_p/top_k/repetition_penalty/seed per running request [B], joined and filtered with the batch.

    With a repetition penalty (HF's: a logit of a token already in the prompt or the output is divided by
    the penalty when positive, multiplied when negative, before temperature and top-k/top-p; greedy too),
    `seen` [B, V] marks each request's prompt and committed tokens; `penalize_tree` adds the tokens on each
    tree node's own path, so every node is judged against the context it would have."""

    def __init__(self, temperature: float, top_p: float, top_k: int, device, greedy: Optional[bool] = None,
                 repetition_penalty: float = 1.0, vocab_size: Optional[int] = None, penalized: bool = False):
        """Run-level settings; `greedy` (default: temperature <= 0) is False when any request samples, even if
        the run's default is greedy (greedy rows then go through the sampling path as one-hots). `penalized`:
        some request has a repetition penalty other than 1 (then `vocab_size` sizes `seen`)."""
        self.params = (float(temperature), float(top_p), int(top_k), float(repetition_penalty))
        self.greedy = temperature <= 0 if greedy is None else greedy
        self.dev = device
        self.temperature = torch.zeros(0, device=device)
        self.top_p = torch.zeros(0, device=device)
        self.top_k = torch.zeros(0, dtype=torch.int64, device=device)
        self.seed = torch.zeros(0, dtype=torch.int64, device=device)
        self.penalized = penalized or repetition_penalty != 1.0
        if self.penalized and vocab_size is None:
            raise ValueError("a repetition penalty needs vocab_size")
        self.penalty = torch.zeros(0, dtype=torch.float64, device=device)  # cast to the logits' dtype, as HF does
        self.seen = torch.zeros((0, vocab_size or 0), dtype=torch.bool, device=device)

    def join(self, seeds: list[int], params: Optional[list] = None, contexts: Optional[list] = None) -> None:
        """New requests: their seeds, their own (temperature, top_p, top_k[, repetition_penalty]) where given
        (None: the run's), and with a penalty their context ids (prompt, and any output before a retraction)."""
        rows = [tuple(q) + self.params[len(q):] if q is not None else self.params for q in (params or [None] * len(seeds))]
        t, p, k, r = (list(c) for c in zip(*rows)) if rows else ([], [], [], [])
        self.temperature = torch.cat([self.temperature, torch.tensor(t, dtype=torch.float32, device=self.dev)])
        self.top_p = torch.cat([self.top_p, torch.tensor(p, dtype=torch.float32, device=self.dev)])
        self.top_k = torch.cat([self.top_k, torch.tensor(k, dtype=torch.int64, device=self.dev)])
        self.seed = torch.cat([self.seed, torch.tensor(seeds, dtype=torch.int64, device=self.dev)])
        if self.penalized:
            self.penalty = torch.cat([self.penalty, torch.tensor(r, dtype=torch.float64, device=self.dev)])
            seen = torch.zeros((len(seeds), self.seen.shape[1]), dtype=torch.bool)
            for i, ids in enumerate(contexts or [[]] * len(seeds)):
                seen[i, torch.as_tensor(list(ids), dtype=torch.int64)] = True
            self.seen = torch.cat([self.seen, seen.to(self.dev)])

    def keep(self, keep_t: Tensor) -> None:
        self.temperature, self.top_p = self.temperature[keep_t], self.top_p[keep_t]
        self.top_k, self.seed = self.top_k[keep_t], self.seed[keep_t]
        if self.penalized:
            self.penalty, self.seen = self.penalty[keep_t], self.seen[keep_t]

    def penalize(self, logits: Tensor, seen: Tensor, penalty: Tensor) -> Tensor:
        """logits [B, ..., V], seen [B, ..., V] bool, penalty [B] -> penalized logits (HF's rule)."""
        p = penalty.view(-1, *([1] * (logits.dim() - 1))).to(logits.dtype)
        return torch.where(seen, torch.where(logits > 0, logits / p, logits * p), logits)

    def penalize_tree(self, logits: Tensor, tokens: Tensor, mask: Tensor) -> Tensor:
        """Verify logits [B, N, V] of tree nodes tokens [B, N]; mask [B, N, N]: node j's ancestors and itself."""
        if not self.penalized:
            return logits
        B, N = tokens.shape
        on_path = torch.zeros((B, N, self.seen.shape[1]), dtype=logits.dtype, device=logits.device)
        on_path.scatter_add_(2, tokens[:, None, :].expand(B, N, N), mask.to(logits.dtype))  # [B, j, v]: v on j's path
        return self.penalize(logits, self.seen[:, None, :] | (on_path > 0), self.penalty)

    def note(self, tokens: Tensor, count: Optional[Tensor] = None, rows: Optional[Tensor] = None) -> None:
        """Committed tokens [B, C] (the first count+1 of each row valid; all without count) join `seen`
        (of `rows` only, when given)."""
        if not self.penalized:
            return
        if count is not None:
            col = torch.arange(tokens.shape[1], device=tokens.device)
            tokens = torch.where(col[None, :] <= count[:, None], tokens, tokens[:, :1])
        if rows is None:
            self.seen.scatter_(1, tokens, True)
        else:
            self.seen[rows] = self.seen[rows].scatter(1, tokens, True)

    def sample_next(self, logits: Tensor, position: Tensor, rows: Tensor | None = None) -> Tensor:
        """logits [B, V] -> the token at `position` [B] (argmax when greedy). rows: subset of the batch."""
        sel = (lambda x: x) if rows is None else (lambda x: x[rows])
        if self.penalized:
            logits = self.penalize(logits, sel(self.seen), sel(self.penalty))
        if self.greedy:
            return logits.argmax(-1)
        probs = process_logits(logits[:, None], sel(self.temperature), sel(self.top_p), sel(self.top_k))[:, 0]
        u = uniform_coins(sel(self.seed), position, 1, STREAM_PLAIN)[:, 0]
        return sample_tokens(probs, u)
