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

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from specpipe.devices.base import wide_float
from specpipe.config.schema import GREEDY_TEMPERATURE  # temperatures below it are greedy (re-exported here)
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
    """seed [B], counter [B] int -> [B, cols] uniform in [0, 1): float64 with 53 random bits where the device
    computes in float64 (`devices.base.wide_float`), else float32 with 24. A 24-bit coin cannot pick a token
    whose share of the vocabulary's mass is below 2^-24, and a 128k vocabulary holds many such tokens."""
    s, c = seed.to(torch.int64), counter.to(torch.int64)
    h = _mix32((s & _M32) ^ 0x9E3779B9)
    h = _mix32(h ^ ((s >> 32) & _M32))
    h = _mix32(h ^ (c & _M32))
    h = _mix32(h ^ (stream * 0x68E31DA4 & _M32))
    col = torch.arange(cols, device=seed.device, dtype=torch.int64)
    h = _mix32(_mix32(h[:, None] ^ col) ^ 0x1B873593)  # [B, cols]
    if wide_float(seed.device) == torch.float64:  # the same top 24 bits, 29 more from a second mix
        return ((h << 21) | (_mix32(h ^ 0x2545F491) >> 11)).to(torch.float64) * (1.0 / (1 << 53))
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


@dataclass(frozen=True)
class Filters:
    """Which filters some request of the batch uses, known on the host when requests join, so that
    `process_logits` skips the others without reading anything back. Skipping never changes a row: a row
    that does not filter keeps all its tokens either way. k_max: the largest top_k > 0 (0: none);
    top_p: some top_p < 1; min_p: some min_p > 0; greedy: some temperature is below GREEDY_TEMPERATURE;
    p_without_k: some top_p < 1 has no top_k (its nucleus is searched in the whole vocabulary)."""
    k_max: int = 0
    top_p: bool = False
    min_p: bool = False
    greedy: bool = True
    p_without_k: bool = False

    def add(self, temperature: float, top_p: float, top_k: int, min_p: float) -> "Filters":
        """These filters and one more request's."""
        if temperature < GREEDY_TEMPERATURE:
            return Filters(self.k_max, self.top_p, self.min_p, True, self.p_without_k)
        return Filters(max(self.k_max, int(top_k)), self.top_p or top_p < 1, self.min_p or min_p > 0, self.greedy,
                       self.p_without_k or (top_p < 1 and top_k <= 0))

    @staticmethod
    def of(temperature: Tensor, top_p: Tensor, top_k: Tensor, min_p: Optional[Tensor]) -> "Filters":
        """From the per-request tensors (reads them back: for tests and one-off calls, not the decode loop)."""
        k = top_k[top_k > 0]
        return Filters(int(k.max()) if k.numel() else 0, bool((top_p < 1).any()),
                       bool(min_p is not None and (min_p > 0).any()),
                       bool((temperature < GREEDY_TEMPERATURE).any()), bool(((top_p < 1) & (top_k <= 0)).any()))


_RADIX = ((20, 11), (10, 10), (0, 10))  # (shift, bits): float32 bit patterns in three digits, high to low
RADIX_MIN_VOCAB = 8192  # smaller vocabularies sort: as fast, and no histograms of 2048 buckets per row


def sorted_floor(sv: Tensor, goal: Tensor) -> Tensor:
    """sv [R, K] non-negative float32 sorted largest first (every positive value of a row at least as large as
    any value left out), goal [R] -> [R] int32: the bit pattern of the least likely value whose strictly more
    likely values hold less than goal (the largest value when none does)."""
    mass = sv.to(goal.dtype)
    above = mass.cumsum(-1) - mass  # mass before each sorted position; ties: the first of a run counts
    n = (above < goal[:, None]).sum(-1)  # a prefix: `above` never decreases
    floor = sv.view(torch.int32).gather(1, (n - 1).clamp(min=0)[:, None])[:, 0]
    return torch.where(n > 0, floor, sv[:, 0].view(torch.int32))


def nucleus_floor(probs: Tensor, top_p: Tensor, radix: Optional[bool] = None) -> Tensor:
    """probs [R, V] non-negative float32 (unnormalised), top_p [R] -> [R] int32: the bit pattern of the least
    likely probability top-p keeps. A token stays when the mass of strictly more likely tokens is below
    top_p times the total, so tokens tied in probability stay or go together, like top-k's ties. Masses are
    summed in the device's widest float. When top_p keeps nothing (top_p <= 0), the floor is the largest
    probability.

    A vocabulary of RADIX_MIN_VOCAB tokens or more is not sorted (a stable sort of [12, 128k] costs 160 ms on
    one CPU thread, this less than half): non-negative floats order as their int32 bit patterns, so a radix
    select over three digits finds the boundary value, each digit from a histogram of the mass in its
    buckets. Smaller ones sort (`radix` forces either). Nothing depends on the other rows, so a row's result
    is the same in any batch."""
    R, V = probs.shape
    acc = wide_float(probs.device)
    w = torch.where(probs > 0, probs, torch.zeros_like(probs))  # NaN and -0.0 to +0.0: bit patterns >= 0
    goal = top_p.to(acc) * w.to(acc).sum(-1)  # [R] the mass the more likely tokens must stay below
    if not (V >= RADIX_MIN_VOCAB if radix is None else radix):
        return sorted_floor(w.sort(-1, descending=True).values, goal)
    bits = w.view(torch.int32)
    mass = w.to(acc)
    base = torch.zeros(R, dtype=acc, device=probs.device)  # mass above the bucket chosen so far
    floor = torch.zeros(R, dtype=torch.int32, device=probs.device)
    found = None
    for shift, nbits in _RADIX:
        size = 1 << nbits
        # this digit of the values inside the bucket chosen so far, +1; 0 for values below it, size+1 above
        key = (bits >> shift).sub_((floor >> shift)[:, None]).clamp_(-1, size).add_(1).to(torch.int64)
        hist = torch.zeros(R, size + 2, dtype=acc, device=probs.device).scatter_add_(1, key, mass)[:, 1:-1]
        above = base[:, None] + (hist.flip(-1).cumsum(-1).flip(-1) - hist)  # mass of larger digits in the bucket
        ok = (hist > 0) & (above < goal[:, None])  # buckets whose largest value stays
        ar = torch.arange(size, device=probs.device)
        digit = torch.where(ok, ar, torch.full_like(ar, size)).min(-1).values  # the lowest of them
        found = digit < size if found is None else found
        digit = digit.clamp(max=size - 1)
        base = above.gather(1, digit[:, None])[:, 0]
        floor = floor | (digit.to(torch.int32) << shift)
    return torch.where(found, floor, bits.max(-1).values)


