"""Proposers: what a `draft=` option plugs into the speculative loop.

Each proposer keeps its own per-request state and implements
  join(pipe, reqs, pf, first)                                   after the target prefill (pipeline.Prefill)
  keep(keep_t)                                                  when finished requests leave
  propose(pipe, rows_t, L, L_t) -> (Tree, draft_probs | None)   one draft round
  after_verify(pipe, u, commit, vhidden, accept_index, L_t, kept_t, rows_t, old_last)
  finish(reqs)                                                  requests that completed (not retracted)
so the verify/commit code in `spec_pipeline` is shared by every drafter.
"""
from __future__ import annotations

from functools import partial

import numpy as np
import torch

from specpipe.drafters import ngram_host
from specpipe.drafters.ngram import SEP, NgramDrafter
from specpipe.drafters.suffix import SuffixCache
from specpipe.models.attention_batch import extend_batch
from specpipe.pipeline import OutOfKVMemory, bucket, finite_rows
from specpipe.stages.build_tree import BuildTree, Tree
from specpipe.stages.draft_forward import advance_visibility, DraftForward
from specpipe.stages.draft_loop import DraftLoop
from specpipe.stages.draft_scratch import draft_columns
from specpipe.stages.draft_topk import DraftTopK


def non_finite(score_blocks: list, batch_size: int):
    """[B] bool: a request whose draft scores (hence draft logits) hold NaN or inf this round."""
    return ~finite_rows(torch.cat([s.reshape(batch_size, -1) for s in score_blocks], 1))


