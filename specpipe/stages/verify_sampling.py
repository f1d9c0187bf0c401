"""Sampling verification: commit tokens distributed exactly as the target would sample them.

Two schemes, each one fixed loop over depth of tensor ops (no host sync):

* target-only by position (`position_sample`), for any tree not built from the verifier's coins
  (EAGLE's deterministic top-K trees, n-gram and suffix trees, even sampled chains). At depth d the
  token of the next position is drawn from the current node's processed target distribution p_v by
  inverse CDF with that position's coin, exactly as plain decoding draws it; the walk follows the
  child holding that token, else the token is the bonus. Each committed token is a draw from p given
  the committed prefix, so the law is the target's; more, the tokens are the ones plain decoding
  draws from the same seed, so a request's text does not depend on the drafter, the tree, the batch or
  a cross-request cache (drafts only change how many positions a round covers). A child is accepted
  with probability p_v(c), as in sglang's target-only walk.
* rejection sampling (`chain_rejection_sample`), for CHAINS whose token after node v was SAMPLED from
  q_v = draft_probs[:, v]: accept x with prob min(1, p(x)/q(x)), else the bonus comes from
  norm(max(0, p - q)). Proof: P(next = y) = q(y) min(1, p(y)/q(y)) + (1 - sum_z min(p, q)(z)) *
  max(0, p(y) - q(y)) / sum_z max(0, p - q)(z) = min(p, q)(y) + max(0, p(y) - q(y)) = p(y).
  Only the first child of each node is considered. It is NOT lossless for deterministic drafts
  (argmax chains): use target-only there.

Coins are counter-based: a 32-bit integer hash of (request seed, counter, stream, column), so a
request's coins are deterministic given its seed and do not depend on the rest of the batch or
on the device. Target-only verification and plain decoding use the coin of each position
(STREAM_PLAIN, counter = the position); rejection sampling passes counter = seq_lens (strictly
increasing between rounds, so coins are never reused) with its own acceptance, bonus and drafting streams.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from specpipe.schema import GREEDY_TEMPERATURE  # temperatures below it are greedy (re-exported here)
from specpipe.stages.base import Stage, branch

STREAM_ACCEPT, STREAM_BONUS, STREAM_DRAFT = 1, 2, 3
STREAM_PLAIN = 4  # the coin of the token at each position: plain decoding, prefill and target-only verification
_M32 = 0xFFFFFFFF


def _mul32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32) without int64 overflow (c split in 16-bit halves)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _mix32(x: Tensor) -> Tensor:
    """Wellons' lowbias32 integer finaliser on values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform_coins(seed: Tensor, counter: Tensor, cols: int, stream: int) -> Tensor:
    """seed [B], counter [B] int -> [B, cols] float32 uniform in [0, 1) with 24 random bits."""
    s, c = seed.to(torch.int64), counter.to(torch.int64)
    h = _mix32((s & _M32) ^ 0x9E3779B9)
    h = _mix32(h ^ ((s >> 32) & _M32))
    h = _mix32(h ^ (c & _M32))
    h = _mix32(h ^ (stream * 0x68E31DA4 & _M32))
    col = torch.arange(cols, device=seed.device, dtype=torch.int64)
    h = _mix32(_mix32(h[:, None] ^ col) ^ 0x1B873593)  # [B, cols]
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))




def process_logits(logits: Tensor, temperature: Tensor, top_p: Tensor, top_k: Tensor,
                   min_p: Optional[Tensor] = None) -> Tensor:
    """logits [B,N,V], per-request temperature/top_p/min_p [B] float, top_k [B] int -> probs [B,N,V] float32.

    softmax(logits / T), keep the top_k most likely and every token tied with the k-th (as HF's TopKLogitsWarper
    and vLLM; top_k <= 0: all), renormalise, keep the smallest prefix whose mass reaches top_p (top_p >= 1: all,
    though the float32 cumulative sum overshoots 1; never less than the most likely token, even when a tiny
    top_p rounds to 0 in float32), then drop tokens less likely than min_p times the most likely (HF's
    MinPLogitsWarper, after top-k and top-p as in HF; min_p <= 0: none), renormalise. T < GREEDY_TEMPERATURE is
    greedy: a one-hot at the argmax of the logits as given (float64 logits: their own argmax, as plain greedy
    decoding takes it), so greedy and sampled requests share one batch.
    """
    B, N, V = logits.shape
    x = logits.float()
    greedy = temperature < GREEDY_TEMPERATURE  # [B]
    t = torch.where(greedy, torch.ones_like(temperature), temperature).float()
    probs = torch.softmax(x / t[:, None, None], dim=-1)
    sp, si = probs.sort(dim=-1, descending=True, stable=True)  # [B,N,V]
    rank = torch.arange(V, device=logits.device)
    k = torch.where(top_k > 0, top_k.clamp(max=V), torch.full_like(top_k, V))
    kth = sp.gather(-1, (k - 1).view(B, 1, 1).expand(B, N, 1))  # [B,N,1] the k-th largest probability
    keep = sp >= kth
    sp = torch.where(keep, sp, torch.zeros_like(sp))
    sp = sp / sp.sum(-1, keepdim=True)
    before = sp.cumsum(-1) - sp  # mass of strictly more likely tokens
    nucleus = (before < top_p.float()[:, None, None]) | (top_p >= 1)[:, None, None]
    keep = keep & (nucleus | (rank == 0))  # the most likely always stays
    if min_p is not None:  # relative to the most likely (sp[..., 0]): the same before or after renormalising
        keep = keep & (sp >= min_p.float()[:, None, None] * sp[..., :1])
    sp = torch.where(keep, sp, torch.zeros_like(sp))
    out = torch.zeros_like(probs).scatter(-1, si, sp)
    out = out / out.sum(-1, keepdim=True)
    onehot = torch.zeros_like(out).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)  # F.one_hot reads ids back
    return torch.where(greedy[:, None, None], onehot, out)