def process_logits(logits: Tensor, temperature: Tensor, top_p: Tensor, top_k: Tensor,
                   min_p: Optional[Tensor] = None, filters: Optional[Filters] = None) -> Tensor:
    """logits [B,N,V], per-request temperature/top_p/min_p [B] float, top_k [B] int -> probs [B,N,V] float32.

    softmax(logits / T), keep the top_k most likely and every token tied with the k-th (as HF's TopKLogitsWarper
    and vLLM; top_k <= 0: all), then among those the nucleus: each token whose strictly more likely tokens hold
    less than top_p of their mass (`nucleus_floor`; top_p >= 1: all; never less than the most likely token, even
    when a tiny top_p rounds to 0 in float32), then drop tokens less likely than min_p times the most likely (HF's
    MinPLogitsWarper, after top-k and top-p as in HF; min_p <= 0: none), renormalise. T < GREEDY_TEMPERATURE is
    greedy: a one-hot at the argmax of the logits as given (float64 logits: their own argmax, as plain greedy
    decoding takes it), so greedy and sampled requests share one batch.

    `filters` says which filters some row uses (the pipeline knows it on the host); None reads it from the
    tensors. With none, this is a softmax: no sort or top-k over the vocabulary.
    """
    B, N, V = logits.shape
    f = Filters.of(temperature, top_p, top_k, min_p) if filters is None else filters
    x = logits.float()
    greedy = temperature < GREEDY_TEMPERATURE  # [B]
    t = torch.where(greedy, torch.ones_like(temperature), temperature).float()
    probs = torch.softmax(x / t[:, None, None], dim=-1)
    kept = probs
    if f.k_max > 0:
        K = min(f.k_max, V)
        top = probs.topk(K, dim=-1).values  # [B,N,K] sorted, largest first
        k = top_k.clamp(1, K)
        kth = top.gather(-1, (k - 1).view(B, 1, 1).expand(B, N, 1))  # [B,N,1] the k-th largest probability
        keep = (probs >= kth) | (top_k <= 0)[:, None, None]
        kept = torch.where(keep, probs, torch.zeros_like(probs))
    if f.top_p:
        # a row with top-k finds its nucleus among its top values; one without, in the whole vocabulary. Each row
        # is always searched its own way, so its result does not depend on the batch.
        floor = None
        if f.p_without_k or f.k_max == 0:
            floor = nucleus_floor(kept.reshape(B * N, V), top_p.repeat_interleave(N)).view(B, N, 1)
        if f.k_max > 0:
            acc = wide_float(probs.device)
            goal = top_p.to(acc)[:, None] * kept.to(acc).sum(-1)  # [B,N] (ties of the k-th beyond K counted too)
            head = torch.where(top >= kth, top, torch.zeros_like(top))
            in_top = sorted_floor(head.reshape(B * N, K), goal.reshape(-1)).view(B, N, 1)
            floor = in_top if floor is None else torch.where((top_k > 0)[:, None, None], in_top, floor)
        nucleus = (kept.view(torch.int32) >= floor) | (top_p >= 1)[:, None, None]
        kept = torch.where(nucleus, kept, torch.zeros_like(kept))
    if f.min_p and min_p is not None:  # relative to the most likely: the same before or after renormalising
        most = kept.amax(-1, keepdim=True)
        kept = torch.where(kept >= min_p.float()[:, None, None] * most, kept, torch.zeros_like(kept))
    out = kept / kept.sum(-1, keepdim=True)
    if not f.greedy:
        return out
    onehot = torch.zeros_like(out).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)  # F.one_hot reads ids back
    return torch.where(greedy[:, None, None], onehot, out)


def sample_tokens(probs: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF sampling: probs [B,V] (unnormalised, non-negative), u [B] in [0,1) -> ids [B].

    The cumulative sum has u's precision (float64 where the device has it): in float32 it steps by 2^-24 of
    the total, so each token below that share got either nothing or a whole step. Never returns a zero-mass
    id (the first cdf entry strictly above u*total has positive mass).
    """
    cdf = probs.to(u.dtype).cumsum(-1)
    t = (u * cdf[:, -1])[:, None]  # below the total: for u < 1, IEEE rounding never reaches it
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
    def probs(self, logits: Tensor, temperature: Tensor, top_p: Tensor, top_k: Tensor, min_p: Tensor,
              filters: Optional[Filters] = None) -> Tensor:
        return process_logits(logits, temperature, top_p, top_k, min_p, filters)

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
