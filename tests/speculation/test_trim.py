"""speculation.trim: the kept nodes, laid out again, compact or in place."""
import numpy as np
import torch

from specpipe.speculation.trim import HostTree, trim
from specpipe.stages.tree_layout import tree_from_parents


def paths(tree, b):
    """Each linked node's token path from the root: the tree's meaning, whatever its layout."""
    tok, par = tree.tokens[b].tolist(), tree.parent[b].tolist()
    out = set()
    for j in range(len(tok)):
        if j and par[j] < 0:
            continue
        path, k = [], j
        while k > 0:
            path.append(tok[k])
            k = par[k]
        out.add(tuple(reversed(path)))
    return out


def example():
    tokens = torch.tensor([[9, 1, 2, 3, 4, 9], [8, 5, 6, 7, 8, 8]])
    parent = torch.tensor([[-1, 0, 0, 1, 3, -1], [-1, 0, 1, 2, 0, -1]])
    return tree_from_parents(tokens, parent, torch.tensor([10, 20]), 4)


def test_compact_keeps_the_kept_paths_and_narrows_to_the_widest_request():
    tree = example()
    keep = np.array([[True, True, False, True, False, False], [True, False, False, False, False, False]])
    probs = torch.arange(2 * 6 * 3, dtype=torch.float32).view(2, 6, 3)
    out, ht, dp, conf = trim(tree, HostTree.of(tree), keep, torch.tensor([10, 20]), compact=True,
                             draft_probs=probs, conf=np.arange(12.0).reshape(2, 6))
    assert np.array_equal(ht.mask, out.mask.numpy()) and ht.rank[0].tolist() == [0, 0, 0]
    assert out.tokens.shape == (2, 3)
    assert paths(out, 0) == {(), (1,), (1, 3)}
    assert paths(out, 1) == {()}  # a request with nothing kept verifies its root alone
    assert out.positions[0].tolist() == [10, 11, 12] and out.positions[1, 0] == 20
    assert torch.equal(dp[0], probs[0, [0, 1, 3]]) and conf[0].tolist() == [0.0, 1.0, 3.0]


def test_a_compiled_verify_pads_to_its_bucket():
    keep = np.zeros((2, 6), dtype=bool)
    keep[:, 0] = True
    keep[0, 1] = True
    tree = example()
    out, _, _, _ = trim(tree, HostTree.of(tree), keep, torch.tensor([10, 20]), compact=True, width=4)
    assert out.tokens.shape == (2, 4) and (out.parent[:, 2:] == -1).all()


def test_in_place_unlinks_dropped_nodes_and_keeps_the_width():
    keep = np.array([[True, True, True, False, False, False], [True, True, True, True, True, False]])
    tree = example()
    out, _, _, _ = trim(tree, HostTree.of(tree), keep, torch.tensor([10, 20]), compact=False)
    assert out.tokens.shape == (2, 6)
    assert paths(out, 0) == {(), (1,), (2,)}
    assert paths(out, 1) == paths(example(), 1)


def test_the_relaid_tree_equals_a_fresh_layout_of_the_same_parents():
    """Ancestry gathered from the old mask equals `tree_from_parents` run on the kept nodes' parents."""
    rng = np.random.default_rng(0)
    for _ in range(50):
        N = 9
        parent = np.array([[-1] + [int(rng.integers(-1, j)) for j in range(1, N)] for _ in range(3)])
        tree = tree_from_parents(torch.arange(N).expand(3, N).clone(), torch.from_numpy(parent), torch.zeros(3,
                                 dtype=torch.int64), 8)
        p = tree.parent.numpy()
        keep = rng.random((3, N)) < 0.7
        keep[:, 0] = True
        for j in range(1, N):  # close under ancestors
            keep[:, j] &= (p[:, j] >= 0) & keep[np.arange(3), np.maximum(p[:, j], 0)]
        out, ht, _, _ = trim(tree, HostTree.of(tree), keep, torch.zeros(3, dtype=torch.int64), compact=True)
        want = tree_from_parents(out.tokens, out.parent, torch.zeros(3, dtype=torch.int64), 8)
        for f in ("mask", "depth", "next_token", "next_sibling", "positions"):
            assert torch.equal(getattr(out, f), getattr(want, f)), f
