"""Standalone draft model, tested with the target itself as the draft.

Then the draft's greedy chain must be the target's own greedy continuation (every draft would be
accepted), round after round, whatever was committed in between; the tree blocks must equal those
of a naive drafter that recomputes every distribution with a full causal forward (no KV pool).
"""
import copy

import numpy as np
import pytest
import torch

from specpipe.allocators.token import TokenAllocator
from specpipe.drafters import StandaloneDrafter
from specpipe.models.attention_batch import extend_batch
from specpipe.models.random_tiny import build_random_tiny
from specpipe.stages.padding import bucket
from specpipe.stages.build_tree import BuildTree
from specpipe.stages.draft_forward import top_k
from specpipe.stages.draft_topk import DraftTopK
from specpipe.stages.prepare_decode import PrepareDecode
from specpipe.stages.verify_sampling import VerifySampling, process_logits

PROMPT_LENS = [5, 12, 1, 23]


@pytest.fixture(scope="module")
def target():
    return build_random_tiny(seed=0, dtype="float64").target


@torch.no_grad()
def next_logits(model, seq):
    return model.logits(model(torch.tensor([seq])))[0, -1]


def greedy(model, seq, n):
    seq = list(seq)
    for _ in range(n):
        seq.append(int(next_logits(model, seq).argmax()))
    return seq[-n:]


class Harness:
    """The pipeline's bookkeeping around a drafter: rows, prefill, commit, extend."""

    def __init__(self, target, topk, num_steps, num_draft_tokens, seed=0):
        self.target = target
        self.S, self.N = num_steps, num_draft_tokens
        self.drafter = StandaloneDrafter(copy.deepcopy(target), topk, num_steps, num_draft_tokens)
        alloc = TokenAllocator(2048)
        self.drafter.setup_kv(alloc.pool_slots)
        self.prep = PrepareDecode(alloc, 8, 128, torch.device("cpu"))
        g = torch.Generator().manual_seed(seed)
        self.ctx = [torch.randint(0, 250, (n,), generator=g).tolist() for n in PROMPT_LENS]
        B, T = len(self.ctx), max(PROMPT_LENS)
        self.rows = np.asarray([self.prep.acquire_row() for _ in range(B)])
        lens = np.asarray(PROMPT_LENS)
        assert self.prep.reserve(self.rows, lens)
        ids = torch.zeros(B, T, dtype=torch.int64)
        for b, c in enumerate(self.ctx):
            ids[b, :len(c)] = torch.tensor(c)
        self.rows_t, lens_t = torch.from_numpy(self.rows), torch.from_numpy(lens)
        with torch.no_grad():
            self.drafter.prefill(ids, extend_batch(self.prep.table, self.rows_t, torch.zeros_like(lens_t), lens_t,
                                                   T, bucket(T)))
        self.prep.commit(self.rows, lens)
        for c in self.ctx:  # the first token, sampled by the target's prefill: its greedy choice
            c.append(greedy(target, c, 1)[0])

    def draft(self, sampling=None):
        L = self.prep.seq_len[self.rows].copy()
        root = torch.tensor([c[-1] for c in self.ctx])
        with torch.no_grad():
            return self.drafter.draft(self.prep, self.rows, self.rows_t, L, torch.from_numpy(L), root, sampling)

    def commit(self, drafts, accepted, bonus):
        """Commit the root plus `accepted` drafts per request; `bonus` becomes the next root."""
        L = self.prep.seq_len[self.rows].copy()
        assert self.prep.reserve(self.rows, np.full(len(L), self.N))
        a = np.asarray(accepted)
        self.prep.commit(self.rows, L + a + 1)
        root = torch.tensor([c[-1] for c in self.ctx])
        ids = torch.cat([root[:, None], drafts], 1)[:, :self.S + 1]
        with torch.no_grad():
            self.drafter.extend_committed(self.prep.table, self.rows_t, torch.from_numpy(L), ids,
                                          torch.from_numpy(a + 1), int((L + a + 1).max()))
        for b, c in enumerate(self.ctx):
            c.extend(drafts[b, :a[b]].tolist() + [bonus[b]])


def build(blocks, h, K):
    s, t, p = (list(x) for x in zip(*blocks))
    root = torch.tensor([c[-1] for c in h.ctx])
    return BuildTree(K, h.S, h.N)(root, s, t, p, torch.from_numpy(h.prep.seq_len[h.rows].copy()))


