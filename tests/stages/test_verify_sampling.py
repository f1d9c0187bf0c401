"""Unit tests of the sampling verifier: logits processing, coins, output contract, greedy parity."""
import math

import pytest
import torch

from specpipe.stages import verify_sampling
from specpipe.stages.build_tree import BuildTree
from specpipe.stages.verify import Verify
from specpipe.stages.verify_sampling import (STREAM_ACCEPT, STREAM_BONUS, VerifySampling, chain_rejection_sample,
                                             position_coins, position_sample, process_logits, sample_tokens,
                                             uniform_coins)


def rows(*vals):
    return torch.tensor(vals)


def test_process_logits_temperature_topk_topp():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = p.log()[None, None].expand(6, 1, 4)
    out = process_logits(logits, rows(1.0, 2.0, 1.0, 1.0, 1.0, 0.0), rows(1.0, 1.0, 1.0, 0.75, 0.8, 1.0),
                         rows(0, 0, 2, 0, 3, 0))[:, 0]
    torch.testing.assert_close(out[0], p)
    torch.testing.assert_close(out[1], torch.softmax(p.log() / 2, -1))
    torch.testing.assert_close(out[2], torch.tensor([0.625, 0.375, 0, 0]))  # top_k=2
    torch.testing.assert_close(out[3], torch.tensor([0.625, 0.375, 0, 0]))  # top_p=0.75
    # top_k=3 first (0.5, 0.3, 0.15)/0.95, then top_p=0.8 drops the third (mass before it 0.84)
    torch.testing.assert_close(out[4], torch.tensor([0.625, 0.375, 0, 0]))
    assert out[5].tolist() == [1.0, 0.0, 0.0, 0.0]  # temperature 0: greedy one-hot


def test_process_logits_min_p_after_top_k_and_top_p_as_hf():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = p.log()[None, None].expand(4, 1, 4)
    out = process_logits(logits, rows(1.0, 1.0, 1.0, 0.0), rows(1.0, 1.0, 0.8, 1.0), rows(0, 0, 0, 0),
                         rows(0.0, 0.5, 0.7, 0.9))[:, 0]
    torch.testing.assert_close(out[0], p)  # 0: off
    torch.testing.assert_close(out[1], torch.tensor([0.625, 0.375, 0, 0]))  # 0.15 < 0.5 * 0.5
    torch.testing.assert_close(out[2], torch.tensor([1.0, 0, 0, 0]))  # top_p keeps 3, then 0.3 < 0.7 * 0.5
    assert out[3].tolist() == [1.0, 0.0, 0.0, 0.0]  # greedy ignores it
    transformers = pytest.importorskip("transformers")
    g = torch.Generator().manual_seed(3)
    logits = 3 * torch.randn(6, 200, generator=g, dtype=torch.float64)
    T, P, K, M = [0.7, 1.0, 1.3, 0.9, 1.0, 0.5], [1.0, 0.9, 0.95, 1.0, 0.8, 0.99], [0, 0, 40, 20, 0, 5], \
        [0.05, 0.1, 0.02, 0.3, 0.0, 0.2]
    out = process_logits(logits[:, None], torch.tensor(T), torch.tensor(P), torch.tensor(K), torch.tensor(M))[:, 0]
    for b in range(6):
        x = logits[b:b + 1] / T[b]
        if K[b]:
            x = transformers.TopKLogitsWarper(K[b])(None, x)
        x = transformers.TopPLogitsWarper(P[b])(None, x) if P[b] < 1 else x
        x = transformers.MinPLogitsWarper(M[b])(None, x) if M[b] > 0 else x
        ref = torch.softmax(x, -1)[0]
        assert torch.equal(out[b] > 0, ref > 0), b  # the same tokens kept
        torch.testing.assert_close(out[b].double(), ref, rtol=1e-5, atol=1e-6)


def test_greedy_rows_take_the_argmax_of_the_logits_as_given():
    """A float64 run's greedy rows pick what plain greedy decoding picks, though float32 rounds the two
    largest logits to one value."""
    logits = torch.tensor([[[1.0, 1.0 + 1e-12, 0.0]]], dtype=torch.float64)
    out = process_logits(logits, rows(0.0), rows(1.0), rows(0))
    assert out[0, 0].tolist() == [0.0, 1.0, 0.0]


