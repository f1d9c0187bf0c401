"""Unit tests of the sampling verifier: logits processing, coins, output contract, greedy parity."""
import math

import pytest
import torch

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
    assert u.shape == (20000, 4) and u.dtype == torch.float32
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