def test_greedy_chain_is_the_targets_continuation(target):
    S = 4
    h = Harness(target, 1, S, S + 1)
    plans = [[S, 1, 0, 2], [0, S, 3, 1], [2, 2, S, 0]]  # drafts accepted per request and round
    for rnd, accepted in enumerate(plans):
        blocks, probs = h.draft()
        assert probs is None
        chain = build(blocks, h, 1).tokens[:, 1:]
        for b, c in enumerate(h.ctx):
            assert chain[b].tolist() == greedy(target, c, S), (rnd, b)
        # full acceptance takes the target's bonus; otherwise a token the draft did not propose
        bonus = [greedy(target, h.ctx[b] + chain[b].tolist(), 1)[0] if a == S else (int(chain[b, a]) + 7) % 250
                 for b, a in enumerate(accepted)]
        h.commit(chain, accepted, bonus)
    assert h.prep.seq_len[h.rows].tolist() == [len(c) - 1 for c in h.ctx]


def naive_blocks(target, ctx, K, S):
    """The EAGLE draft loop with every distribution recomputed by a full causal forward."""
    B = len(ctx)
    stage = DraftTopK(K)
    tp, ti = top_k(torch.stack([next_logits(target, c) for c in ctx]), K)
    ids, hid, scores, pb, blk = stage(0, tp, ti, torch.zeros(B, 0), None)
    paths = [[ctx[b] + [int(ids[b * K + k])] for k in range(K)] for b in range(B)]
    blocks = [blk]
    for i in range(1, S):
        tp, ti = top_k(torch.stack([next_logits(target, p) for row in paths for p in row]), K)
        ids, hid, scores, pb, blk = stage(i, tp, ti, hid, scores)
        paths = [[paths[b][int(pb[b, k])] + [int(ids[b * K + k])] for k in range(K)] for b in range(B)]
        blocks.append(blk)
    return blocks


@pytest.mark.parametrize("K,S,N", [(2, 3, 6), (3, 2, 7)])
def test_tree_blocks_match_naive_drafter(target, K, S, N):
    h = Harness(target, K, S, N, seed=K)
    for accepted in ([1, 0, S - 1, 1], None):
        blocks, _ = h.draft()
        want = naive_blocks(target, h.ctx, K, S)
        for (s, t, p), (ws, wt, wp) in zip(blocks, want):
            torch.testing.assert_close(s, ws, rtol=1e-5, atol=1e-7)
            assert torch.equal(t, wt) and torch.equal(p, wp)
        tree = build(blocks, h, K)
        assert (tree.parent[:, 1:] >= 0).all()
        if accepted is None:
            break
        chain = torch.stack([torch.tensor(greedy(target, c, S)) for c in h.ctx])  # pretend-accepted path
        h.commit(chain, accepted, [int(chain[b, a]) for b, a in enumerate(accepted)])


def test_sampled_chain_returns_draft_probs_for_rejection_sampling(target):
    S, B = 3, len(PROMPT_LENS)
    h = Harness(target, 1, S, S + 1, seed=5)
    temp, top_p, top_k_ = torch.full((B,), 0.9), torch.full((B,), 0.95), torch.zeros(B, dtype=torch.long)
    seed, min_p = torch.arange(B) + 100, torch.full((B,), 0.05)
    blocks, dp = h.draft((temp, top_p, top_k_, seed, min_p))
    tree = build(blocks, h, 1)
    assert dp.shape == (B, S + 1, target.config.vocab_size)
    for b, c in enumerate(h.ctx):  # row j of draft_probs: the processed law after root..node j
        path = c + tree.tokens[b, 1:].tolist()
        for j in range(S):
            logits = next_logits(target, path[:len(c) + j])
            want = process_logits(logits[None, None], temp[:1], top_p[:1], top_k_[:1], min_p[:1])[0, 0]
            torch.testing.assert_close(dp[b, j], want, rtol=1e-4, atol=1e-6)
            assert dp[b, j, path[len(c) + j]] > 0  # the sampled token has mass
    again, dp2 = h.draft((temp, top_p, top_k_, seed, min_p))  # deterministic given the seed
    assert torch.equal(build(again, h, 1).tokens, tree.tokens) and torch.equal(dp, dp2)
    # the target drafting for itself: rejection sampling accepts the whole chain
    acc, count, commit = VerifySampling(S).sample_rejection(dp, dp, tree.tokens, tree.parent, seed,
                                                            torch.from_numpy(h.prep.seq_len[h.rows].copy()))
    assert (count == S).all()
    greedy_rows = h.draft((torch.zeros(B), top_p, top_k_, seed, min_p))[0]  # temperature 0: the greedy chain
    assert build(greedy_rows, h, 1).tokens[:, 1:].tolist() == [greedy(target, c, S) for c in h.ctx]
