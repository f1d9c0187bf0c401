"""draft=ngram: prompt lookup, n-gram drafting from each request's own context (the trie of `drafters.ngram_trie`).

The settings of draft=suffix (`drafters.suffix`) are this drafter's too: a cache of finished outputs and the other
running requests' histories, matched as if they came before the request's own context."""
from __future__ import annotations

import numpy as np
import torch

from specpipe.drafters import ngram_host
from specpipe.drafters.base import DraftSetup, Proposer
from specpipe.drafters.ngram_trie import SEP, NgramDrafter
from specpipe.drafters.suffix_cache import SuffixCache
from specpipe.stages.tree_layout import host_tree_from_parents


class NgramProposer(Proposer):
    """Prompt lookup: drafts continuations of the request's own context; no model, no KV.

    With cache_tokens > 0 it also matches in a `SuffixCache` of the newest finished requests'
    outputs (and prompts, with cache_prompts): suffix decoding across requests. With running_tokens > 0
    it also matches in the other running requests' histories (their newest running_tokens // B tokens
    each), so requests decoded together draft from one another.

    With `host` (a device whose tensors are host memory) the matching runs in numpy on a view of the same
    history (`drafters.ngram_host`): the same trees, without some 250 op dispatches per step."""

    @classmethod
    def build(cls, cfg, pair, setup: DraftSetup) -> "NgramProposer":
        """`setup.keep` carries the cache of finished outputs from one run to the next (the API's calls), reused when
        its size and device are the same."""
        d, device = cfg.draft, setup.device
        proposer = cls(d.topk, d.num_steps, d.num_draft_tokens, d.min_n, d.max_n, setup.max_requests,
                       setup.max_context, device.torch_device, cache_tokens=d.get("cache_tokens", 0),
                       cache_prompts=bool(d.get("cache_prompts", False)), running_tokens=d.get("running_tokens", 0),
                       host=device.host_memory)
        if setup.keep is not None and proposer.cache is not None:
            key = ("suffix_cache", proposer.cache.capacity, str(device.torch_device))
            proposer.cache = setup.keep.setdefault(key, proposer.cache)
        return proposer

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

    def join(self, pipe, reqs, pf, first) -> None:
        rows_t = torch.from_numpy(pf.rows).to(pipe.dev)
        T = pf.ids.shape[1]
        self.tokens[rows_t, :T] = pf.ids
        self.tokens[rows_t, pf.last + 1] = first

    def finish(self, reqs) -> None:
        """Completed requests (errors excluded) join the cross-request cache, if there is one."""
        if self.cache is None:
            return
        for r in reqs:
            if r.error is None and r.output_ids:
                self.cache.add((list(r.prompt_ids) if self.cache_prompts else []) + list(r.output_ids))

    def propose(self, pipe, rows_t, L, L_t):
        width = int(L.max()) + 1
        if self.host is not None:
            ctx = self.host[pipe.rows, :width]
            corpus = None if self.cache is None else self.cache.host_tokens
            if self.running_tokens > 0 and len(L) > 1:
                corpus = self.running_corpus_host(ctx, L, corpus)
            tokens, parent = ngram_host.propose(self.drafter, ctx, L + 1, corpus)
            self.node_conf = self.drafter.node_conf
            return host_tree_from_parents(tokens, parent, L_t, self.S), None
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
