"""Per-request sampling state on the device, and target-only sampling of single tokens.

Every request carries temperature/top_p/top_k/min_p and its own seed; coins are counter-based
(`verify_sampling.uniform_coins`), so a request's output depends only on its seed, never on
which other requests share the batch. Temperature 0 is greedy.
"""
from __future__ import annotations

import zlib
from typing import Optional

import torch
from torch import Tensor

from specpipe.stages.verify_sampling import (GREEDY_TEMPERATURE, STREAM_PLAIN, Filters, process_logits,
                                             sample_tokens, uniform_coins)



def request_seed(base_seed: int, index: int, explicit=None) -> int:
    """A request's own seed: the prompt file's "seed" if given, else derived from the run seed and index."""
    if explicit is not None:
        return int(explicit) & 0x7FFFFFFFFFFFFFFF
    return zlib.crc32(f"{base_seed}:{index}".encode()) | (base_seed << 32) & 0x7FFFFFFFFFFFFFFF


class SamplingState:
    """temperature/top_p/top_k/repetition_penalty/min_p/seed per running request [B], joined and filtered with the
    batch.

    With a repetition penalty (HF's: a logit of a token already in the prompt or the output is divided by
    the penalty when positive, multiplied when negative, before temperature and top-k/top-p; greedy too),
    `context` [B, C] holds each request's prompt and committed ids (padded with its first id, which is
    penalized anyway), so penalizing gathers and scatters C logits per row instead of passing over the
    vocabulary; `penalize_tree` adds the tokens on each tree node's own path."""

    def __init__(self, temperature: float, top_p: float, top_k: int, device, greedy: Optional[bool] = None,
                 repetition_penalty: float = 1.0, max_context: Optional[int] = None, penalized: bool = False,
                 min_p: float = 0.0):
        """Run-level settings; `greedy` (default: temperature < GREEDY_TEMPERATURE) is False when any request samples,
        even if the run's default is greedy (greedy rows then go through the sampling path as one-hots). `penalized`:
        some request has a repetition penalty other than 1; `max_context` (prompt plus output, most tokens a
        request holds) then sizes `context`."""
        self.params = (float(temperature), float(top_p), int(top_k), float(repetition_penalty), float(min_p))
        self.greedy = temperature < GREEDY_TEMPERATURE if greedy is None else greedy
        self.dev = device
        self.temperature = torch.zeros(0, device=device)
        self.top_p = torch.zeros(0, device=device)
        self.top_k = torch.zeros(0, dtype=torch.int64, device=device)
        self.min_p = torch.zeros(0, device=device)
        self.seed = torch.zeros(0, dtype=torch.int64, device=device)
        # the filters some request that joined uses (never narrowed when one leaves: a row that does not
        # filter gets the same probabilities either way, so this only decides which passes run)
        self.filters = Filters(greedy=False)
        self.penalized = penalized or repetition_penalty != 1.0
        if self.penalized and max_context is None:
            raise ValueError("a repetition penalty needs max_context")
        self.penalty = torch.zeros(0, dtype=torch.float64, device=device)  # cast to the penalized logits' dtype
        self.context = torch.zeros((0, max_context or 0), dtype=torch.int64, device=device)
        self.width: Optional[int] = None  # columns of `context` in use (`limit`); None: all
        self.context_len = torch.zeros(0, dtype=torch.int64, device=device)

    def join(self, seeds: list[int], params: Optional[list] = None, contexts: Optional[list] = None) -> None:
        """New requests: their seeds, their own (temperature, top_p, top_k[, repetition_penalty[, min_p]]) where
        given (None: the run's), and with a penalty their context ids (prompt, and any output before a retraction)."""
        rows = [tuple(q) + self.params[len(q):] if q is not None else self.params
                for q in (params or [None] * len(seeds))]
        t, p, k, r, m = (list(c) for c in zip(*rows)) if rows else ([], [], [], [], [])
        t = [0.0 if v < GREEDY_TEMPERATURE else v for v in t]  # decided here: float32 rounds 9.9999999e-6 to 1e-5
        for row in zip(t, p, k, m):
            self.filters = self.filters.add(*row)
        self.temperature = torch.cat([self.temperature, torch.tensor(t, dtype=torch.float32, device=self.dev)])
        self.top_p = torch.cat([self.top_p, torch.tensor(p, dtype=torch.float32, device=self.dev)])
        self.top_k = torch.cat([self.top_k, torch.tensor(k, dtype=torch.int64, device=self.dev)])
        self.min_p = torch.cat([self.min_p, torch.tensor(m, dtype=torch.float32, device=self.dev)])
        self.seed = torch.cat([self.seed, torch.tensor(seeds, dtype=torch.int64, device=self.dev)])
        if self.penalized:
            C = self.context.shape[1]
            ctx = torch.zeros((len(seeds), C), dtype=torch.int64)
            lens = []
            if contexts is None or len(contexts) != len(seeds):
                raise ValueError("a repetition penalty needs every new request's context ids")
            for i, ids in enumerate(contexts):
                ids = list(ids)
                if not 1 <= len(ids) <= C:  # never empty: an empty prompt fails before it is admitted
                    raise ValueError(f"a context of {len(ids)} tokens (valid: 1 to max_context={C})")
                ctx[i] = ids[0]
                ctx[i, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
                lens.append(len(ids))
            self.penalty = torch.cat([self.penalty, torch.tensor(r, dtype=torch.float64, device=self.dev)])
            self.context = torch.cat([self.context, ctx.to(self.dev)])
            self.context_len = torch.cat([self.context_len, torch.tensor(lens, dtype=torch.int64, device=self.dev)])

    def keep(self, keep_t: Tensor) -> None:
        self.temperature, self.top_p = self.temperature[keep_t], self.top_p[keep_t]
        self.top_k, self.seed, self.min_p = self.top_k[keep_t], self.seed[keep_t], self.min_p[keep_t]
        if self.penalized:
            self.penalty, self.context = self.penalty[keep_t], self.context[keep_t]
            self.context_len = self.context_len[keep_t]

    def limit(self, longest: int) -> None:
        """Every context now holds at most `longest` tokens (the pipeline knows it on the host): penalizing reads
        only those columns, so a short batch does not pay for the workload's longest request."""
        self.width = max(1, min(int(longest), self.context.shape[1]))

    @staticmethod
    def _penalized_at(logits: Tensor, idx: Tensor, penalty: Tensor) -> Tensor:
        """logits [B, ..., V] with the entries idx [B, ..., K] penalized (HF's rule; repeated ids agree), in
        place: the step's fresh logits, so no copy of [B, ..., V] is made. Below float32 (bf16, fp16) they are
        penalized as a float32 copy, as HF generate casts the step's logits to float32 before its processors:
        bf16's 8-bit mantissa rounds `x / 1.1` to another value, and can reorder the top tokens."""
        if logits.dtype.itemsize < 4 and logits.is_floating_point():
            logits = logits.float()
        orig = logits.gather(-1, idx)
        f = torch.finfo(logits.dtype)  # an extreme penalty saturates instead of making inf (or 0 * inf: NaN)
        p = penalty.view(-1, *([1] * (logits.dim() - 1))).to(logits.dtype).clamp(min=f.tiny, max=f.max)
        new = torch.where(orig > 0, orig / p, orig * p).clamp(min=f.min, max=f.max)
        return logits.scatter_(-1, idx, torch.where(orig.isinf(), orig, new))  # -inf stays -inf, as in HF

    def penalize_tree(self, logits: Tensor, tokens: Tensor, mask: Tensor) -> Tensor:
        """Verify logits [B, N, V] (changed in place) of tree nodes tokens [B, N]; mask [B, N, N]: node j's
        ancestors and itself. Node j's context is the request's plus the tokens on its path (other nodes'
        slots hold padding)."""
        if not self.penalized:
            return logits
        B, N = tokens.shape
        context = self.context[:, :self.width]
        path = torch.where(mask, tokens[:, None, :], context[:, :1, None])  # [B, j, i]
        idx = torch.cat([context[:, None, :].expand(B, N, -1), path], -1)  # [B, N, C + N]
        return self._penalized_at(logits, idx, self.penalty)

    def note(self, tokens: Tensor, count: Optional[Tensor] = None, rows: Optional[Tensor] = None) -> None:
        """Committed tokens [B, K] (the first count+1 of each row valid; all without count) join the context
        (of `rows` only, when given)."""
        if not self.penalized:
            return
        K = tokens.shape[1]
        col = torch.arange(K, device=tokens.device)
        n = torch.full((tokens.shape[0],), K, dtype=torch.int64, device=tokens.device) if count is None else count + 1
        ctx = self.context if rows is None else self.context[rows]
        lens = self.context_len if rows is None else self.context_len[rows]
        pos = (lens[:, None] + col).clamp(max=ctx.shape[1] - 1)
        values = torch.where(col < n[:, None], tokens, ctx[:, :1])
        if rows is None:  # in place: no [B, max_context] copy per step
            self.context.scatter_(1, pos, values)
            self.context_len = lens + n
        else:
            ctx = ctx.scatter(1, pos, values)
            self.context[rows], self.context_len[rows] = ctx, lens + n

    def sample_next(self, logits: Tensor, position: Tensor, rows: Tensor | None = None) -> Tensor:
        """logits [B, V] -> the token at `position` [B] (argmax when greedy). rows: subset of the batch."""
        sel = (lambda x: x) if rows is None else (lambda x: x[rows])
        if self.penalized:
            logits = self._penalized_at(logits, sel(self.context[:, :self.width]), sel(self.penalty))
        if self.greedy:
            return logits.argmax(-1)
        probs = process_logits(logits[:, None], sel(self.temperature), sel(self.top_p), sel(self.top_k),
                               sel(self.min_p), self.filters)[:, 0]
        u = uniform_coins(sel(self.seed), position, 1, STREAM_PLAIN)[:, 0]
        return sample_tokens(probs, u)