def test_process_logits_keeps_at_least_one_token_and_normalises():
    logits = torch.randn(3, 5, 50)
    out = process_logits(logits, rows(0.5, 1.0, 3.0), rows(1e-6, 0.3, 0.9), rows(1, 0, 7))
    torch.testing.assert_close(out.sum(-1), torch.ones(3, 5))
    nz = (out > 0).sum(-1)
    assert (nz[0] == 1).all() and (nz[2] <= 7).all() and (nz >= 1).all()
    assert (out[0].argmax(-1) == logits[0].argmax(-1)).all()


def test_process_logits_keeps_top_k_ties_and_the_whole_tail_at_top_p_one():
    """Every token tied with the k-th stays (HF's TopKLogitsWarper, vLLM), not the lowest ids among them; and
    top_p=1 keeps all tokens although float32's cumulative sum passes 1 before the tail."""
    logits = torch.tensor([1.0, 3.0, 2.0, 2.0, 2.0, 0.5])[None, None]
    out = process_logits(logits, rows(1.0), rows(1.0), rows(2))[0, 0]
    want = torch.softmax(torch.tensor([-math.inf, 3.0, 2.0, 2.0, 2.0, -math.inf]), -1)
    torch.testing.assert_close(out, want)
    g = torch.Generator().manual_seed(0)
    logits = 4 * torch.randn(2, 1, 32000, generator=g)
    out = process_logits(logits, rows(0.7, 1.0), rows(1.0, 1.0), rows(0, 0))
    ref = torch.softmax(logits.double() / torch.tensor([0.7, 1.0]).double()[:, None, None], -1)
    assert ((out > 0) == (ref > 0)).all()


def test_coins_deterministic_uniform_and_batch_independent():
    seed, ctr = torch.arange(20000) * 7919, torch.full((20000,), 123)
    u = uniform_coins(seed, ctr, 4, STREAM_ACCEPT)
    assert u.shape == (20000, 4) and u.dtype == torch.float64  # the CPU has float64: 53-bit coins
    assert (u >= 0).all() and (u < 1).all()
    assert torch.equal(u, uniform_coins(seed, ctr, 4, STREAM_ACCEPT))
    assert torch.equal(u[5:9], uniform_coins(seed[5:9], ctr[5:9], 4, STREAM_ACCEPT))  # no batch dependence
    assert torch.equal(u[:, :2], uniform_coins(seed, ctr, 2, STREAM_ACCEPT))
    flat = u.reshape(-1)
    assert abs(flat.mean().item() - 0.5) < 0.005 and abs(flat.var().item() - 1 / 12) < 0.002
    hist = torch.histc(flat, bins=10, min=0, max=1) / flat.numel()
    assert (hist - 0.1).abs().max() < 0.006
    others = [uniform_coins(seed, ctr + 1, 4, STREAM_ACCEPT), uniform_coins(seed, ctr, 4, STREAM_BONUS),
              uniform_coins(seed + 1, ctr, 4, STREAM_ACCEPT), u.roll(1, dims=1)]  # last: column vs column
    for v in others:
        c = torch.corrcoef(torch.stack([flat, v.reshape(-1)]))[0, 1].abs().item()
        assert c < 0.02
    assert uniform_coins(torch.tensor([-1, 2 ** 40]), torch.tensor([0, 5]), 3, 1).shape == (2, 3)


def test_coins_have_more_than_32_bits():
    """2^20 coins of 24 (or 32) bits collide by the birthday bound (about 32k, or 128, equal pairs); 53-bit
    coins practically never do."""
    u = uniform_coins(torch.tensor([12345]), torch.tensor([7]), 1 << 20, STREAM_ACCEPT)[0]
    assert u.unique().numel() == u.numel()


