"""Greedy tree verification on hand-worked trees, against a node-by-node walk on random trees, and
stopping at EOS inside an accepted path."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import ancestors
from specpipe.decode.metrics import Metrics
from specpipe.decode.pipeline import Pipeline
from specpipe.decode.request import Request, stop_set
from specpipe.stages.verify import Verify

# root(10) -> local1 (11), local2 (12); local3 (13) is a child of local2; local4 (14) unlinked
TOKENS = torch.tensor([[10, 11, 12, 13, 14]])
PARENT = torch.tensor([[-1, 0, 0, 2, -1]])


def greedy(predict, S=2):
    return Verify(None, S).greedy(torch.tensor([predict]), TOKENS, PARENT, ancestors(PARENT))


def test_accepts_the_matching_path_and_adds_the_bonus():
    acc, count, commit = greedy([12, 50, 13, 99, 0])
    assert acc.tolist() == [[0, 2, 3]]
    assert count.tolist() == [2]
    assert commit.tolist() == [[12, 13, 99]]


def test_no_match_commits_only_the_target_token():
    acc, count, commit = greedy([55, 1, 2, 3, 4])
    assert acc.tolist() == [[0, -1, -1]]
    assert count.tolist() == [0]
    assert commit[0, 0].item() == 55


def test_first_child_rejected_second_sibling_accepted_then_stop():
    acc, count, commit = greedy([12, 0, 77, 0, 0])  # local2 accepted, its child 13 != 77
    assert acc.tolist() == [[0, 2, -1]]
    assert commit[0, :2].tolist() == [12, 77]


def test_unlinked_node_is_never_accepted_even_if_its_token_matches():
    acc, count, _ = greedy([14, 0, 0, 0, 0])
    assert count.tolist() == [0]


def test_batch_of_two_requests_independent():
    v = Verify(None, 2)
    toks = torch.cat([TOKENS, TOKENS])
    par = torch.cat([PARENT, PARENT])
    acc, count, commit = v.greedy(torch.tensor([[12, 0, 13, 99, 0], [11, 42, 0, 0, 0]]), toks, par, ancestors(par))
    assert count.tolist() == [2, 1]
    assert commit[1, :2].tolist() == [11, 42]


def walk(predict, tokens, parent, S):
    """The definition: from the root, S times, step to the first child whose token the target predicts."""
    acc, cur = [0], 0
    for _ in range(S):
        nxt = next((j for j in range(len(tokens)) if parent[j] == cur and tokens[j] == predict[cur]), None)
        if nxt is None:
            break
        acc.append(nxt)
        cur = nxt
    return acc + [-1] * (S + 1 - len(acc)), len(acc) - 1, [predict[j] for j in acc]


@settings(max_examples=200, deadline=None)
@given(data=st.data(), n=st.integers(1, 12), S=st.integers(1, 6), vocab=st.integers(1, 3))
def test_property_equals_a_walk_from_the_root(data, n, S, vocab):
    """Random forests (unlinked nodes, repeated sibling tokens, paths deeper than S) over a tiny vocabulary."""
    parent = [-1] + [data.draw(st.integers(-1, j - 1)) for j in range(1, n)]
    tokens = data.draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n))
    predict = data.draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n))
    par = torch.tensor([parent])
    acc, count, commit = Verify(None, S).greedy(torch.tensor([predict]), torch.tensor([tokens]), par, ancestors(par))
    want_acc, want_count, want_commit = walk(predict, tokens, parent, S)
    assert acc[0].tolist() == want_acc and int(count[0]) == want_count
    assert commit[0, : want_count + 1].tolist() == want_commit


def make_pipeline(eos):
    p = object.__new__(Pipeline)
    p.eos, p.metrics = stop_set(eos), Metrics(3)
    return p


def test_request_hitting_eos_mid_path_stops_there():
    p = make_pipeline(eos=13)
    r = Request(0, "x", [1], max_new_tokens=10)
    assert p.append_tokens(r, [12, 13, 99]) == 2
    assert r.output_ids == [12, 13] and r.finish_reason == "stop"


def test_request_hitting_max_tokens_mid_path_stops_there():
    p = make_pipeline(eos=None)
    r = Request(0, "x", [1], max_new_tokens=3)
    r.output_ids = [5]
    assert p.append_tokens(r, [6, 7, 8]) == 2
    assert r.output_ids == [5, 6, 7] and r.finish_reason == "length"


def test_any_of_several_eos_ids_stops_the_request():
    p = make_pipeline(eos=[13, 21])
    r = Request(0, "x", [1], max_new_tokens=10)
    assert p.append_tokens(r, [12, 21, 13]) == 2
    assert r.output_ids == [12, 21] and r.finish_reason == "stop"
    r2 = Request(1, "x", [1], max_new_tokens=10)
    assert p.append_tokens(r2, [13, 21]) == 1 and r2.finish_reason == "stop"
