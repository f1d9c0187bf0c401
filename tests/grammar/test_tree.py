"""grammar.tree on hand-made trees: which drafts a grammar prunes (and the counts), the forced chain merged with the
drafter's nodes, the per-node masks, and the draft distributions re-laid for rejection sampling."""
import numpy as np
import pytest
import torch

from specpipe.grammar.llguidance import LLGuidanceGrammar
from specpipe.grammar.tree import TreeGrammar, allowed, apply
from specpipe.stages.tree_layout import tree_from_parents
from specpipe.workload.constraints import Constraint
from specpipe.workload.tokenizer import ByteTokenizer

pytest.importorskip("llguidance")
V = 258  # bytes, BOS 256, EOS 257


class Req:
    def __init__(self, constraint, output=()):
        self.constraint, self.output_ids = constraint, list(output)
        self.finish_reason = self.error = None


def setup(pattern: str, jump: bool = False, consumed: str = "a", N: int = 8, S: int = 4):
    """A TreeGrammar over bytes with one request constrained to `pattern`, its matcher past `consumed` (the root)."""
    engine = LLGuidanceGrammar(None, ByteTokenizer(), V, [257])
    g = TreeGrammar(engine, jump, max_requests=2, max_nodes=N, num_steps=S, dev=torch.device("cpu"))
    r = Req(Constraint("regex", pattern), [ord(c) for c in consumed])
    assert not g.admit([r])
    return g, r


def tree(rows):
    """rows: per request, [(token char, parent index)] with the root first."""
    tokens = torch.tensor([[ord(c) for c, _ in row] for row in rows])
    parent = torch.tensor([[p for _, p in row] for row in rows])
    return tree_from_parents(tokens, parent, torch.tensor([5] * len(rows)), 4)