def test_sample_tokens_resolves_tokens_below_a_float32_step():
    """A 128k vocabulary whose tail tokens each hold 2e-8 (less than float32's 2^-24 step near 1): a coin in
    the middle of a tail token's exact interval draws that token. A float32 cumulative sum gave two of every
    three such tokens no interval at all, and a 24-bit coin could not land in one."""
    V, eps = 128 * 1024, 2e-8
    p = torch.full((V,), eps, dtype=torch.float64)
    p[0] = 1 - eps * (V - 1)
    p = p.float().double()  # the float32 values the sampler gets
    cdf = p.cumsum(0)
    ids = torch.arange(1, V, 97)
    u = (cdf[ids] - p[ids] / 2) / cdf[-1]  # float64 coins, as uniform_coins gives on this device
    got = sample_tokens(p.float()[None].expand(ids.numel(), V), u)
    assert torch.equal(got, ids)


def test_sample_tokens_never_picks_zero_mass():
    p = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).expand(5, 5)
    u = torch.tensor([0.0, 0.4999, 0.5, 0.9999999, 0.75])
    assert sample_tokens(p, u).tolist() == [1, 1, 3, 3, 3]


def random_tree(B, K, S, N, V, seed):
    g = torch.Generator().manual_seed(seed)
    M = K + (S - 1) * K * K
    scores = torch.rand(B, M, generator=g).sort(-1, descending=True).values  # roughly ancestor-closed
    score_list = [scores[:, :K].view(B, 1, K)] + [scores[:, K + K * K * i: K + K * K * (i + 1)].view(B, K, K)
                                                   for i in range(S - 1)]
    token_list = [torch.randint(V, (B, s.numel() // B), generator=g) for s in score_list]
    parents = [torch.arange(-1, K).expand(B, K + 1)] + [
        torch.stack([torch.randperm(K * K, generator=g)[:K] for _ in range(B)]) + K * K * i + K for i in range(S - 1)]
    return BuildTree(K, S, N)(torch.randint(V, (B,), generator=g), score_list, token_list, parents,
                              torch.full((B,), 10))


@pytest.mark.parametrize("K,S,N", [(1, 4, 5), (2, 3, 6), (3, 2, 9), (4, 3, 10)])
def test_greedy_rows_match_verify_greedy(K, S, N):
    B, V = 256, 4  # small vocabulary: the target's argmax often agrees with a draft
    tree = random_tree(B, K, S, N, V, seed=K * 10 + S)
    logits = torch.randn(B, N, V, generator=torch.Generator().manual_seed(1))
    zeros = torch.zeros(B)
    probs = process_logits(logits, zeros, torch.ones(B), torch.zeros(B, dtype=torch.long))
    acc, count, commit = VerifySampling(S).sample(probs, tree.tokens, tree.parent, torch.arange(B), zeros.long())
    g_acc, g_count, g_commit = Verify(None, S).greedy(logits.argmax(-1), tree.tokens, tree.parent, tree.mask)
    assert torch.equal(acc, g_acc) and torch.equal(count, g_count)
    keep = torch.arange(S + 1) <= count[:, None]
    assert torch.equal(commit[keep], g_commit[keep])
    assert count.max() >= 2


@pytest.mark.parametrize("K,S,N", [(1, 3, 4), (2, 3, 7), (3, 2, 6)])
def test_output_contract(K, S, N):
    B, V = 512, 6
    tree = random_tree(B, K, S, N, V, seed=3)
    probs = process_logits(torch.randn(B, N, V), torch.full((B,), 0.8), torch.full((B,), 0.9),
                           torch.zeros(B, dtype=torch.long))
    acc, count, commit = VerifySampling(S).sample(probs, tree.tokens, tree.parent, torch.arange(B),
                                                  torch.full((B,), 4))
    assert acc.shape == (B, S + 1) and commit.shape == (B, S + 1) and count.shape == (B,)
    d = torch.arange(S + 1)
    assert ((acc >= 0) == (d <= count[:, None])).all() and (acc[:, 0] == 0).all()
    for i in range(S):  # consecutive path entries are parent -> child, tokens are the committed drafts
        m = i < count
        assert (tree.parent[m].gather(1, acc[m, i + 1:i + 2])[:, 0] == acc[m, i]).all()
        assert (tree.tokens[m].gather(1, acc[m, i + 1:i + 2])[:, 0] == commit[m, i]).all()
    bonus = commit.gather(1, count[:, None])
    assert (commit[d > count[:, None]] == bonus.expand(-1, S + 1)[d > count[:, None]]).all()
    # after a rejection the bonus is never one of the rejected children's tokens
    last = acc.gather(1, count[:, None])
    kids = tree.parent == last
    rejected = (count < S) & kids.any(-1)
    clash = (kids & (tree.tokens == bonus))[rejected]
    assert not clash.any()
    assert (probs.gather(1, last[:, :, None].expand(-1, 1, V))[:, 0].gather(1, bonus) > 0).all()


def test_unlinked_and_duplicate_children():
    """Unlinked nodes are never accepted; a token repeated among siblings keeps its probability."""
    B, V = 20000, 3
    tokens = torch.tensor([[0, 1, 1, 2]]).expand(B, 4)
    parent = torch.tensor([[-1, 0, 0, -1]]).expand(B, 4)  # node 3 (token 2) is unlinked
    probs = torch.tensor([0.5, 0.2, 0.3]).expand(B, 4, V)
    u = position_coins(torch.arange(B), torch.zeros(B, dtype=torch.long), 3)
    acc, count, commit = position_sample(probs, tokens, parent, u, 2)
    assert set(acc[:, 1].tolist()) <= {-1, 1}
    first = commit[:, 0]
    freq = torch.bincount(first, minlength=V).double() / B
    assert (freq - torch.tensor([0.5, 0.2, 0.3], dtype=torch.double)).abs().max() < 0.015


def test_rejection_mode_equal_draft_accepts_everything_and_zero_residual_falls_back():
    B, V, S = 64, 5, 3
    tokens = torch.randint(V, (B, S + 1))
    parent = torch.arange(-1, S).expand(B, S + 1)
    probs = torch.softmax(torch.randn(B, S + 1, V), -1)
    seed, ctr = torch.arange(B), torch.zeros(B, dtype=torch.long)
    _, count, _ = VerifySampling(S).sample_rejection(probs, probs, tokens, parent, seed, ctr)
    assert (count == S).all()
    # a draft sampled from the target's own distribution is always accepted, even with a coin near 1
    probs = torch.tensor([[[0.4, 0.6], [0.5, 0.5]]])
    acc, count, commit = chain_rejection_sample(probs, torch.tensor([[0, 1]]), torch.tensor([[-1, 0]]),
                                                torch.tensor([[0.999, 0.0]]), torch.tensor([0.3]), 1, probs)
    assert count.item() == 1 and commit[0, 0].item() == 1 and not math.isnan(commit.float().sum().item())


def test_stage_branches():
    assert VerifySampling.branch_names() == ["probs", "sample", "sample_rejection"]


def _nucleus_reference(p: torch.Tensor, top_p: float) -> torch.Tensor:
    """The definition, in float64: token i stays when the tokens strictly more likely hold less than top_p of
    the mass (ties stay or go together), and the most likely always stays. (The mass above each token comes
    from one descending sort: a [V, V] brute force took minutes at V=20000.)"""
    x = p.double()
    d = x.sort(descending=True).values
    before = torch.cat((d.new_zeros(1), d.cumsum(0)))  # before[k]: the mass of the k most likely
    more = x.numel() - torch.searchsorted(d.flip(0), x, right=True)  # how many are strictly more likely
    above = before[more]
    return ((above < top_p * x.sum()) & (x > 0)) | (x == x.max())


@pytest.mark.parametrize("radix", [True, False])
@pytest.mark.parametrize("case", range(12))
def test_nucleus_matches_brute_force_with_ties_and_zeros(case, radix, monkeypatch):
    """Both ways of finding the nucleus (a radix select for large vocabularies, a sort for small ones)."""
    monkeypatch.setattr(verify_sampling, "RADIX_MIN_VOCAB", 0 if radix else 1 << 30)
    g = torch.Generator().manual_seed(case)
    V = int(torch.randint(2, 400, (1,), generator=g))
    p = torch.softmax(torch.randn(6, V, generator=g) * float(1 + 6 * torch.rand(1, generator=g)), -1)
    if case % 3 == 0:
        p = torch.where(torch.rand(6, V, generator=g) < 0.4, p, torch.zeros_like(p))  # top-k's zeros
    if case % 2 == 0:
        p = (p * 40).round() / 40  # many exact ties
    p[0, 0] = p[0].max()  # a tie at the top
    top_p = torch.rand(6, generator=g)
    top_p[1] = 0.0
    top_p[2] = 1e-9
    out = process_logits(torch.where(p > 0, p.log(), torch.full_like(p, -math.inf))[:, None],
                         torch.ones(6), top_p, torch.zeros(6, dtype=torch.long))[:, 0]
    for r in range(6):
        want = _nucleus_reference(torch.softmax(torch.where(p[r] > 0, p[r].log(), -math.inf), -1), float(top_p[r]))
        assert torch.equal(out[r] > 0, want), (case, r)


def test_a_rows_probabilities_do_not_depend_on_the_filters_of_its_batch():
    """Filters are skipped when no row uses them; a row's probabilities are bitwise the same alone (its own
    filters only) and beside rows that use top-k, top-p, min-p and greedy."""
    g = torch.Generator().manual_seed(5)
    logits = 4 * torch.randn(5, 3, 1000, generator=g)
    T = torch.tensor([0.8, 1.1, 0.6, 0.0, 1.0])
    P = torch.tensor([1.0, 0.9, 0.95, 1.0, 0.7])
    K = torch.tensor([0, 0, 40, 0, 3])
    M = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.2])
    together = process_logits(logits, T, P, K, M)
    for r in range(5):
        alone = process_logits(logits[r:r + 1], T[r:r + 1], P[r:r + 1], K[r:r + 1], M[r:r + 1])
        assert torch.equal(alone, together[r:r + 1]), r


def _aten_ops(fn) -> set:
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = set()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Record():
        fn()
    return seen


def test_no_sort_over_the_vocabulary():
    """Temperature alone is a softmax; top-k a top-k; top-p a radix select; none of them sorts the vocabulary
    (a stable sort of [12, 128k] costs 160 ms on one CPU thread)."""
    logits = torch.randn(2, 4, 20000)  # a vocabulary large enough for the radix select
    one, zero = torch.ones(2), torch.zeros(2)
    k0 = torch.zeros(2, dtype=torch.long)
    temp_only = _aten_ops(lambda: process_logits(logits, one * 0.7, one, k0, zero))
    assert not temp_only & {"sort", "topk", "scatter_add_", "cumsum"}, temp_only
    top_k = _aten_ops(lambda: process_logits(logits, one, one, k0 + 50, zero))
    assert "topk" in top_k and "sort" not in top_k
    top_p = _aten_ops(lambda: process_logits(logits, one, one * 0.9, k0, zero))
    assert "sort" not in top_p and "topk" not in top_p
    both = _aten_ops(lambda: process_logits(logits, one, one * 0.9, k0 + 20, zero))
    assert "sort" not in both and "scatter_add_" not in both  # the nucleus among the top-k values


@pytest.mark.parametrize("case", range(8))
def test_top_k_then_top_p_matches_brute_force_and_each_row_keeps_its_own_way(case):
    """A row with top-k searches its nucleus among its top values, one without in the whole vocabulary; both
    equal the brute force (ties of the k-th included: bf16-like logits), and a row gives the same
    probabilities alone as beside a row of the other kind."""
    g = torch.Generator().manual_seed(100 + case)
    V = 20000 if case % 2 else 600  # the radix select and the sort for rows without top-k
    logits = (torch.randn(4, 2, V, generator=g) * 3).to(torch.bfloat16).float()  # few distinct values: ties
    T = torch.tensor([1.0, 0.8, 1.2, 0.9])
    P = torch.rand(4, generator=g) * 0.9 + 0.05
    K = torch.tensor([int(torch.randint(1, 60, (1,), generator=g)), 0, 5,
                      int(torch.randint(1, 3000, (1,), generator=g))])
    out = process_logits(logits, T, P, K)
    for b in range(4):
        probs = torch.softmax(logits[b] / T[b], -1)
        for n in range(2):
            p = probs[n]
            if K[b] > 0:
                p = torch.where(p >= p.topk(min(int(K[b]), V)).values[-1], p, torch.zeros_like(p))  # top_k > V: all
            assert torch.equal(out[b, n] > 0, _nucleus_reference(p, float(P[b]))), (case, b, n)
        alone = process_logits(logits[b:b + 1], T[b:b + 1], P[b:b + 1], K[b:b + 1])
        assert torch.equal(alone, out[b:b + 1]), (case, b)
