"""tree_from_parents against a plain walk up the parent pointers, on random forests."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specpipe.stages.tree_layout import root_only_tree, tree_from_parents


def walk(parent, max_depth):
    """Per node: (linked, depth, ancestors incl. itself) by following parents from the node."""
    out = []
    for j in range(len(parent)):
        chain, v = [j], j
        while parent[v] >= 0:
            v = parent[v]
            chain.append(v)
        linked = v == 0 and len(chain) - 1 <= max_depth
        out.append((linked, len(chain) - 1 if linked else 0, set(chain) if linked else {j}))
    return out


@settings(max_examples=200, deadline=None)
@given(data=st.data(), n=st.integers(1, 14), max_depth=st.integers(1, 9))
def test_matches_a_walk(data, n, max_depth):
    # parents precede children; -1 marks the root (node 0) and unlinked nodes
    parent = [-1] + [data.draw(st.integers(-1, j - 1)) for j in range(1, n)]
    tokens = torch.arange(n)[None] + 100
    t = tree_from_parents(tokens, torch.tensor([parent]), torch.tensor([50]), max_depth)
    ref = walk(parent, max_depth)
    for j, (linked, depth, anc) in enumerate(ref):
        assert t.depth[0, j].item() == depth, (parent, j)
        assert set(torch.nonzero(t.mask[0, j]).flatten().tolist()) == anc, (parent, j)
        assert t.parent[0, j].item() == (parent[j] if linked and j > 0 else -1), (parent, j)
        assert t.positions[0, j].item() == 50 + depth
    for j in range(n):  # first child and next sibling among linked nodes
        kids = [i for i in range(n) if t.parent[0, i].item() == j]
        assert t.next_token[0, j].item() == (kids[0] if kids else -1)
        p = t.parent[0, j].item()
        sibs = [i for i in range(j + 1, n) if p >= 0 and t.parent[0, i].item() == p]
        assert t.next_sibling[0, j].item() == (sibs[0] if sibs else -1)


@pytest.mark.parametrize("B,N", [(1, 1), (4, 1), (3, 6)])
def test_root_only_tree_is_the_tree_of_unlinked_nodes(B, N):
    """A step that does not draft verifies roots (and padding) only: the shortcut must be exactly the general layout."""
    g = torch.Generator().manual_seed(B * 10 + N)
    tokens = torch.randint(0, 100, (B, N), generator=g)
    seq = torch.randint(5, 100, (B,), generator=g)
    want = tree_from_parents(tokens, torch.full_like(tokens, -1), seq, 8)
    got = root_only_tree(tokens, seq)
    for f in want.__dataclass_fields__:
        a, b = getattr(want, f), getattr(got, f)
        assert a.dtype == b.dtype and torch.equal(a, b), f
