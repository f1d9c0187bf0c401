"""The decode loop shared by every drafter: requests, admission, target prefill, stop checks.

`PlainPipeline` (draft=none) is plain greedy decoding through the same KV bookkeeping: the
baseline every benchmark compares against. `spec_pipeline.EaglePipeline` adds drafting.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from specpipe.metrics import Metrics
from specpipe.models.attention_batch import extend_batch
from specpipe.stages.prepare_decode import PrepareDecode


class OutOfKVMemory(RuntimeError):
    pass


def bucket(n: int, q: int = 16) -> int:
    """Round up to a multiple of q so padded widths (and compiled shapes) change rarely."""
    return max(q, -(-int(n) // q) * q)


@dataclass
class Request:
    index: int
    prompt: str
    prompt_ids: list
    max_new_tokens: int
    output_ids: list = field(default_factory=list)
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    t_submit: float = 0.0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Pipeline:
    """Holds the running batch: requests, their table rows and (subclasses) their device state."""

    def __init__(self, target, allocator, device, max_requests: int, max_context: int, eos_token_id,
                 metrics: Metrics):
        self.target = target
        self.device = device
        self.dev = device.torch_device
        self.prep = PrepareDecode(allocator, max_requests, max_context, self.dev)
        self.eos = eos_token_id
        self.metrics = metrics
        self.reqs: list[Request] = []
        self.rows = np.zeros(0, dtype=np.int64)
        self.last_token = torch.zeros(0, dtype=torch.int64, device=self.dev)  # [B]

    # ---- host-side token bookkeeping ---------------------------------------------------
    def append_tokens(self, req: Request, tokens: list) -> int:
        """Append committed tokens until EOS or the token budget; returns how many were kept."""
        kept = 0
        for t in tokens:
            req.output_ids.append(t)
            kept += 1
            if self.eos is not None and t == self.eos:
                req.finish_reason = "stop"
                break
            if len(req.output_ids) >= req.max_new_tokens:
                req.finish_reason = "length"
                break
        self.metrics.generated_tokens += kept
        return kept

    # ---- admission ---------------------------------------------------------------------
    def prefill_target(self, reqs: list[Request]):
        """Target prefill of new requests. Returns (rows, ids, hidden, batch, last, first) or None on OOM."""
        rows = [self.prep.acquire_row() for _ in reqs]
        if any(r is None for r in rows):
            self.prep.release_rows([r for r in rows if r is not None])
            return None
        rows_np = np.asarray(rows, dtype=np.int64)
        lens = np.asarray([len(r.prompt_ids) for r in reqs], dtype=np.int64)
        if not self.prep.reserve(rows_np, lens):
            self.prep.release_rows(rows)
            return None
        T = int(lens.max())
        ids = torch.zeros((len(reqs), T), dtype=torch.int64)
        for b, r in enumerate(reqs):
            ids[b, : len(r.prompt_ids)] = torch.tensor(r.prompt_ids, dtype=torch.int64)
        ids = ids.to(self.dev)
        rows_t = torch.from_numpy(rows_np).to(self.dev)
        lens_t = torch.from_numpy(lens).to(self.dev)
        batch = self.prep.decorate(extend_batch(self.prep.table, rows_t, torch.zeros_like(lens_t), lens_t, T, bucket(T)))
        hidden = self.target(ids, batch)  # [B, T, H]
        last = lens_t - 1
        h_last = hidden[torch.arange(len(reqs), device=self.dev), last]
        first = self.target.logits(h_last).argmax(-1)  # [B]
        self.prep.commit(rows_np, lens)
        self.prep.after_commit(rows_np)
        return rows_np, ids, hidden, batch, last, first

    def admit(self, reqs: list[Request]) -> bool:
        """Prefill and join the running batch; False (nothing changed) when the KV pool is full."""
        with self.metrics.stage("prefill"):
            out = self.prefill_target(reqs)
            if out is None:
                return False
            rows_np, ids, hidden, batch, last, first = out
            firsts = first.tolist()
            now = time.perf_counter()
            for r, t in zip(reqs, firsts):
                self.append_tokens(r, [t])
                self.metrics.first_token_s.append(now - r.t_submit)
            self.join(reqs, rows_np, ids, hidden, batch, last, first)
        self.drop_finished()
        return True

    def join(self, reqs, rows_np, ids, hidden, batch, last, first) -> None:
        self.reqs.extend(reqs)
        self.rows = np.concatenate([self.rows, rows_np])
        self.last_token = torch.cat([self.last_token, first])

    def keep(self, keep_t: Tensor) -> None:
        self.last_token = self.last_token[keep_t]

    def drop_finished(self) -> list[Request]:
        done = [r for r in self.reqs if r.finished]
        if not done:
            return []
        keep = np.asarray([not r.finished for r in self.reqs])
        self.prep.release_rows(self.rows[~keep].tolist())
        self.reqs = [r for r in self.reqs if not r.finished]
        self.rows = self.rows[keep]
        self.keep(torch.from_numpy(np.flatnonzero(keep)).to(self.dev))
        return done


class PlainPipeline(Pipeline):
    """Greedy decoding, one token per request per step (draft=none)."""

    def step(self) -> None:
        B = len(self.reqs)
        with self.metrics.stage("prepare_decode"):
            if not self.prep.reserve(self.rows, np.ones(B, dtype=np.int64)):
                raise OutOfKVMemory("KV pool exhausted during decode")
            L = self.prep.seq_len[self.rows]
            rows_t = torch.from_numpy(self.rows).to(self.dev)
            L_t = torch.from_numpy(L).to(self.dev)
            batch = self.prep.decorate(
                extend_batch(self.prep.table, rows_t, L_t, torch.ones_like(L_t), 1, bucket(L.max() + 1)))
        with self.metrics.stage("verify"):
            hidden = self.target(self.last_token[:, None], batch)
            nxt = self.target.logits(hidden[:, 0]).argmax(-1)  # [B]
        with self.metrics.stage("commit"):
            toks = nxt.tolist()  # the one host sync of the step
            for r, t in zip(self.reqs, toks):
                self.append_tokens(r, [t])
            self.prep.commit(self.rows, L + 1)
            self.prep.after_commit(self.rows)
            self.last_token = nxt
            self.drop_finished()
        self.metrics.num_verify_steps += 1
