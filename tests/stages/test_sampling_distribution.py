"""Speculative sampling must commit tokens with exactly the target's sampling distribution.

Synthetic Markov models over a small vocabulary stand in for the target and the draft: the next-
token logits depend only on the previous token (tables [V, V]). Trees are built the way the
pipeline builds them (DraftTopK blocks -> BuildTree), verified by VerifySampling, and rounds are
repeated until every row has its first T tokens. Their joint histogram over ~12k rows per
sampling-parameter group is compared with the exact law prod_t p(x_t | x_{t-1}) by a chi-square
test. Every test uses fixed seeds, so it is deterministic; the nominal false-alarm rate of each
chi-square check (one per parameter group) is alpha = 1e-4, about 0.25% for the ~24 checks of the
file, and the deliberately wrong verifiers give p-values below 1e-9 (0.0 in practice).
"""
import math
import sys

import pytest
import torch

from specpipe.stages.build_tree import BuildTree
from specpipe.stages.draft_forward import top_k
from specpipe.stages.draft_topk import DraftTopK
from specpipe.stages.verify_sampling import (STREAM_BONUS, STREAM_DRAFT, VerifySampling, process_logits,
                                             sample_tokens, uniform_coins)

from helpers import chi2_pvalue, chi2_sf  # noqa: F401

ALPHA = 1e-4
ROWS = 12000  # per parameter group
GROUPS = [(1.0, 1.0, 0), (0.7, 0.8, 0), (1.5, 1.0, 4)]  # (temperature, top_p, top_k)
ROOT = 3


def tables(V: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(V, V, generator=g) * 1.5
    draft = target + torch.randn(V, V, generator=g) * 1.0  # related but different
    return target, draft


def params(B_per: int):
    t, p, k = (torch.tensor([g[i] for g in GROUPS]).repeat_interleave(B_per) for i in range(3))
    return t.float(), p.float(), k.long()


def draft_tree(draft_logits, root, counter, seed, K, S, N, sampled, sp):
    """Build a tree from the draft table exactly as the pipeline does. sampled (K=1 only): each
    chain token is sampled from the processed draft distribution q, and q rows are returned."""
    B = root.shape[0]
    stage = DraftTopK(K)
    hid = torch.zeros(B, 0)
    coins = uniform_coins(seed, counter, S, STREAM_DRAFT)
    qs = []

    def pick(x, step):  # x [R] previous tokens -> ([R,K] probs, [R,K] ids)
        if not sampled:
            return top_k(draft_logits[x], K)
        q = process_logits(draft_logits[x][:, None], *sp)[:, 0]
        qs.append(q)
        tok = sample_tokens(q, coins[:, step])[:, None]
        return q.gather(1, tok), tok

    tp, ti = pick(root, 0)
    ids, hid, scores, pb, blk = stage(0, tp, ti, hid, None)
    blocks = [blk]
    for i in range(1, S):
        tp, ti = pick(ids, i)
        ids, hid, scores, pb, blk = stage(i, tp, ti, hid, scores)
        blocks.append(blk)
    s_l, t_l, p_l = (list(x) for x in zip(*blocks))
    tree = BuildTree(K, S, N)(root, s_l, t_l, p_l, counter)
    draft_probs = torch.stack(qs + [torch.zeros_like(qs[0])], 1)[:, :N] if sampled else None
    return tree, draft_probs


def simulate(K, S, N, T=2, V=8, sampled=False, rejection=False, corrupt=None, seed_base=0):
    """First T committed tokens of every row: [B, T]."""
    target_logits, draft_logits = tables(V)
    sp = params(ROWS)
    B = sp[0].shape[0]
    seed = torch.arange(B) + seed_base
    vs = VerifySampling(S)
    out = torch.zeros(B, T + S + 1, dtype=torch.int64)
    filled = torch.zeros(B, dtype=torch.int64)
    root = torch.full((B,), ROOT)
    while filled.min() < T:
        counter = 7 + filled  # plays seq_lens: strictly increasing per row
        tree, dp = draft_tree(draft_logits, root, counter, seed, K, S, N, sampled, sp)
        probs = process_logits(target_logits[tree.tokens], *sp)  # [B, N, V]
        if rejection:
            acc, count, commit = vs.sample_rejection(probs, dp, tree.tokens, tree.parent, seed, counter)
        else:
            acc, count, commit = vs.sample(probs, tree.tokens, tree.parent, seed, counter)
        if corrupt is not None:
            commit = corrupt(probs, dp, acc, count, commit, seed, counter)
        active = filled < T  # finished rows keep running but record nothing
        for i in range(S + 1):
            m = active & (i <= count)
            out[m, filled[m] + i] = commit[m, i]
        filled = torch.where(active, filled + count + 1, filled)
        root = commit.gather(1, count[:, None])[:, 0]
    return out[:, :T], sp, target_logits


def check(out, sp, target_logits, V, T):
    """One chi-square test per parameter group; returns the smallest p-value."""
    pvals = []
    for g in range(len(GROUPS)):
        rows = slice(g * ROWS, (g + 1) * ROWS)
        P = process_logits(target_logits[None], *(x[rows][:1] for x in sp))[0]  # [V, V] p(next | prev)
        law = P[ROOT]
        for t in range(1, T):
            law = law[..., None] * P  # [V]*(t+1): p(x_1..x_t) p(x_{t+1} | x_t)
        cell = torch.zeros(out[rows].shape[0], dtype=torch.int64)
        for t in range(T):
            cell = cell * V + out[rows][:, t]
        counts = torch.bincount(cell, minlength=V ** T)
        pvals.append(chi2_pvalue(counts, law.reshape(-1)))
    return min(pvals)


def test_chi2_sf_matches_tables():
    assert chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, rel=1e-6)
    assert chi2_sf(11.070497693516351, 5) == pytest.approx(0.05, rel=1e-6)
    assert chi2_sf(124.34211340400407, 100) == pytest.approx(0.05, rel=1e-6)
    closed = math.exp(-0.25) * sum(0.25 ** i / math.factorial(i) for i in range(5))  # even k: Poisson sum
    assert chi2_sf(0.5, 10) == pytest.approx(closed, rel=1e-12)
    assert chi2_sf(30.0, 10) == pytest.approx(math.exp(-15) * sum(15 ** i / math.factorial(i) for i in range(5)))
    assert chi2_sf(1e-9, 3) == pytest.approx(1.0)


