"""N-gram (prompt lookup) drafting: hand examples, edge cases, batching and a property test."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specpipe.drafters import NgramDrafter, pack_histories
from trie_votes import linked_paths, voted_trie

EXAMPLE = [1, 2, 3, 4, 2, 3, 5, 6, 2, 3]


def propose(hist, num_steps=3, topk=1, n=None, min_n=1, max_n=3, seq=None):
    ctx, lens = pack_histories(hist)
    seq_lens = torch.as_tensor(seq if seq is not None else [len(h) - 1 for h in hist])
    return NgramDrafter(num_steps, topk, n, min_n, max_n).propose(ctx, lens, seq_lens)


def test_docstring_chain():
    t = propose([EXAMPLE], topk=1, n=4)
    assert t.tokens.tolist() == [[3, 5, 6, 2]]
    assert t.parent.tolist() == [[-1, 0, 1, 2]]
    assert t.positions.tolist() == [[9, 10, 11, 12]]
    assert t.next_token.tolist() == [[1, 2, 3, -1]] and t.next_sibling.tolist() == [[-1] * 4]
    assert torch.equal(t.mask[0], torch.tril(torch.ones(4, 4, dtype=torch.bool)))


def test_docstring_tree_and_truncation():
    t = propose([EXAMPLE], topk=2, n=7)
    assert t.tokens.tolist() == [[3, 5, 6, 2, 4, 2, 3]]
    assert t.parent.tolist() == [[-1, 0, 1, 2, 0, 4, 5]]
    assert t.depth.tolist() == [[0, 1, 2, 3, 1, 2, 3]]
    assert t.next_token.tolist() == [[1, 2, 3, -1, 5, 6, -1]]
    assert t.next_sibling.tolist() == [[-1, 4, -1, -1, -1, -1, -1]]
    assert t.mask[0, 6].tolist() == [True, False, False, False, True, True, True]
    assert t.retrieve_index.tolist() == [list(range(7))]
    t = propose([EXAMPLE], topk=2, n=5)
    assert t.tokens.tolist() == [[3, 5, 6, 2, 4]] and t.parent.tolist() == [[-1, 0, 1, 2, 0]]


def test_longest_match_wins_over_recency_and_min_n():
    hist = [1, 2, 3, 4, 9, 3, 5, 2, 3]  # "2 3" -> 4 (older, n=2) beats "3" -> 5 (recent, n=1)
    assert propose([hist], num_steps=2, n=3).tokens.tolist() == [[3, 4, 9]]
    assert propose([hist], num_steps=2, n=3, max_n=1).tokens.tolist() == [[3, 5, 2]]
    t = propose([[7, 3, 5, 1, 3]], num_steps=2, n=3, min_n=2)  # only a 1-gram match: nothing
    assert t.parent.tolist() == [[-1, -1, -1]]


def test_shared_prefix_merges_and_identical_continuations_dedup():
    hist = [1, 2, 5, 6, 7, 1, 2, 5, 8, 9, 1, 2]  # "1 2" -> 5 8 9 (recent) and 5 6 7: share the node 5
    t = propose([hist], num_steps=3, topk=2, n=6)
    assert t.tokens.tolist() == [[2, 5, 8, 9, 6, 7]] and t.parent.tolist() == [[-1, 0, 1, 2, 1, 4]]
    hist = [1, 2, 5, 6, 1, 2, 5, 6, 1, 2]  # both matches continue with 5 6 1: one chain, then "2" matches
    t = propose([hist], num_steps=3, topk=2, n=7)
    assert t.tokens[0, :4].tolist() == [2, 5, 6, 1] and t.parent[0, :4].tolist() == [-1, 0, 1, 2]
    assert (t.parent[0, 4:] == -1).all()


def test_no_match_and_short_histories():
    t = propose([[4, 5, 6, 7]], topk=2, n=5, seq=[10])
    assert t.parent.tolist() == [[-1] * 5] and t.tokens.tolist() == [[7] * 5]
    assert t.depth.tolist() == [[0] * 5] and t.positions.tolist() == [[10] * 5]
    assert torch.equal(t.mask[0], torch.eye(5, dtype=torch.bool))
    assert propose([[9]], n=4).parent.tolist() == [[-1] * 4]  # only the root
    t = propose([[5, 5]], n=4)  # "5" seen at 0, continuation = the last token only
    assert t.tokens.tolist() == [[5, 5, 5, 5]] and t.parent.tolist() == [[-1, 0, -1, -1]]


def test_batch_of_mixed_cases_equals_one_by_one():
    hists = [EXAMPLE, [9], [4, 5, 6, 7], [1, 2, 5, 6, 7, 1, 2, 5, 8, 9, 1, 2], [5, 5], [3, 1, 3, 1, 3]]
    seq = [20, 1, 4, 30, 2, 5]
    batch = propose(hists, num_steps=3, topk=2, n=6, seq=seq)
    for b, h in enumerate(hists):
        one = propose([h], num_steps=3, topk=2, n=6, seq=[seq[b]])
        for f in ("tokens", "positions", "mask", "parent", "depth", "next_token", "next_sibling"):
            assert torch.equal(getattr(batch, f)[b], getattr(one, f)[0]), (b, f)


def brute_matches(h, min_n, max_n):
    """Each c < len(h) whose longest match h[c-n:c] == h[-n:] has min_n <= n <= max_n, as (n, c)."""
    L = len(h)
    out = []
    for c in range(1, L):
        n = max((n for n in range(1, max_n + 1) if c >= n and h[c - n:c] == h[L - n:]), default=0)
        if n >= min_n:
            out.append((n, c))
    return out


@settings(max_examples=150, deadline=None)
@given(hist=st.lists(st.integers(0, 3), min_size=1, max_size=30), other=st.lists(st.integers(0, 3), min_size=1,
       max_size=12), k=st.integers(1, 3), s=st.integers(1, 4), min_n=st.integers(1, 3), extra=st.integers(0, 2),
       cut=st.integers(0, 12))
def test_property_paths_are_real_continuations(hist, other, k, s, min_n, extra, cut):
    max_n = min_n + extra
    n_nodes = 2 + cut % (k * s)
    t = propose([other, hist], num_steps=s, topk=k, n=n_nodes, min_n=min_n, max_n=max_n, seq=[3, 40])
    alone = propose([hist], num_steps=s, topk=k, n=n_nodes, min_n=min_n, max_n=max_n, seq=[40])
    assert torch.equal(t.tokens[1], alone.tokens[0]) and torch.equal(t.parent[1], alone.parent[0])
    tokens, parent, depth = t.tokens[1].tolist(), t.parent[1].tolist(), t.depth[1].tolist()
    matches = brute_matches(hist, min_n, max_n)
    assert tokens[0] == hist[-1]
    for j in range(1, n_nodes):
        if parent[j] < 0:
            assert depth[j] == 0 and t.mask[1, j].sum() == 1
            continue
        assert parent[j] < j and depth[j] == depth[parent[j]] + 1 <= s
        path, v = [], j
        while v > 0:
            path.append(tokens[v])
            v = parent[v]
        path.reverse()
        assert any(hist[c:c + len(path)] == path for _, c in matches), (hist, path)
        sib = [i for i in range(1, n_nodes) if parent[i] == parent[j] and i != j]
        assert all(tokens[i] != tokens[j] for i in sib)  # a trie: siblings differ
    ranked = sorted(matches, key=lambda m: (-m[0], -m[1]))  # longest n, then most recent
    if k == 1:  # a chain: the best match's continuation
        want = hist[ranked[0][1]:ranked[0][1] + min(s, n_nodes - 1)] if matches else []
        assert tokens[1:1 + len(want)] == want and parent[1:1 + len(want)] == list(range(len(want)))
        assert all(p == -1 for p in parent[1 + len(want):])
        return
    # a trie: the 4k best matches vote 2^n for each node of their continuation; the n_nodes-1 nodes with the
    # most votes are kept (ties: the better match, then the shallower node), in that order
    best = voted_trie([(n, hist[c:]) for n, c in ranked], k, s, n_nodes)
    got = linked_paths(tokens, parent, n_nodes)
    assert got == best, (hist, got, best)


def test_trie_too_large_to_compare_is_refused_at_construction():
    """4*topk matches compared pairwise at every depth: a [B, 4096, 4096, 128] table is refused, not allocated."""
    import pytest
    with pytest.raises(ValueError, match="topk<=45"):
        NgramDrafter(128, 1024, 1024)
    NgramDrafter(128, 45, 1024)