def sample_tokens(probs: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF sampling: probs [B,V] (unnormalised, non-negative), u [B] in [0,1) -> ids [B].

    Never returns a zero-mass id (the first cdf entry strictly above u*total has positive mass).
    """
    cdf = probs.cumsum(-1)
    t = (u * cdf[:, -1])[:, None].to(cdf.dtype)
    return torch.searchsorted(cdf, t, right=True)[:, 0].clamp(max=probs.shape[-1] - 1)


def position_coins(seed: Tensor, counter: Tensor, n: int) -> Tensor:
    """[B, n]: the coins of positions counter+1 .. counter+n, the ones plain decoding draws those tokens with."""
    B = seed.shape[0]
    pos = (counter.to(torch.int64)[:, None] + 1 + torch.arange(n, device=seed.device)).reshape(-1)
    return uniform_coins(seed.repeat_interleave(n), pos, 1, STREAM_PLAIN).view(B, n)


def position_sample(probs: Tensor, tokens: Tensor, parent: Tensor, u: Tensor, num_steps: int):
    """Target-only tree verification by position. At depth d the token of the next position is drawn from
    the current node's processed target distribution with that position's coin u[:, d] (inverse CDF over the
    vocabulary, exactly as plain decoding draws it); the walk moves to the child holding that token if
    there is one, else that token is the bonus and the round ends; after num_steps accepted drafts the
    bonus is drawn with u[:, num_steps].

    Lossless for any tree not built from these coins, and more: the committed tokens are the very tokens
    plain decoding draws with the same seed, so a request's sampled text does not depend on the drafter,
    the tree, the batch or the cross-request cache; drafts only decide how many positions one round covers.
    probs [B,N,V], tokens [B,N], parent [B,N] (-1: root or unlinked), u [B, num_steps+1] ->
    accept_index [B,S+1], accept_len [B], commit [B,S+1] (accepted drafts, the bonus, then the bonus repeated).
    """
    B = probs.shape[0]
    linked = parent >= 0
    cur = torch.zeros(B, dtype=torch.int64, device=tokens.device)
    alive = torch.ones(B, dtype=torch.bool, device=tokens.device)
    count = torch.zeros(B, dtype=torch.int64, device=tokens.device)
    path, drawn = [cur], []
    for d in range(num_steps):
        x = sample_tokens(_rows(probs, cur), u[:, d])  # [B]
        drawn.append(x)
        child = linked & (parent == cur[:, None]) & (tokens == x[:, None]) & alive[:, None]
        acc = child.any(-1)
        cur = torch.where(acc, child.to(torch.int64).argmax(-1), cur)  # argmax: the first sibling with x
        count = count + acc.to(torch.int64)
        alive = acc
        path.append(torch.where(acc, cur, torch.full_like(cur, -1)))
    drawn.append(sample_tokens(_rows(probs, cur), u[:, num_steps]))
    xs = torch.stack(drawn, 1)  # [B, S+1]: the token drawn for each position of the round
    bonus = xs.gather(1, count[:, None])
    col = torch.arange(num_steps + 1, device=tokens.device)
    return torch.stack(path, 1), count, torch.where(col[None, :] <= count[:, None], xs, bonus)


def _rows(x: Tensor, idx: Tensor) -> Tensor:
    """x [B,N,V], idx [B] -> x[b, idx[b]] [B,V]."""
    return x.gather(1, idx[:, None, None].expand(-1, 1, x.shape[-1]))[:, 0]


def chain_rejection_sample(probs: Tensor, tokens: Tensor, parent: Tensor, u: Tensor, u_final: Tensor,
                           num_steps: int, draft_probs: Tensor):
    """Rejection sampling along a chain whose token after node v was sampled from draft_probs[:, v].

    probs [B,N,V] processed target distribution after each node; tokens [B,N]; parent [B,N] local
    parent (-1: root or unlinked, never accepted); u [B,N] coin used at each visited node; u_final
    [B] coin of the bonus; draft_probs [B,N,V], row v = the distribution node v's child token was
    sampled from. Only the first child of each node is considered. Returns accept_index [B,S+1]
    accepted local nodes (-1 padded), accept_len [B] drafts accepted, commit [B,S+1] accepted drafts
    then the bonus (the tail past the bonus repeats the bonus so it is always a valid id).
    """
    B, N, V = probs.shape
    dev = tokens.device
    ar = torch.arange(N, device=dev)
    ptok = probs.gather(2, tokens[:, None, :].expand(B, N, N))  # ptok[b, i, j] = p_i(token_j)
    cand = parent >= 0
    cur = torch.zeros(B, dtype=torch.int64, device=dev)
    alive = torch.ones(B, dtype=torch.bool, device=dev)
    count = torch.zeros(B, dtype=torch.int64, device=dev)
    path = [cur]
    for _ in range(num_steps):
        child = cand & (parent == cur[:, None]) & alive[:, None]  # [B,N]
        coin = u.gather(1, cur[:, None])  # [B,1]
        pc = ptok.gather(1, cur[:, None, None].expand(B, 1, N))[:, 0]  # [B,N] p_cur(token_j)
        first = torch.where(child, ar, torch.full_like(ar, N)).min(-1).values
        nxt = first.clamp(max=N - 1)
        q = _rows(draft_probs, cur).gather(1, tokens.gather(1, nxt[:, None]))[:, 0]
        acc = (first < N) & (coin[:, 0] * q < pc.gather(1, nxt[:, None])[:, 0])
        cur = torch.where(acc, nxt, cur)
        count = count + acc.to(torch.int64)
        alive = acc
        path.append(torch.where(acc, nxt, torch.full_like(nxt, -1)))
    accept_index = torch.stack(path, 1)  # [B, S+1]
    # bonus: residual at the last accepted node; its child was examined unless the walk ran S deep
    examined = ~alive
    p_last = _rows(probs, cur)  # [B,V]
    kids = cand & (parent == cur[:, None]) & examined[:, None]
    q_last = _rows(draft_probs, cur).to(p_last.dtype)
    resid = torch.where(kids.any(-1)[:, None], (p_last - q_last).clamp(min=0), p_last)
    empty = resid.sum(-1, keepdim=True) <= 0  # only through rounding: fall back to p
    resid = torch.where(empty, p_last, resid)
    bonus = sample_tokens(resid, u_final)  # [B]
    drafts = tokens.gather(1, accept_index[:, 1:].clamp(min=0))  # [B,S]
    col = torch.arange(num_steps + 1, device=dev)
    commit = torch.where(col < count[:, None], torch.cat([drafts, bonus[:, None]], 1), bonus[:, None])
    return accept_index, count, commit


class VerifySampling(Stage):
    """Stage wrapper: the pipeline calls `probs` on the verify logits, then `sample` (or `sample_rejection`)."""

    name = "verify_sampling"

    def __init__(self, num_steps: int):
        self.num_steps = num_steps

    @branch
    def probs(self, logits: Tensor, temperature: Tensor, top_p: Tensor, top_k: Tensor, min_p: Tensor) -> Tensor:
        return process_logits(logits, temperature, top_p, top_k, min_p)

    @branch
    def sample(self, probs: Tensor, tokens: Tensor, parent: Tensor, seed: Tensor, counter: Tensor):
        """Target-only tree sampling by position (`position_sample`); counter = the root's position (seq_len),
        so the coins are plain decoding's. Same output format as Verify.greedy."""
        return position_sample(probs, tokens, parent, position_coins(seed, counter, self.num_steps + 1),
                               self.num_steps)

    @branch
    def sample_rejection(self, probs: Tensor, draft_probs: Tensor, tokens: Tensor, parent: Tensor, seed: Tensor,
                         counter: Tensor):
        """Chain rejection sampling with the draft's full distributions [B,N,V] (sampled chains only)."""
        u = uniform_coins(seed, counter, tokens.shape[1], STREAM_ACCEPT)
        uf = uniform_coins(seed, counter, 1, STREAM_BONUS)[:, 0]
        return chain_rejection_sample(probs, tokens, parent, u, uf, self.num_steps, draft_probs)
