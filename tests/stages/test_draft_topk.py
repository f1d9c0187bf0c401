"""The draft top-k branches for topk=1 and topk>1, the empty batch, and fused == split."""
import torch

from specpipe.stages.draft_topk import DraftTopK


def test_first_step_flattens_and_repeats():
    st = DraftTopK(2)
    p = torch.tensor([[0.6, 0.4], [0.7, 0.2]])
    idx = torch.tensor([[5, 6], [7, 8]])
    h = torch.tensor([[1.0], [2.0]])
    ids, hid, scores, pb, (s_blk, t_blk, parents) = st(0, p, idx, h, None)
    assert ids.tolist() == [5, 6, 7, 8]
    assert hid[:, 0].tolist() == [1.0, 1.0, 2.0, 2.0]
    assert torch.equal(scores, p)
    assert parents.tolist() == [[-1, 0, 1], [-1, 0, 1]]
    assert s_blk.shape == (2, 1, 2)


def test_later_step_reranks_children_by_path_probability():
    st = DraftTopK(2)
    scores = torch.tensor([[0.6, 0.4]])
    p = torch.tensor([[0.5, 0.3], [0.9, 0.05]])  # children of branch 0 and branch 1
    idx = torch.tensor([[10, 11], [12, 13]])
    h = torch.tensor([[1.0], [2.0]])
    ids, hid, sc, pb, (s_blk, t_blk, gid) = st(1, p, idx, h, scores)
    # path probs: [.30, .18, .36, .02] -> best two are (branch1, child0) then (branch0, child0)
    assert ids.tolist() == [12, 10]
    assert torch.allclose(sc, torch.tensor([[0.36, 0.30]]))
    assert pb.tolist() == [[1, 0]]
    assert hid[:, 0].tolist() == [2.0, 1.0]
    assert gid.tolist() == [[2 + 2, 0 + 2]]  # global ids: K + K*K*(i-1) + local child id
    assert t_blk.tolist() == [[10, 11, 12, 13]]


def test_topk1_is_a_chain():
    st = DraftTopK(1)
    ids, hid, sc, pb, (_, _, parents) = st(0, torch.tensor([[0.9]]), torch.tensor([[4]]), torch.zeros(1, 3), None)
    assert parents.tolist() == [[-1, 0]]
    for i in (1, 2, 3):
        ids, hid, sc, pb, (_, _, gid) = st(i, torch.tensor([[0.5]]), torch.tensor([[4 + i]]), hid, sc)
        assert gid.tolist() == [[i]] and ids.tolist() == [4 + i]


def test_empty_batch_flows_through():
    st = DraftTopK(4)
    ids, hid, sc, pb, _ = st(0, torch.zeros(0, 4), torch.zeros(0, 4, dtype=torch.long), torch.zeros(0, 8), None)
    assert ids.shape == (0,) and hid.shape == (0, 8)
    ids, hid, sc, pb, (_, _, gid) = st(1, torch.zeros(0, 4), torch.zeros(0, 4, dtype=torch.long), hid, sc)
    assert ids.shape == (0,) and gid.shape == (0, 4)


def test_fused_matches_split():
    torch.manual_seed(0)
    B, K, H = 3, 4, 8
    split, fused = DraftTopK(K), DraftTopK(K, fused=True)
    p0, i0, h0 = torch.rand(B, K), torch.randint(0, 50, (B, K)), torch.randn(B, H)
    a, b = split(0, p0, i0, h0, None), fused(0, p0, i0, h0, None)
    for i in (1, 2):
        p, idx = torch.rand(B * K, K), torch.randint(0, 50, (B * K, K))
        a2, b2 = split(i, p, idx, a[1], a[2]), fused(i, p, idx, b[1], b[2])
        for x, y in zip(a2[:4], b2[:4]):
            assert torch.equal(x, y)
        for x, y in zip(a2[4], b2[4]):
            assert torch.equal(x, y)
        a, b = a2, b2
