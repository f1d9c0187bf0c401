"""Prompt-lookup (n-gram) drafting: propose what followed earlier occurrences of the context's tail.

No model: the draft for request b is read from its own token history. For every n in
[min_n, max_n] the last n tokens (ending with the root = the last committed token) are looked up
earlier in the history; a match at [c-n, c) proposes the continuation history[c : c+num_steps]
(cut at the end of the history). Matches are ranked by (longest n, most recent c). With topk=1
the best continuation becomes a chain; with topk=K the continuations of the K best matches whose
continuations are not prefixes of a better one are merged as a trie (shared prefixes share nodes).
Nodes are numbered rank-major (the best continuation's chain first, then the new nodes of the
next), truncated to num_draft_tokens - 1; the layout is the verifier's `Tree`.

Worked example (one request, min_n=1, max_n=3, num_steps=3):

    history   = [1 2 3 4 2 3 5 6 2 3]          root = 3 (last token), index 0..9
    n=3 tail  = [6 2 3]  -> no earlier occurrence
    n=2 tail  = [2 3]    -> at [4,6) (c=6, most recent) and at [1,3) (c=3)
    topk=1, num_draft_tokens=4: chain  3 -> 5 -> 6 -> 2           (history[6:9])
    topk=2, num_draft_tokens=7: trie   3 -> 5 -> 6 -> 2 ; 3 -> 4 -> 2 -> 3
        tokens = [3, 5, 6, 2, 4, 2, 3]   parent = [-1, 0, 1, 2, 0, 4, 5]
    topk=2, num_draft_tokens=5: the last node is cut: tokens [3, 5, 6, 2, 4], parent [-1, 0, 1, 2, 0]

A request without any match gets only unlinked padding nodes (token = root, parent -1), which
the verifiers never accept, so it commits exactly the bonus token.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from specpipe.drafters.tree import tree_from_parents
from specpipe.stages.build_tree import Tree


def pack_histories(histories: Sequence[Sequence[int]], device=None) -> tuple[Tensor, Tensor]:
    """Lists of token ids -> (context [B, Lmax] int64 zero padded, lengths [B] int64)."""
    lens = [len(h) for h in histories]
    ctx = torch.zeros((len(histories), max(lens, default=0) or 1), dtype=torch.int64)
    for b, h in enumerate(histories):
        ctx[b, : len(h)] = torch.as_tensor(list(h), dtype=torch.int64)
    return ctx.to(device), torch.as_tensor(lens, dtype=torch.int64, device=device)


class NgramDrafter:
    def __init__(self, num_steps: int, topk: int = 1, num_draft_tokens: Optional[int] = None, min_n: int = 1,
                 max_n: int = 3, candidates: Optional[int] = None):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.S, self.K = num_steps, topk
        self.N = num_draft_tokens if num_draft_tokens is not None else 1 + topk * num_steps
        if not 2 <= self.N <= 1 + topk * num_steps:
            raise ValueError(f"num_draft_tokens must be in [2, 1 + topk*num_steps = {1 + topk * num_steps}]")
        self.min_n, self.max_n = min_n, max_n
        self.M = candidates if candidates is not None else 4 * topk  # matches examined before dedup

    def match_lengths(self, context: Tensor, lengths: Tensor) -> Tensor:
        """[B, L]: for each continuation start c, how many (<= max_n) tokens before c equal the tail."""
        B, L = context.shape
        pos = torch.arange(L, device=context.device)
        run = torch.ones((B, L), dtype=torch.bool, device=context.device)
        n = torch.zeros((B, L), dtype=torch.int64, device=context.device)
        for t in range(self.max_n):
            a = pos - 1 - t  # history index compared with the tail's token t from the end
            s = lengths - 1 - t
            tail = context.gather(1, s.clamp(min=0)[:, None])  # [B, 1]
            run = run & (a >= 0)[None, :] & (s >= 0)[:, None] & (context[:, a.clamp(min=0)] == tail)
            n = n + run.to(torch.int64)
        return n

    def continuations(self, context: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        """Best K continuations: windows [B, K, S] (-1 past the end) and their lengths [B, K] (0: none)."""
        B, L = context.shape
        S, K = self.S, self.K
        dev = context.device
        pos = torch.arange(L, device=dev)
        n = self.match_lengths(context, lengths)
        ok = (pos >= 1)[None, :] & (pos[None, :] < lengths[:, None]) & (n >= self.min_n)
        score = torch.where(ok, n * (L + 1) + pos, torch.full_like(n, -1))  # longest n, then most recent
        M = min(L, self.M)
        top, c = score.topk(M, dim=-1)  # [B, M]
        cval = top >= 0
        t = torch.arange(S, device=dev)
        idx = c[:, :, None] + t  # [B, M, S]
        wlen = torch.where(cval, (lengths[:, None] - c).clamp(max=S), torch.zeros_like(c))
        inside = t < wlen[:, :, None]
        win = torch.where(inside, context.gather(1, idx.clamp(max=L - 1).reshape(B, -1)).view(B, M, S),
                          torch.full_like(idx, -1))
        # redundant: its continuation is a prefix of a better-ranked one (adds no trie node)
        cover = ((win[:, :, None, :] == win[:, None, :, :]) | ~inside[:, :, None, :]).all(-1)  # [B, m, m']
        mm = torch.arange(M, device=dev)
        redundant = (cover & (mm[None, :] < mm[:, None]) & cval[:, None, :]).any(-1)
        keep = cval & ~redundant
        order = torch.where(keep, mm, mm + M).sort(dim=-1).values[:, :K] % M  # first K kept, by rank
        kept = keep.gather(1, order)
        if order.shape[1] < K:  # fewer candidate positions than K
            pad = K - order.shape[1]
            order = torch.cat([order, order.new_zeros((B, pad))], 1)
            kept = torch.cat([kept, kept.new_zeros((B, pad))], 1)
        wk = win.gather(1, order[:, :, None].expand(B, K, S))
        lk = torch.where(kept, wlen.gather(1, order), torch.zeros_like(order))
        wk = torch.where(t < lk[:, :, None], wk, torch.full_like(wk, -1))
        return wk, lk

    def propose(self, context: Tensor, lengths: Tensor, seq_lens: Tensor) -> Tree:
        """context [B, Lmax] token history ending with the root (the last committed token) at
        lengths[b]-1; seq_lens [B] the root's target position. Returns the draft `Tree` [B, N]."""
        B = context.shape[0]
        K, S, N = self.K, self.S, self.N
        dev = context.device
        wk, lk = self.continuations(context, lengths)  # [B,K,S], [B,K]
        t = torch.arange(S, device=dev)
        valid = t < lk[:, :, None]  # [B,K,S] node (k, depth t+1) exists
        eq = (wk[:, :, None, :] == wk[:, None, :, :]).to(torch.int64).cumprod(-1).bool()  # prefix equality
        canon = (eq & valid[:, None, :, :]).to(torch.int64).argmax(2)  # [B,K,S] first rank with this prefix
        kk = torch.arange(K, device=dev)
        new = valid & (canon == kk[None, :, None])
        local_new = new.reshape(B, -1).to(torch.int64).cumsum(-1).view(B, K, S)  # 1-based, rank-major
        local = local_new.gather(1, canon)  # local index of each (k, depth)'s canonical node
        par = torch.cat([torch.zeros_like(local[:, :, :1]), local[:, :, :-1]], 2)
        take = new & (local <= N - 1)
        dst = torch.where(take, local, torch.full_like(local, N)).reshape(B, -1)  # column N = discard
        root = context.gather(1, (lengths - 1).clamp(min=0)[:, None])  # [B,1]
        tokens = root.expand(B, N + 1).clone().scatter(1, dst, wk.reshape(B, -1).clamp(min=0))[:, :N]
        parent = torch.full((B, N + 1), -1, dtype=torch.int64, device=dev).scatter(1, dst, par.reshape(B, -1))
        parent[:, N] = -1
        tokens[:, 0] = root[:, 0]
        return tree_from_parents(tokens, parent[:, :N], seq_lens, S)