def words(chars):
    row = np.zeros(-(-V // 32), dtype=np.int32)
    for c in chars:
        t = ord(c) if isinstance(c, str) else c
        row[t >> 5] |= np.int32(np.uint32(1 << (t & 31)).view(np.int32))
    return row


def test_drafts_the_grammar_forbids_are_pruned_with_their_subtrees_and_counted():
    g, r = setup("ab[cd]e")
    # root a; b (ok) -> c (ok), z (no), d (ok); x (no) -> y (under a pruned node)
    t = tree([[("a", -1), ("b", 0), ("x", 0), ("c", 1), ("z", 1), ("d", 1), ("y", 2)]])
    outs, Nv, changed = g.layout(g.of([r]), t, np.array([6]), None, lambda need: need)
    lay = outs[0]
    assert changed and Nv == 4
    assert [chr(c) for c in lay.tokens] == ["a", "b", "c", "d"]
    assert lay.parent == [-1, 0, 1, 1] and lay.old == [0, 1, 3, 5]
    assert lay.pruned == 3 and lay.forced == 0  # x, z and y
    masks = g.masks[0]
    assert [t for t in range(V) if allowed(masks[0], t)] == [ord("b")]  # after "a": only b
    assert [t for t in range(V) if allowed(masks[1], t)] == [ord("c"), ord("d")]
    assert [t for t in range(V) if allowed(masks[2], t)] == [ord("e")]
    new, _, _ = g.relayout(t, outs, Nv, torch.tensor([5]), None, None)
    assert new.parent.tolist() == [[-1, 0, 1, 1]] and new.depth.tolist() == [[0, 1, 2, 2]]
    # the walk leaves the matcher where it was: the committed state after "a"
    row = np.zeros_like(masks[0])
    g.engine.fill(g.matchers[id(r)], row)
    assert np.array_equal(row, masks[0])


def test_a_tree_the_grammar_allows_whole_is_not_laid_out_again():
    g, r = setup("ab[cd]e")
    t = tree([[("a", -1), ("b", 0), ("c", 1), ("d", 1)]])
    outs, Nv, changed = g.layout(g.of([r]), t, np.array([7]), None, lambda need: 4)
    assert not changed and outs[0].pruned == 0


def test_forced_tokens_lead_and_drafted_nodes_that_spell_them_hang_under_the_chain():
    g, r = setup("abcd(e|f)g", jump=True)
    # the drafter proposed b -> c -> x and b -> q: forced after "a" is "bcd"; c merges, x and q are pruned
    t = tree([[("a", -1), ("b", 0), ("q", 0), ("c", 1), ("x", 3)]])
    outs, Nv, changed = g.layout(g.of([r]), t, np.array([7]), None, lambda need: need)
    lay = outs[0]
    assert [chr(c) for c in lay.tokens] == ["a", "b", "c", "d"]
    assert lay.old == [0, 1, 3, -1]  # d was forced, not drafted
    assert lay.forced == 3 and lay.pruned == 2
    # a forced chain whose drafts agree all the way keeps the drafter's nodes below it
    t = tree([[("a", -1), ("b", 0), ("c", 1), ("d", 2), ("e", 3), ("f", 3)]])
    lay = g.layout(g.of([r]), t, np.array([7]), None, lambda need: need)[0][0]
    assert [chr(c) for c in lay.tokens] == ["a", "b", "c", "d", "e", "f"] and lay.pruned == 0


def test_the_forced_chain_keeps_to_the_depth_and_the_requests_limit():
    g, r = setup("abcdefgh", jump=True)
    t = tree([[("a", -1)]])
    lay = g.layout(g.of([r]), t, np.array([7]), None, lambda need: need)[0][0]
    assert len(lay.tokens) == 1 + 4  # num_steps=4
    lay = g.layout(g.of([r]), t, np.array([2]), None, lambda need: need)[0][0]
    assert len(lay.tokens) == 1 + 2  # max_spec_tokens / policy limit 2


def test_free_requests_keep_their_tree_beside_a_constrained_one():
    g, r = setup("ab[cd]e")
    t = tree([[("a", -1), ("b", 0), ("x", 0), ("c", 1)], [("p", -1), ("q", 0), ("r", 1), ("s", 0)]])
    outs, Nv, changed = g.layout([g.matchers[id(r)], None], t, np.array([7, 7]), None, lambda need: need)
    assert outs[1] is None and Nv == 4  # the free row needs its 4 nodes
    new, _, _ = g.relayout(t, outs, Nv, torch.tensor([5, 9]), None, None)
    assert new.tokens[1].tolist() == t.tokens[1].tolist() and new.parent[1].tolist() == t.parent[1].tolist()
    m = g.node_masks(2, Nv)
    assert m[1].all() and not m[0, 0, ord("x")] and m[0, 0, ord("b")]


def test_draft_distributions_are_masked_renormalised_and_one_hot_on_forced_children():
    g, r = setup("ab(c|d)e", jump=True)
    t = tree([[("a", -1), ("b", 0), ("c", 1)]])
    q = torch.full((1, 3, V), 1.0 / V, dtype=torch.float64)
    outs, Nv, _ = g.layout(g.of([r]), t, np.array([7]), None, lambda need: need)
    _, dp, _ = g.relayout(t, outs, Nv, torch.tensor([5]), q, None)
    assert dp.shape == (1, 3, V)
    assert dp[0, 0, ord("b")] == 1 and dp[0, 0].sum() == 1  # b was forced: one-hot
    assert dp[0, 1, ord("c")] == pytest.approx(0.5) and dp[0, 1, ord("d")] == pytest.approx(0.5)  # masked to {c, d}
    assert dp[0, 1].sum() == pytest.approx(1)


def test_a_dead_end_keeps_the_valid_tokens_and_says_why():
    g, r = setup("abc")
    n, why = g.commit(r, [ord("b"), ord("x"), ord("c")])
    assert n == 1 and "dead end" in why and "120" in why  # token 120 = "x"
    n, why = g.commit(r, [ord("c"), 257])  # EOS where the grammar is complete
    assert n == 2 and why == ""


def test_apply_pushes_forbidden_logits_down_and_a_row_of_nothing_allows_everything():
    logits = torch.zeros(2, 4)
    allow = torch.tensor([[1, 0, 1, 0], [1, 1, 1, 1]], dtype=torch.uint8)
    out = apply(logits, allow)
    assert out[0, 1] < -1e29 and out[0, 0] == 0 and torch.equal(out[1], logits[1])
    assert torch.equal(out.softmax(-1)[0], torch.tensor([0.5, 0.0, 0.5, 0.0]))
    assert torch.isinf(apply(logits.half(), allow)[0, 1])  # half precision: -inf, never NaN
    assert apply(logits, None) is logits
    g, _ = setup("abc")
    words = np.zeros((1, 2, g.engine.words), dtype=np.int32)
    words[0, 0] = words_row = np.asarray(globals()["words"]("b"))
    m = g.expand(words)
    assert m[0, 0].nonzero().flatten().tolist() == [ord("b")] and bool(m[0, 1].all())  # nothing -> everything
    assert np.array_equal(words[0, 0], words_row)


def test_a_resumed_request_replays_its_output_and_a_bad_one_fails():
    g, _ = setup("abc")
    ok, bad = Req(Constraint("regex", "abc"), [ord("a"), ord("b")]), Req(Constraint("regex", "abc"), [ord("z")])
    assert g.admit([ok, bad]) == [bad] and bad.finish_reason == "error" and "do not match" in bad.error
    row = np.zeros(-(-V // 32), dtype=np.int32)
    g.engine.fill(g.matchers[id(ok)], row)
    assert np.array_equal(row, words("c"))