@pytest.mark.parametrize("K,S,N,T,V,sampled,rejection", [
    (1, 3, 4, 2, 8, False, False),  # deterministic chain, target-only
    (1, 3, 4, 2, 8, True, True),  # sampled chain, rejection sampling with draft probs
    (1, 3, 3, 3, 6, True, True),  # N below the chain length, three tokens
    (1, 2, 3, 2, 8, True, False),  # sampled chain verified target-only (also lossless)
    (2, 2, 5, 2, 8, False, False),  # trees: target-only
    (2, 3, 6, 3, 6, False, False),
    (3, 3, 8, 2, 8, False, False),
])
def test_speculative_sampling_matches_target(K, S, N, T, V, sampled, rejection):
    out, sp, tl = simulate(K, S, N, T, V, sampled, rejection)
    assert check(out, sp, tl, V, T) > ALPHA


def test_a_sampled_chain_cut_short_stays_lossless_when_the_draft_is_sure(monkeypatch):
    """Running products of draft probabilities tie where the draft is sure of a token (q = 1.0: after top_p, min_p or
    top_k leave it one). BuildTree kept the N-1 best with topk, which broke the tie arbitrarily: a chain cut to
    N < S+1 nodes dropped a middle node depending on the token drafted before it (chi-square p = 0, TV 0.2)."""
    plain = tables

    def sure_after_some(V: int, seed: int = 0):
        target, draft = plain(V, seed)
        draft[:3] = 0.0
        draft[:3, 0] = 100.0  # after tokens 0, 1 and 2 the draft proposes token 0 with q = 1.0 exactly
        return target, draft

    monkeypatch.setattr(sys.modules[__name__], "tables", sure_after_some)
    out, sp, tl = simulate(1, 4, 3, 2, 6, sampled=True, rejection=True)
    assert check(out, sp, tl, 6, 2) > ALPHA


def test_target_only_sampling_matches_target():
    """The reference itself: sampling T tokens one by one from the processed target (N=1: no drafts)."""
    target_logits, _ = tables(8)
    sp = params(ROWS)
    B = sp[0].shape[0]
    seed = torch.arange(B)
    x, toks = torch.full((B,), ROOT), []
    for t in range(2):
        p = process_logits(target_logits[x][:, None], *sp)[:, 0]
        x = sample_tokens(p, uniform_coins(seed, torch.full((B,), t), 1, STREAM_BONUS)[:, 0])
        toks.append(x)
    assert check(torch.stack(toks, 1), sp, target_logits, 8, 2) > ALPHA


def _bonus_from_p(probs, dp, acc, count, commit, seed, counter):
    """Bug: the bonus is drawn from the target p at the last node, ignoring what was rejected."""
    last = acc.gather(1, count[:, None])[:, 0]
    p = probs[torch.arange(probs.shape[0]), last]
    bonus = sample_tokens(p, uniform_coins(seed, counter, 1, STREAM_BONUS)[:, 0])
    return commit.scatter(1, count[:, None], bonus[:, None])


@pytest.mark.parametrize("K,S,N,sampled,rejection", [
    (2, 2, 5, False, False),  # target-only tree, bonus from p instead of p minus rejected children
    (1, 3, 4, True, True),  # rejection sampling, bonus from p instead of norm(max(0, p - q))
])
def test_wrong_bonus_is_caught(K, S, N, sampled, rejection):
    out, sp, tl = simulate(K, S, N, 2, 8, sampled, rejection, corrupt=_bonus_from_p)
    assert check(out, sp, tl, 8, 2) < 1e-9


def test_rejection_sampling_on_argmax_chain_is_caught():
    """Misuse: draft probs with a deterministic (argmax) chain is biased (use target-only there)."""
    target_logits, draft_logits = tables(8)
    sp = params(ROWS)
    B = sp[0].shape[0]
    seed, counter, root = torch.arange(B), torch.full((B,), 7), torch.full((B,), ROOT)
    tree, _ = draft_tree(draft_logits, root, counter, seed, 1, 1, 2, False, sp)
    q = process_logits(draft_logits[tree.tokens], *sp)  # the draft's law, but the token was its argmax
    probs = process_logits(target_logits[tree.tokens], *sp)
    _, _, commit = VerifySampling(1).sample_rejection(probs, q, tree.tokens, tree.parent, seed, counter)
    out = commit[:, :1]
    assert check(out, sp, target_logits, 8, 1) < 1e-9
