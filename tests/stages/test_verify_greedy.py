"""Greedy tree verification on hand-worked trees, and stopping at EOS inside an accepted path."""
import torch

from specpipe.metrics import Metrics
from specpipe.pipeline import Pipeline, Request
from specpipe.stages.verify import Verify

# root(10) -> local1 (11), local2 (12); local3 (13) is a child of local2; local4 (14) unlinked
TOKENS = torch.tensor([[10, 11, 12, 13, 14]])
PARENT = torch.tensor([[-1, 0, 0, 2, -1]])


def greedy(predict, S=2):
    return Verify(None, S).greedy(torch.tensor([predict]), TOKENS, PARENT)


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
    acc, count, commit = v.greedy(torch.tensor([[12, 0, 13, 99, 0], [11, 42, 0, 0, 0]]), toks, par)
    assert count.tolist() == [2, 1]
    assert commit[1, :2].tolist() == [11, 42]


def make_pipeline(eos):
    p = object.__new__(Pipeline)
    p.eos, p.metrics = eos, Metrics(3)
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
