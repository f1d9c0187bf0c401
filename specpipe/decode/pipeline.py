"""The decode loop's state shared by every drafter: the running batch, KV capacity (admission, retraction),
the target prefill (padded, packed or in chunks) and the host-side token bookkeeping.

`plain.PlainPipeline` (draft=none) is plain greedy decoding through the same KV bookkeeping: the baseline
every benchmark compares against. `speculative.EaglePipeline` adds drafting.
"""
from __future__ import annotations

import time
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from specpipe.decode.metrics import Metrics
from specpipe.decode.prefill import Prefill
from specpipe.decode.request import Request, stop_set
from specpipe.decode.sampling import SamplingState
from specpipe.grammar.tree import apply
from specpipe.models.attention_batch import AttentionBatch, extend_batch
from specpipe.stages.finite import finite_rows
from specpipe.stages.padding import bucket
from specpipe.stages.prefill import PrefillForward, target_hidden
from specpipe.stages.prepare_decode import PrepareDecode


class Pipeline:
    """Holds the running batch: requests, their table rows and (subclasses) their device state."""

    def __init__(self, target, allocator, device, max_requests: int, max_context: int, eos_token_id,
                 metrics: Metrics, sampling: Optional[SamplingState] = None):
        self.target = target
        self.device = device
        self.dev = device.torch_device
        self.prep = PrepareDecode(allocator, max_requests, max_context, self.dev)
        top_k = getattr(target.config, "sparse_top_k", None)
        if self.prep.hot is not None and top_k:  # hisparse: the hot buffers' size is known from the model
            self.prep.hot.plan(top_k + target.config.sparse_local)
        self.eos = stop_set(eos_token_id)  # every id that ends a request (Llama-3 instruct has several)
        self.metrics = metrics
        self.reqs: list[Request] = []
        self.rows = np.zeros(0, dtype=np.int64)
        self.last_token = torch.zeros(0, dtype=torch.int64, device=self.dev)  # [B]
        self.sampling = sampling or SamplingState(0.0, 1.0, 0, self.dev)
        self.feature_layers = None  # EAGLE-3 drafters read these target layers instead of the final hidden
        self.prefill = PrefillForward(target)  # the padded prefill's forward (bound by the subclasses)
        self.finished_log: list[Request] = []  # finished since the runner last looked (it drains this)
        self.logprobs = False  # workload.logprobs: record each committed token's raw target log-probability
        self.grammar = None  # a grammar.tree.TreeGrammar when some request is constrained (response_format, ...)
        self.waiting = 0  # requests the scheduler holds for a free row (0: the batch drains; speculation=cost)

    # ---- KV capacity --------------------------------------------------------------------
    growth = 1  # tokens a request may add in one step (speculative pipelines: the verify tree)

    def scratch_tokens(self, batch_size):
        """Throw-away KV slots one step borrows (draft KV); handed back before verify. Takes an int or an
        array of batch sizes (admission asks for every prefix at once)."""
        return 0 * batch_size

    def pages(self, tokens) -> np.ndarray:
        ps = self.prep.ps
        return -(-np.asarray(tokens, dtype=np.int64) // ps)

    def step_fits(self, rows: np.ndarray) -> bool:
        """Whether one more step of these rows fits in the free KV (host ints only, no sync)."""
        grow = self.growth_pages(rows)
        scratch = int(self.pages(self.scratch_tokens(len(rows))))
        return max(grow, scratch) * self.prep.ps <= self.prep.available()

    def growth_pages(self, rows: np.ndarray) -> int:
        """New pages these running rows need for one more step (pages they already own count)."""
        seq, owned = self.prep.seq_len[rows], self.prep.alloc_len[rows]
        return int((self.pages(np.maximum(owned, seq + self.growth)) - self.pages(owned)).sum())

    def make_room(self) -> list[Request]:
        """Retract the most recently admitted requests until one step of the rest fits."""
        out = []
        while self.reqs and not self.step_fits(self.rows):
            r = self.reqs[-1]
            if len(self.reqs) == 1:
                self.fail_too_big(r)
                self.drop_finished()
                break
            r.retractions += 1
            self.metrics.retractions += 1
            out.append(r)
            keep = np.ones(len(self.reqs), dtype=bool)
            keep[-1] = False
            self.prep.release_rows([int(self.rows[-1])])
            self.reqs = self.reqs[:-1]
            self.rows = self.rows[:-1]
            self.keep(torch.from_numpy(np.flatnonzero(keep)).to(self.dev))
        return out

    def fitting_prefix(self, reqs: list[Request]) -> int:
        """How many of `reqs`, in order, can be admitted now with room for the next step: their prefill
        stays while the step needs room for every request's growth or the drafts' scratch, whichever is
        larger (the scratch is handed back before verify). One pass: the need only grows with the count."""
        if not reqs:
            return 0
        lens = np.asarray([len(r.prompt_ids) + len(r.output_ids) - r.resumed for r in reqs], dtype=np.int64)
        prefill = self.pages(lens)
        grow = self.growth_pages(self.rows) + np.cumsum(self.pages(lens + self.growth) - prefill)
        scratch = self.pages(self.scratch_tokens(len(self.reqs) + np.arange(1, len(reqs) + 1)))
        room = np.maximum(grow, scratch)
        need = (np.cumsum(prefill) + room) * self.prep.ps
        if self.prep.window is None:
            return int(np.searchsorted(need, self.prep.available(), side="right"))
        # SWA: the full pool holds every prefill token; the window pool, a prefill run a page at a time at worst
        fits = int(np.searchsorted(need, self.prep.alloc.full_available(), side="right"))
        window = (np.cumsum(self.prep.window_prefill_pages(lens, self.prep.ps)[0]) + room) * self.prep.ps
        return min(fits, int(np.searchsorted(window, self.prep.alloc.swa_available(), side="right")))

    def admit_fits(self, reqs: list[Request]) -> bool:
        return self.fitting_prefix(reqs) == len(reqs)

    def fail(self, req: Request, message: str) -> None:
        req.finish_reason, req.error = "error", message

    def fail_too_big(self, req: Request) -> None:
        """The request cannot fit even alone: it fails (keeping what it generated), the run goes on."""
        ps, alloc = self.prep.ps, self.prep.alloc
        tokens = len(req.prompt_ids) + len(req.output_ids) + self.growth
        scratch = int(self.pages(self.scratch_tokens(1))) * ps
        also = f" plus {scratch} slots of draft scratch" if scratch else ""
        at = f" (after {len(req.output_ids)} generated tokens, which are kept)" if req.output_ids else ""
        full = self.pages(len(req.prompt_ids) + req.max_new_tokens + self.growth) * ps + scratch
        if self.prep.window is None:
            self.fail(req, f"the KV pool ({alloc.size} slots) cannot hold this request's {tokens} tokens{also}{at}; "
                           f"raise allocator.num_slots to at least {full} for it "
                           f"to finish")
            return
        # SWA: name each pool that is short for this request alone, with what it needs to finish
        longest = np.asarray([len(req.prompt_ids) + req.max_new_tokens + self.growth])
        window = (int(self.prep.window_prefill_pages(longest, ps)[1]) + self.pages(self.growth)) * ps + scratch
        pools = [(f"the full pool ({alloc.full.size} slots)", "allocator.num_slots", full, alloc.full.size),
                 (f"the window pool ({alloc.swa.size} slots)", "allocator.swa_num_slots", window, alloc.swa.size)]
        short = [p[:3] for p in pools if p[2] > p[3]] or [p[:3] for p in pools]
        self.fail(req, f"{' and '.join(w for w, _, _ in short)} cannot hold this request's {tokens} tokens{also}{at} "
                       f"(the window pool keeps its last {self.prep.window} tokens, the sliding window, and a prefill "
                       f"runs in chunks); raise {' and '.join(f'{k} to at least {n}' for _, k, n in short)} "
                       "for it to finish")

    # ---- host-side token bookkeeping ---------------------------------------------------
    def append_tokens(self, req: Request, tokens: list, logprobs: Optional[list] = None) -> int:
        """Append committed tokens (and their log-probabilities) until EOS or the token budget; returns how
        many were kept."""
        kept = 0
        for i, t in enumerate(tokens):
            req.output_ids.append(t)
            if logprobs is not None:
                req.logprobs.append(logprobs[i])
            kept += 1
            if t in self.eos or t in req.stop_ids or (req.stop_strings is not None
                                                      and req.stop_strings.hit(req.output_ids)):
                req.finish_reason = "stop"
                break
            if len(req.output_ids) >= req.max_new_tokens:
                req.finish_reason = "length"
                break
        self.metrics.generated_tokens += kept
        return kept

    def append_checked(self, req: Request, tokens: list, logprobs: Optional[list] = None) -> int:
        """`append_tokens` after the request's grammar (if any) takes them: a token it refuses and what follows are
        dropped; the request then stops (its grammar is complete) or fails with the reason (a dead end), its valid
        output kept."""
        n, why = (len(tokens), "") if self.grammar is None else self.grammar.commit(req, tokens)
        if n == len(tokens):
            return self.append_tokens(req, tokens, logprobs)
        kept = self.append_tokens(req, tokens[:n], None if logprobs is None else logprobs[:n])
        if kept == n and not why:  # its grammar is complete: nothing may follow
            req.finish_reason = req.finish_reason or "stop"
        elif kept == n and req.finish_reason in (None, "length"):  # (an EOS or stop string before it ends it well)
            req.finish_reason, req.error = "error", why
        return kept

    def allowed_next(self, reqs: list[Request]):
        """[B, V] bool: what each request's grammar allows next (None: no request is constrained)."""
        return None if self.grammar is None else self.grammar.root_masks(self.grammar.of(reqs))

    def raw_logits(self, logits: Tensor):
        """With workload.logprobs: (logits as the model gave them, their log-sum-exp per row), taken before
        a repetition penalty changes them in place; None otherwise."""
        if not self.logprobs:
            return None
        wide = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
        lse = torch.logsumexp(wide, -1)
        return (logits.clone() if self.sampling.penalized else logits), lse

    @staticmethod
    def token_logprobs(raw, tokens: Tensor, nodes: Optional[Tensor] = None) -> Optional[Tensor]:
        """[B, K] log p(token) under the raw target distribution (vLLM's raw_logprobs), at tree `nodes` [B, K]
        of [B, N, V] logits, or of [B, V] logits for tokens [B, K]; None when off. Stays on the device:
        `read_back` brings it over with the step's committed tokens."""
        if raw is None:
            return None
        logits, lse = raw
        if nodes is None:  # [B, V]: every token is drawn after the row's one position
            return logits.gather(1, tokens).to(lse.dtype) - lse[:, None]
        rows = torch.arange(tokens.shape[0], device=tokens.device)[:, None]
        return logits[rows, nodes, tokens].to(lse.dtype) - lse.gather(1, nodes)

    @staticmethod
    def read_back(ints: Tensor, floats: Optional[Tensor] = None) -> tuple[list, Optional[list]]:
        """The step's one device->host read: host rows of [B, k] integers, and of [B, K] floats (log-
        probabilities) when given, which ride along as their bit patterns so that turning logprobs on adds
        no second read."""
        if floats is None:
            return ints.tolist(), None
        wide = floats.dtype == torch.float64
        bits = floats.view(torch.int64 if wide else torch.int32).to(torch.int64)
        rows = torch.cat([ints.to(torch.int64), bits], 1).tolist()
        k = ints.shape[1]
        tail = np.asarray([r[k:] for r in rows], dtype=np.int64).reshape(len(rows), -1)
        values = tail.view(np.float64) if wide else tail.astype(np.int32).view(np.float32)
        return [r[:k] for r in rows], values.tolist()

    # ---- admission ---------------------------------------------------------------------
    def prefill_target(self, reqs: list[Request]):
        """Target prefill of new requests. Returns (Prefill, logits [B, V]) or None on OOM."""
        rows = [self.prep.acquire_row() for _ in reqs]
        if any(r is None for r in rows):
            self.prep.release_rows([r for r in rows if r is not None])
            return None
        rows_np = np.asarray(rows, dtype=np.int64)
        prefill = [r.prefill_ids for r in reqs]
        lens = np.asarray([len(p) for p in prefill], dtype=np.int64)
        T = int(lens.max())
        ids = torch.zeros((len(reqs), T), dtype=torch.int64)
        for b, p in enumerate(prefill):
            ids[b, : lens[b]] = torch.tensor(p, dtype=torch.int64)
        ids = ids.to(self.dev)
        rows_t = torch.from_numpy(rows_np).to(self.dev)
        lens_t = torch.from_numpy(lens).to(self.dev)
        last = lens_t - 1
        chunk = self.prefill_chunk(lens)
        if chunk == 0 or (chunk is None and not self.prep.reserve(rows_np, lens)):
            self.prep.release_rows(rows)
            return None
        if chunk is not None:
            return self.prefill_in_chunks(reqs, rows_np, lens, ids, chunk)
        batch = self.prep.decorate(
            extend_batch(self.prep.table, rows_t, torch.zeros_like(lens_t), lens_t, T, bucket(T)))
        batch.fresh_causal = True
        packed = self.pack_prefill(batch, lens, T) if len(reqs) > 1 and int(lens.min()) < T else None
        fwd_ids, fwd_batch = (ids, batch) if packed is None else (ids.reshape(1, -1)[:, packed[0]], packed[1])
        if packed is None:  # (compile.prefill.target_forward's branch)
            hidden, logits = self.prefill.target_forward(ids, batch, last)  # [B, T, H], [B, V]
            pf = Prefill(rows_np, lens, ids, batch, last, _hidden=hidden)
        else:
            final, hidden = target_hidden(self.target, fwd_ids, fwd_batch, self.feature_layers)  # [1, sum(lens), H]
            pf = Prefill(rows_np, lens, ids, batch, last, packed=packed[1], flat=packed[0], packed_hidden=hidden)
            logits = self.target.logits(final[0, pf.ends])  # [B, V]
        self.prep.commit(rows_np, lens)
        self.prep.after_commit(rows_np)
        return pf, logits

    def prefill_chunk(self, lens: np.ndarray) -> Optional[int]:
        """SWA: the tokens per forward of a prefill whose prompts the window pool cannot hold whole (the most
        that fits, in pages; 0: not even a page at a time), or None to prefill in one forward. Sliding layers
        keep only the window, so a prefill run in chunks frees what left the window between them: a prompt
        (or a retracted request's context) longer than the window pool runs."""
        prep = self.prep
        if prep.window is None:
            return None
        ps, budget = prep.ps, prep.alloc.swa_available() // prep.ps
        if int(self.pages(lens).sum()) <= budget:
            return None
        lo, hi = 0, -(-int(lens.max()) // ps)  # chunk pages: the largest with the group's peak within budget
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if prep.window_prefill_pages(lens, mid * ps)[1] <= budget:
                lo = mid
            else:
                hi = mid - 1
        return lo * ps

    def prefill_in_chunks(self, reqs: list[Request], rows: np.ndarray, lens: np.ndarray, ids: Tensor, chunk: int):
        """`prefill_target` `chunk` tokens at a time: each chunk reserves its slots, attends to the cached prefix
        through the pool (sliding layers see only their window), commits, and frees what left the window."""
        prep, dev, B, T = self.prep, self.dev, len(reqs), ids.shape[1]
        rows_t = torch.from_numpy(rows).to(dev)
        finals, hiddens = [], []
        for start in range(0, T, chunk):
            prev, end = np.minimum(lens, start), np.minimum(lens, start + chunk)
            if not prep.reserve(rows, end - prev):
                prep.release_rows(rows.tolist())
                return None
            part = extend_batch(prep.table, rows_t, torch.from_numpy(prev).to(dev),
                                torch.from_numpy(end - prev).to(dev), chunk, bucket(int(end.max())))
            part.fresh_causal = start == 0  # no cached prefix yet: the prefill's own causal kernels
            part_ids = torch.zeros((B, chunk), dtype=torch.int64, device=dev)
            part_ids[:, : min(chunk, T - start)] = ids[:, start: start + chunk]
            if self.feature_layers:
                final, hidden = self.target(part_ids, prep.decorate(part), aux_layers=self.feature_layers)
            else:
                final = hidden = self.target(part_ids, prep.decorate(part))
            finals.append(final)
            hiddens.append(hidden)
            prep.commit(rows, end)
            prep.after_commit(rows)
        prep.note_chunked(B, len(finals), chunk)
        final, hidden = torch.cat(finals, 1)[:, :T], torch.cat(hiddens, 1)[:, :T]
        lens_t = torch.from_numpy(lens).to(dev)
        batch = prep.decorate(extend_batch(prep.table, rows_t, torch.zeros_like(lens_t), lens_t, T, bucket(T)))
        batch.fresh_causal = True  # the drafters' view of the whole prompt (their pools keep every token)
        last = lens_t - 1
        pf = Prefill(rows, lens, ids, batch, last, _hidden=hidden)
        logits = self.target.logits(final[torch.arange(B, device=dev), last])  # [B, V]
        return pf, logits

    def pack_prefill(self, batch, lens: np.ndarray, T: int):
        """Requests of different lengths as one row without padding: (flat index of each real token in the
        padded [B, T] layout, the packed AttentionBatch), or None when a layer needs the padded form
        (sliding-window or sparse layers attend through the pool, not causally over the fresh K/V)."""
        if not self.target_dense:
            return None
        flat = torch.from_numpy(np.concatenate([b * T + np.arange(n) for b, n in enumerate(lens)])).to(self.dev)
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
        slots = batch.out_slots.reshape(1, -1)[:, flat]
        packed = AttentionBatch(positions=batch.positions.reshape(1, -1)[:, flat], out_slots=slots, kv_slots=slots,
                                mask=torch.ones((1, 1, 1), dtype=torch.bool, device=self.dev), fresh_causal=True,
                                segments=tuple((int(a), int(n)) for a, n in zip(starts, lens)))
        return flat, self.prep.decorate(packed)

    @property
    def target_dense(self) -> bool:
        """Every target layer attends fully and densely (no sliding window, no sparse top-k)."""
        return not self.target.window_layers() and self.target.config.sparse_top_k is None

    def admit(self, reqs: list[Request]) -> bool:
        """Prefill and join the running batch; False (nothing changed) when the KV pool is too full."""
        if not self.admit_fits(reqs):
            return False
        if self.grammar is not None:
            self.grammar.admit(reqs)  # (a constraint that cannot be built fails its request)
        with self.metrics.stage("prefill"):
            out = self.prefill_target(reqs)
            if out is None:
                return False
            pf, logits = out
            last = pf.last
            old = len(self.reqs)
            self.sampling.join([r.seed for r in reqs], [r.sampling for r in reqs],
                               [r.prefill_ids for r in reqs] if self.sampling.penalized else None)
            new_rows = torch.arange(old, old + len(reqs), device=self.dev)
            if self.sampling.penalized:
                self.sampling.limit(int(max(len(r.prefill_ids) for r in reqs)) + 1)
            raw = self.raw_logits(logits)
            first = self.sampling.sample_next(apply(logits, self.allowed_next(reqs)), last + 1,
                                              new_rows)  # the token at position len(prefill)
            resumed = [r.resumed for r in reqs]
            if any(resumed):  # their newest token is already generated: it is the root again
                known = torch.tensor([r.output_ids[-1] if r.resumed else 0 for r in reqs], dtype=first.dtype)
                first = torch.where(torch.tensor(resumed, device=self.dev), known.to(self.dev), first)
            self.sampling.note(first[:, None], rows=new_rows)
            finite = finite_rows(logits)
            host, lps = self.read_back(torch.stack([first, finite.to(first.dtype)], 1),
                                       self.token_logprobs(raw, first[:, None]))
            now = time.perf_counter()
            for i, (r, (t, ok)) in enumerate(zip(reqs, host)):
                if r.resumed or r.finished:
                    continue
                if not ok:
                    self.fail(r, "the target's logits contained NaN or inf at prefill")
                    continue
                if lps is not None and r.logprobs is None:
                    r.logprobs = []
                self.append_checked(r, [t], None if lps is None else lps[i])
                if r.retractions == 0:
                    self.metrics.first_token_s.append(now - r.t_submit)
            self.join(reqs, pf, first)
        self.drop_finished()
        return True

    def join(self, reqs, pf: Prefill, first) -> None:
        self.reqs.extend(reqs)
        self.rows = np.concatenate([self.rows, pf.rows])
        self.last_token = torch.cat([self.last_token, first])

    def keep(self, keep_t: Tensor) -> None:
        self.last_token = self.last_token[keep_t]
        self.sampling.keep(keep_t)

    def drop_finished(self) -> list[Request]:
        done = [r for r in self.reqs if r.finished]
        if not done:
            return []
        self.finished_log.extend(done)
        if self.grammar is not None:
            self.grammar.finish(done)
        keep = np.asarray([not r.finished for r in self.reqs])
        self.prep.release_rows(self.rows[~keep].tolist())
        self.reqs = [r for r in self.reqs if not r.finished]
        self.rows = self.rows[keep]
        self.keep(torch.from_numpy(np.flatnonzero(keep)).to(self.dev))
        return done
