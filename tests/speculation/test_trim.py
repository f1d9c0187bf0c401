"""speculation.trim: the kept nodes, laid out again, compact or in place."""
import numpy as np
import torch

from specpipe.speculation.trim import trim
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
    out, dp, conf = trim(tree, keep, torch.tensor([10, 20]), 4, compact=True, draft_probs=probs,
                         conf=np.arange(12.0).reshape(2, 6))
    assert out.tokens.shape == (2, 3)
    assert paths(out, 0) == {(), (1,), (1, 3)}
    assert paths(out, 1) == {()}  # a request with nothing kept verifies its root alone
    assert out.positions[0].tolist() == [10, 11, 12] and out.positions[1, 0] == 20
    assert torch.equal(dp[0], probs[0, [0, 1, 3]]) and conf[0].tolist() == [0.0, 1.0, 3.0]


def test_a_compiled_verify_pads_to_its_bucket():
    keep = np.zeros((2, 6), dtype=bool)
    keep[:, 0] = True
    keep[0, 1] = True
    out, _, _ = trim(example(), keep, torch.tensor([10, 20]), 4, compact=True, width=4)
    assert out.tokens.shape == (2, 4) and (out.parent[:, 2:] == -1).all()


def test_in_place_unlinks_dropped_nodes_and_keeps_the_width():
    keep = np.array([[True, True, True, False, False, False], [True, True, True, True, True, False]])
    out, _, _ = trim(example(), keep, torch.tensor([10, 20]), 4, compact=False)
    assert out.tokens.shape == (2, 6)
    assert paths(out, 0) == {(), (1,), (2,)}
    assert paths(out, 1) == paths(example(), 1)
