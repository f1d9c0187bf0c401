"""Tree building on small hand-worked trees (global ids, parents, masks, retrieve indices)."""
import torch

from specpipe.stages.build_tree import BuildTree


def build(K, S, N, scores, tokens, parent_list, root=10, seq=5):
    t = BuildTree(K, S, N)
    out = t.build(torch.tensor([root]), torch.tensor([scores]), torch.tensor([tokens]),
                  torch.tensor([parent_list], dtype=torch.int64), torch.tensor([seq]))
    from specpipe.stages.build_tree import Tree
    return Tree(*out)


def test_chain():
    # K=1, S=3: global ids 0,1,2 form a chain; parent_list = [-1, 0, 1]
    tr = build(1, 3, 4, [0.9, 0.8, 0.7], [11, 12, 13], [-1, 0, 1])
    assert tr.tokens.tolist() == [[10, 11, 12, 13]]
    assert tr.parent.tolist() == [[-1, 0, 1, 2]]
    assert tr.positions.tolist() == [[5, 6, 7, 8]]
    assert tr.next_token.tolist() == [[1, 2, 3, -1]]
    assert tr.next_sibling.tolist() == [[-1, -1, -1, -1]]
    assert torch.equal(tr.mask[0], torch.tril(torch.ones(4, 4, dtype=torch.bool)))


def test_branching_tree():
    # K=2, S=2: ids 0,1 at depth 1 (scores .6,.35); ids 2..5 are children (2,3 of id0; 4,5 of id1)
    scores = [0.6, 0.35, 0.30, 0.24, 0.315, 0.035]
    tokens = [11, 12, 21, 22, 23, 24]
    tr = build(2, 2, 4, scores, tokens, [-1, 0, 1])
    # top-3 = ids {0, 1, 4}; sorted ascending -> local 1, 2, 3
    assert tr.tokens.tolist() == [[10, 11, 12, 23]]
    assert tr.parent.tolist() == [[-1, 0, 0, 2]]
    assert tr.depth.tolist() == [[0, 1, 1, 2]]
    assert tr.positions.tolist() == [[5, 6, 6, 7]]
    assert tr.next_token.tolist() == [[1, -1, 3, -1]]
    assert tr.next_sibling.tolist() == [[-1, 2, -1, -1]]
    assert tr.mask[0, 3].tolist() == [True, False, True, True]
    assert tr.mask[0, 1].tolist() == [True, True, False, False]
    assert tr.retrieve_index.tolist() == [[0, 1, 2, 3]]


def test_node_whose_parent_was_not_selected_is_unlinked():
    # id 4 (child of id1) outranks id1 itself, e.g. after NaN/ties: it must never be reachable
    scores = [0.6, 0.1, 0.30, 0.05, 0.5, 0.01]
    tr = build(2, 2, 4, scores, [11, 12, 21, 22, 23, 24], [-1, 0, 1])
    assert tr.tokens.tolist() == [[10, 11, 21, 23]]
    assert tr.parent.tolist() == [[-1, 0, 1, -1]]
    assert tr.next_token.tolist() == [[1, 2, -1, -1]]
    assert tr.mask[0, 3].tolist() == [False, False, False, True]


def test_single_step_all_children_of_root():
    tr = build(3, 1, 3, [0.5, 0.3, 0.2], [7, 8, 9], [])
    assert tr.parent.tolist() == [[-1, 0, 0]]
    assert tr.next_token.tolist() == [[1, -1, -1]]
    assert tr.next_sibling.tolist() == [[-1, 2, -1]]


def test_batch_positions_follow_each_request_length():
    t = BuildTree(1, 2, 3)
    out = t.build(torch.tensor([1, 2]), torch.tensor([[0.9, 0.8], [0.7, 0.6]]), torch.tensor([[3, 4], [5, 6]]),
                  torch.tensor([[-1, 0], [-1, 0]]), torch.tensor([5, 10]))
    assert out[1].tolist() == [[5, 6, 7], [10, 11, 12]]


def test_tied_scores_keep_the_lower_id_so_no_parent_is_dropped():
    """A chain (topk=1, 4 steps) cut to 2 draft nodes whose scores tie after the first (the draft was sure of
    the next tokens): the two kept are the chain's first two, linked root -> 1 -> 2, whatever topk's tie order."""
    from specpipe.stages.build_tree import BuildTree

    scores = [torch.tensor([[0.5]]), torch.tensor([[0.3]]), torch.tensor([[0.3]]), torch.tensor([[0.3]])]
    tokens = [torch.tensor([[11]]), torch.tensor([[12]]), torch.tensor([[13]]), torch.tensor([[14]])]
    parents = [torch.tensor([[-1, 0]]), torch.tensor([[1]]), torch.tensor([[2]]), torch.tensor([[3]])]
    tree = BuildTree(1, 4, 3)(torch.tensor([7]), scores, tokens, parents, torch.tensor([5]))
    assert tree.tokens.tolist() == [[7, 11, 12]] and tree.parent.tolist() == [[-1, 0, 1]]
    assert tree.depth.tolist() == [[0, 1, 2]]