class EagleProposer:
    """EAGLE-1/2 head: tree drafting from the target's hidden states."""

    def __init__(self, head, topk: int, num_steps: int, num_draft_tokens: int, fused_topk: bool = False):
        self.head = head
        self.K, self.S, self.N = topk, num_steps, num_draft_tokens
        self.topk_stage = DraftTopK(topk, fused_topk)
        self.tree_stage = BuildTree(topk, num_steps, num_draft_tokens)
        self.draft_fwd = DraftForward(head, topk)
        self.loop = DraftLoop(self.draft_fwd, self.topk_stage, self.tree_stage, num_steps)
        self.stages = [self.topk_stage, self.tree_stage, self.draft_fwd, self.loop]
        self.one_call = False  # the round's steps run as one `draft_loop.steps` call (see plan_rounds)
        self.bad = None  # [B] draft logits non-finite this round
        self.feature_layers = getattr(head, "aux_layers", None)  # EAGLE-3 reads several target layers
        self.topk_p = self.topk_index = self.draft_hidden = None
        self.windowed = any(getattr(m, "window", None) is not None for m in head.modules())  # banded prefill
        self._decode_fn = None  # see _decode

    def join(self, pipe, reqs, pf, first) -> None:
        """Draft extend over the prompt: position p takes (token x_{p+1}, target hidden h_p); packed (no padding)
        when the target's prefill ran packed."""
        ids = pf.ids
        ids_d = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], 1).scatter(1, pf.last[:, None], first[:, None])
        # packed, the prompts are segments of one row while `pf.ends` has one entry per prompt; a compiled or
        # graphed extend takes the padded form, whose inputs all have one row per prompt (one batch size). A head
        # with sliding-window layers prefills eagerly: its banded attention loops over the prompt's length, which
        # a compiled extend specialized (a recompile for every new prompt length, then eager past the limit)
        extend, compiled = self.draft_fwd.extend, "extend" in getattr(self.draft_fwd, "wrapped", ())
        if compiled and self.windowed:
            extend, compiled = partial(type(self.draft_fwd).extend, self.draft_fwd), False
        if pf.packed_for(self.head) and not compiled:
            p, idx, h = extend(ids_d.reshape(1, -1)[:, pf.flat], pf.packed_hidden, pf.packed, pf.ends)
        else:
            p, idx, h = extend(ids_d, pf.hidden, pf.batch, pf.last)
        if self.topk_p is None or self.topk_p.shape[0] == 0:
            self.topk_p, self.topk_index, self.draft_hidden = p, idx, h
        else:
            self.topk_p = torch.cat([self.topk_p, p])
            self.topk_index = torch.cat([self.topk_index, idx])
            self.draft_hidden = torch.cat([self.draft_hidden, h])

    def keep(self, keep_t) -> None:
        self.topk_p, self.topk_index = self.topk_p[keep_t], self.topk_index[keep_t]
        self.draft_hidden = self.draft_hidden[keep_t]

    def finish(self, reqs) -> None:
        pass

    @property
    def scratch_width(self) -> int:
        return draft_columns("eagle", self.S)

    def _decode(self):
        """The draft decode the rounds call, resolved once after the stage's branches were bound (compiled or eager
        as the policy says, a sliding-window head's too)."""
        if self._decode_fn is None:
            fwd = self.draft_fwd
            self._decode_fn = fwd.decode
        return self._decode_fn

    def plan_rounds(self, prep) -> str:
        """Whether the rounds' steps run as one `draft_loop.steps` call: when its policy wrapped it and the
        allocator's attention batches need no host-side views (either scratch layout runs inside it). Returns why
        not when the policy asked for it and the allocator cannot ('' otherwise)."""
        asked = "steps" in getattr(self.loop, "wrapped", ())
        why = prep.batch_view_problem()
        self.one_call = asked and not why
        self.loop.prep, self.loop.kv = prep, self.head.kv
        return why if asked else ""

    def propose(self, pipe, rows_t, L, L_t):
        B, prep, kv = len(pipe.reqs), pipe.prep, self.head.kv
        sc = prep.draft_scratch(pipe.rows, rows_t, L, L_t, self.K, self.S - 1)
        if sc is None:
            raise OutOfKVMemory("KV pool exhausted while drafting")
        if self.one_call:  # batches need no host-side decoration: the round's steps are one tensor function
            sc.begin(prep, kv)  # (page-aligned regions: the mirror of the prefix's partial page, sized on the host)
            self.loop.layout, self.loop.first = type(sc), sc.first  # the layout draft_scratch chose (not re-derived)
            tree, self.bad = self.loop.steps(self.topk_p, self.topk_index, self.draft_hidden, pipe.last_token, L_t,
                                             *sc.tensors())
            prep.end_scratch(sc.state)
            return Tree(*tree), None
        blocks = self.step_by_step(prep, kv, sc, B)
        prep.end_scratch(sc.state)
        s_l, t_l, p_l = (list(x) for x in zip(*blocks))
        self.bad = non_finite(s_l, B)
        return self.tree_stage(pipe.last_token, s_l, t_l, p_l, L_t), None

    def step_by_step(self, prep, kv, sc, B: int) -> list:
        """The round's tree steps, one call per draft forward and top-k, each under its own policy."""
        K, S = self.K, self.S
        sc.begin(prep, kv)
        anc = torch.zeros((B, K, (S - 1) * K), dtype=torch.bool, device=prep.device)
        decode = self._decode()
        ids, hid, scores, pb, blk = self.topk_stage(0, self.topk_p, self.topk_index, self.draft_hidden, None)
        blocks = [blk]
        for i in range(S - 1):
            anc = advance_visibility(anc, pb, i)
            sc.follow(prep, kv, pb, i)
            batch = prep.decorate(sc.step_batch(i, anc))
            tp, ti, hout = decode(ids.view(B, K), hid.view(B, K, -1), batch)
            ids, hid, scores, pb, blk = self.topk_stage(i + 1, tp, ti, hout, scores)
            blocks.append(blk)
        return blocks

    def after_verify(self, pipe, u, commit, vhidden, accept_index, L_t, kept_t, rows_t, old_last) -> None:
        """Draft over the committed tokens so the next round starts from the new bonus token."""
        H = vhidden.shape[-1]
        hid = vhidden.gather(1, accept_index.clamp(min=0)[:, :, None].expand(-1, -1, H))[u]  # [B', S+1, H]
        ids, lens, starts = commit[u], kept_t[u], L_t[u]
        Lmax = int(pipe.prep.seq_len[pipe.rows].max())  # host lengths, already committed: no device read
        batch = pipe.prep.decorate(extend_batch(pipe.prep.table, rows_t[u], starts, lens, self.S + 1, bucket(Lmax)))
        p, idx, h = self.draft_fwd.extend(ids, hid, batch, lens - 1)
        self.topk_p[u], self.topk_index[u], self.draft_hidden[u] = p, idx, h


