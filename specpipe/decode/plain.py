"""Target-only decoding (draft=none): one token per request per step, through the same KV bookkeeping as
the speculative pipelines, so it is the baseline every benchmark compares against."""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from specpipe.decode.metrics import Metrics
from specpipe.decode.pipeline import Pipeline
from specpipe.decode.request import Request
from specpipe.decode.sampling import SamplingState
from specpipe.grammar.tree import apply
from specpipe.models.attention_batch import extend_batch
from specpipe.stages.finite import finite_rows
from specpipe.stages.padding import bucket
from specpipe.stages.prepare_decode import OutOfKVMemory
from specpipe.stages.verify import PlainForward


class PlainPipeline(Pipeline):
    """Target-only decoding, one token per request per step (draft=none): the baseline."""

    def __init__(self, target, allocator, device, max_requests: int, max_context: int, eos_token_id,
                 metrics: Metrics, sampling: Optional[SamplingState] = None, wrap=None):
        super().__init__(target, allocator, device, max_requests, max_context, eos_token_id, metrics, sampling)
        self.forward = PlainForward(target)
        self.stages = [self.forward, self.prefill]
        if wrap is not None:  # compile.verify.target_forward's and compile.prefill.target_forward's policies
            for st in self.stages:
                st.bind(wrap)

    def step(self) -> list[Request]:
        """One token per request; returns requests retracted for lack of KV (to re-queue)."""
        retracted = self.make_room()
        if not self.reqs:
            return retracted
        B = len(self.reqs)
        self.metrics.step_plain = True
        with self.metrics.stage("prepare_decode"):
            if not self.prep.reserve(self.rows, np.ones(B, dtype=np.int64)):
                raise OutOfKVMemory("KV pool exhausted during decode")
            L = self.prep.seq_len[self.rows]
            rows_t = torch.from_numpy(self.rows).to(self.dev)
            L_t = torch.from_numpy(L).to(self.dev)
            if self.sampling.penalized:  # contexts hold the cached tokens and the newest one
                self.sampling.limit(int(L.max()) + 1)
            batch = self.prep.decorate(
                extend_batch(self.prep.table, rows_t, L_t, torch.ones_like(L_t), 1, bucket(L.max() + 1)))
        allowed = None
        if self.grammar is not None:
            with self.metrics.stage("grammar"):
                allowed = self.allowed_next(self.reqs)  # [B, V]: what each request's grammar allows next
        with self.metrics.stage("verify"):
            logits = self.forward.target_forward(self.last_token[:, None], batch)
            raw = self.raw_logits(logits)
            nxt = self.sampling.sample_next(apply(logits, allowed), L_t + 1)  # [B]
            self.sampling.note(nxt[:, None])
        with self.metrics.stage("commit"):
            finite = finite_rows(logits)
            host, lps = self.read_back(torch.stack([nxt, finite.to(nxt.dtype)], 1),  # the one host sync of the step
                                       self.token_logprobs(raw, nxt[:, None]))
            for i, (r, (t, ok)) in enumerate(zip(self.reqs, host)):
                if ok:
                    self.append_checked(r, [t], None if lps is None else lps[i])
                else:
                    self.fail(r, "the target's logits contained NaN or inf")
            self.prep.commit(self.rows, L + 1)
            self.prep.after_commit(self.rows)
            self.last_token = nxt
            self.drop_finished()
        self.metrics.num_verify_steps += 1
        return retracted
