"""speculation.acceptance: path probabilities, the host rebuild of the accepted path, and what a verify teaches."""
import numpy as np

import torch

from specpipe.speculation.acceptance import Acceptance, accepted_nodes, sibling_rank
from specpipe.stages.tree_layout import tree_from_parents

# root 0; 1 and 2 children of the root; 3 child of 1; 4 child of 3; 5 unlinked padding
PARENT = np.array([[-1, 0, 0, 1, 3, -1]])
DEPTH = np.array([[0, 1, 1, 2, 3, 0]])
MASK = tree_from_parents(torch.arange(6)[None], torch.from_numpy(PARENT), torch.tensor([0]), 4).mask.numpy()
RANK = sibling_rank(PARENT)


def test_path_probability_is_the_product_along_the_path_and_never_grows():
    acc = Acceptance()
    conf = np.array([[1.0, 0.99, 0.2, 0.99, 0.99, 0.0]])
    p = acc.path_probs(PARENT, DEPTH, MASK, conf)
    a = acc.rates()
    assert p[0, 0] == 1.0 and p[0, 5] == 0.0
    assert np.isclose(p[0, 4], a[7, 0] * a[7, 1] * a[7, 2])
    assert p[0, 1] >= p[0, 3] >= p[0, 4]


def test_sibling_rank_counts_earlier_siblings():
    assert sibling_rank(PARENT).tolist() == [[0, 0, 1, 0, 0, 1]]  # (the root and padding share parent -1)


def test_accepted_nodes_follow_the_ranks_read_back():
    # two drafts accepted: depth 1 took the first child (node 1), depth 2 node 3
    acc = accepted_nodes(MASK, DEPTH, RANK, np.array([2]), np.array([[0, 0, 0]]))
    assert acc.tolist() == [[True, True, False, True, False, False]]
    # depth 1 took the second child (node 2): nothing below it was drafted
    acc = accepted_nodes(MASK, DEPTH, RANK, np.array([1]), np.array([[1, 0, 0]]))
    assert acc.tolist() == [[True, False, True, False, False, False]]


def test_observe_counts_only_nodes_whose_parent_was_accepted():
    acc = Acceptance()
    conf = np.full(PARENT.shape, 0.99)
    accepted = np.array([[True, True, False, False, False, False]])  # node 1 accepted, node 3 (its child) not
    acc.observe(PARENT, DEPTH, conf, accepted)
    # depth 1: nodes 1 (accepted) and 2 (not) were tried; depth 2: node 3 (not); node 4's parent was not accepted
    assert np.isclose(acc.seen[7, 0], 2) and np.isclose(acc.accepted[7, 0], 1)
    assert np.isclose(acc.seen[7, 1], 1) and acc.accepted[7, 1] == 0
    assert acc.seen[7, 2] == 0


def test_without_confidence_siblings_learn_apart():
    """A drafter reporting no confidence: the first child and its siblings get separate estimates, so a trie's many
    rejected siblings do not drag its first choice down."""
    acc = Acceptance()
    for _ in range(50):
        acc.observe(PARENT, DEPTH, None, np.array([[True, True, False, False, False, False]]))
    p = acc.path_probs(PARENT, DEPTH, MASK, None)
    assert p[0, 1] > 0.9 and p[0, 2] < 0.1


def test_a_drafter_whose_confidence_is_a_probability_starts_each_cell_at_it():
    """EAGLE's draft probability is the prior: an unseen unlikely node is not taken for an even chance (with 0.5
    everywhere, a weak head's probes verified its unlikely nodes), a confident one still starts optimistic."""
    plain, calibrated = Acceptance(), Acceptance()
    calibrated.prior_from_conf()
    conf = np.array([[1.0, 0.05, 0.95, 0.3, 0.3, 0.0]])
    p0, p1 = (a.path_probs(PARENT, DEPTH, MASK, conf) for a in (plain, calibrated))
    assert np.allclose(p0[0, 1:3], 0.5)
    assert np.isclose(p1[0, 1], 1 / 16) and np.isclose(p1[0, 2], 15 / 16)  # the bins' centres (8 bins)
    # data still decides: 20 misses bring the confident node under the unlikely one's prior
    for _ in range(20):
        calibrated.observe(PARENT, DEPTH, conf, np.array([[True, False, False, False, False, False]]))
    assert calibrated.path_probs(PARENT, DEPTH, MASK, conf)[0, 2] < p1[0, 1]