class NgramProposer:
    """Prompt lookup: drafts continuations of the request's own context; no model, no KV.

    With cache_tokens > 0 it also matches in a `SuffixCache` of the newest finished requests'
    outputs (and prompts, with cache_prompts): suffix decoding across requests. With running_tokens > 0
    it also matches in the other running requests' histories (their newest running_tokens // B tokens
    each), so requests decoded together draft from one another.

    With `host` (a device whose tensors are host memory) the matching runs in numpy on a view of the same
    history (`drafters.ngram_host`): the same trees, without some 250 op dispatches per step."""

    def __init__(self, topk: int, num_steps: int, num_draft_tokens: int, min_n: int, max_n: int,
                 max_requests: int, max_context: int, device, cache_tokens: int = 0, cache_prompts: bool = False,
                 running_tokens: int = 0, host: bool = False):
        self.drafter = NgramDrafter(num_steps, topk, num_draft_tokens, min_n, max_n)
        self.cache = SuffixCache(cache_tokens, device) if cache_tokens > 0 else None
        self.cache_prompts = cache_prompts
        self.K = topk
        self.bad = None
        self.S = num_steps
        self.tokens = torch.zeros((max_requests, max_context + num_steps + 2), dtype=torch.int64,
                                  device=device)  # [R, C] token history per table row
        # a history gives at most its whole row (and its SEP) to each of max_requests rows: a larger budget changes
        # nothing, and one past int64 (draft.running_tokens=1e20) overflowed numpy mid-run
        self.running_tokens = min(running_tokens, max_requests * (self.tokens.shape[1] + 1))
        self.host = self.tokens.numpy() if host else None  # the same memory, read by numpy
        self.stages = []

    def join(self, pipe, reqs, pf, first) -> None:
        rows_t = torch.from_numpy(pf.rows).to(pipe.dev)
        T = pf.ids.shape[1]
        self.tokens[rows_t, :T] = pf.ids
        self.tokens[rows_t, pf.last + 1] = first

    def keep(self, keep_t) -> None:
        pass

    def finish(self, reqs) -> None:
        """Completed requests (errors excluded) join the cross-request cache, if there is one."""
        if self.cache is None:
            return
        for r in reqs:
            if r.error is None and r.output_ids:
                self.cache.add((list(r.prompt_ids) if self.cache_prompts else []) + list(r.output_ids))

    scratch_width = draft_columns("ngram", 0)  # no model, no draft KV

    def propose(self, pipe, rows_t, L, L_t):
        width = int(L.max()) + 1
        if self.host is not None:
            ctx = self.host[pipe.rows, :width]
            corpus = None if self.cache is None else self.cache.host_tokens
            if self.running_tokens > 0 and len(L) > 1:
                corpus = self.running_corpus_host(ctx, L, corpus)
            tokens, parent = ngram_host.propose(self.drafter, ctx, L + 1, corpus)
            return ngram_host.tree_from_parents(tokens, parent, L_t, self.S), None
        ctx = self.tokens[rows_t, :width]
        corpus = None if self.cache is None else self.cache.tokens
        if self.running_tokens > 0 and len(L) > 1:
            corpus = self.running_corpus(ctx, L, corpus)
        return self.drafter.propose(ctx, L_t + 1, L_t, corpus), None

    def running_layout(self, L: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Where the running corpus's tokens come from, by index arithmetic on the host lengths L (no device read):
        (seg [Lr] the request each position copies, col [Lr] its history column, sep [Lr] the SEP ending each)."""
        B = len(L)
        n = np.minimum(L + 1, max(1, self.running_tokens // B))  # tokens each history contributes
        Lr = int((n + 1).sum())
        seg = np.repeat(np.arange(B), n + 1)  # which request each corpus position comes from
        off = np.arange(Lr) - np.repeat(np.cumsum(n + 1) - (n + 1), n + 1)  # position inside its segment
        col = np.minimum(np.repeat(L + 1 - n, n + 1) + off, width - 1)  # the newest n tokens of the row
        return seg, col, off == np.repeat(n, n + 1)

    def running_corpus(self, ctx, L: np.ndarray, cache_tokens) -> torch.Tensor:
        """[B, Lc + Lr] per-request corpus: the cache, then every running request's history (its newest
        running_tokens // B tokens, root included, then SEP), with row b's own history blanked to SEP (its
        own context is matched anyway, after the corpus)."""
        B, dev = len(L), ctx.device
        seg, col, sep = (torch.from_numpy(a).to(dev) for a in self.running_layout(L, ctx.shape[1]))
        flat = torch.where(sep, torch.full_like(seg, SEP, dtype=torch.int32), ctx[seg, col].to(torch.int32))
        rows = torch.where(seg[None, :] == torch.arange(B, device=dev)[:, None], torch.full_like(flat, SEP), flat)
        if cache_tokens is None or not cache_tokens.numel():
            return rows
        return torch.cat([cache_tokens.to(torch.int32).expand(B, -1), rows], 1)

    def running_corpus_host(self, ctx: np.ndarray, L: np.ndarray, cache_tokens) -> np.ndarray:
        """`running_corpus` on host arrays."""
        B = len(L)
        seg, col, sep = self.running_layout(L, ctx.shape[1])
        flat = np.where(sep, SEP, ctx[seg, col]).astype(np.int32)
        rows = np.where(seg[None, :] == np.arange(B)[:, None], SEP, flat).astype(np.int32)
        if cache_tokens is None or not cache_tokens.size:
            return rows
        return np.concatenate([np.broadcast_to(cache_tokens, (B, cache_tokens.shape[0])), rows], 1)

    def after_verify(self, pipe, u, commit, vhidden, accept_index, L_t, kept_t, rows_t, old_last) -> None:
        d = torch.arange(commit.shape[1], device=commit.device)
        cols = (L_t[u][:, None] + 1 + d).clamp(max=self.tokens.shape[1] - 1)
        keep = d[None, :] < kept_t[u][:, None]
        cur = self.tokens[rows_t[u][:, None], cols]
        self.tokens[rows_t[u][:, None], cols] = torch.where(keep, commit[u], cur)


class StandaloneProposer:
    """A small causal LM with its own KV pool drafts a chain or a tree (`drafters.standalone`)."""

    def __init__(self, drafter, sampled_chain: bool):
        self.sd = drafter
        self.K = drafter.K
        self.sampled_chain = sampled_chain
        self.bad = None
        self.S = drafter.S
        self.tree_stage = BuildTree(drafter.K, drafter.S, drafter.N)
        self.stages = [drafter, drafter.topk_stage, self.tree_stage]
        self.windowed = any(getattr(m, "window", None) is not None for m in drafter.model.modules())

    def join(self, pipe, reqs, pf, first) -> None:
        """Draft KV over the prompts: packed when the target's prefill ran packed and the extend runs eager (a
        compiled or graphed extend takes the padded form: one row per prompt, the decode rounds' batch kind)."""
        extend, compiled = self.sd.extend, "extend" in getattr(self.sd, "wrapped", ())
        if compiled and self.windowed:  # banded prefill loops over the prompt length: eager, see EagleProposer
            extend, compiled = partial(type(self.sd).extend, self.sd), False
        if pf.packed_for(self.sd.model) and not compiled:
            extend(pf.ids.reshape(1, -1)[:, pf.flat], pf.packed)
        else:
            extend(pf.ids, pf.batch)

    def keep(self, keep_t) -> None:
        pass

    def finish(self, reqs) -> None:
        pass

    @property
    def scratch_width(self) -> int:
        return draft_columns("standalone", self.S)

    def propose(self, pipe, rows_t, L, L_t):
        s = pipe.sampling
        sampling = (s.temperature, s.top_p, s.top_k, s.seed, s.min_p, s.filters) if self.sampled_chain else None
        blocks, draft_probs = self.sd.draft(pipe.prep, pipe.rows, rows_t, L, L_t, pipe.last_token, sampling=sampling)
        s_l, t_l, p_l = (list(x) for x in zip(*blocks))
        self.bad = non_finite(s_l, len(pipe.reqs))
        tree: Tree = self.tree_stage(pipe.last_token, s_l, t_l, p_l, L_t)
        return tree, draft_probs

    def after_verify(self, pipe, u, commit, vhidden, accept_index, L_t, kept_t, rows_t, old_last) -> None:
        ids = torch.cat([old_last[:, None], commit], 1)[u, : self.S + 1]
        self.sd.extend_committed(pipe.prep.table, rows_t[u], L_t[u], ids, kept_t[u],
                                 int(pipe.prep.seq_len[pipe.rows].max()))  # host lengths, already committed
