"""speculation.cost: the cost curve, and the width it chooses against it."""
import numpy as np
from omegaconf import OmegaConf

import torch

from specpipe.speculation.cost import CostCurve, CostPolicy
from specpipe.speculation.trim import HostTree
from specpipe.stages.tree_layout import tree_from_parents

CHAIN = np.array([[-1, 0, 1, 2, 3]])  # a 4-token chain
DEPTH = np.array([[0, 1, 2, 3, 4]])
HT = HostTree.of(tree_from_parents(torch.arange(5)[None], torch.from_numpy(CHAIN), torch.tensor([0]), 4))


def policy(cost_ms=None, skip_after=4):
    return CostPolicy(OmegaConf.create({"max_context": None, "skip_after": skip_after, "cost_ms": cost_ms}), 5, 4)


def sure(pol):
    """Acceptance learned as near-certain for every confident first child."""
    for _ in range(100):
        pol.acceptance.observe(CHAIN, DEPTH, np.ones((1, 5)), np.ones((1, 5), dtype=bool))


def test_curve_interpolates_between_points_and_extends_the_last_slope():
    c = CostCurve({1: {1: 10, 3: 20}})
    assert np.allclose(c(1, np.array([1, 2, 3, 5])), [0.010, 0.015, 0.020, 0.030])
    assert np.allclose(c(7, np.array([1])), [0.010])  # a fixed curve without this batch size: its nearest


def test_free_verify_takes_the_full_width():
    pol = policy({1: {1: 10, 5: 10}})
    sure(pol)
    keep = pol.keep(HT, np.ones((1, 5)), np.array([4]))
    assert keep.all()


def test_expensive_verify_takes_no_draft():
    pol = policy({1: {1: 10, 2: 100, 5: 200}})
    sure(pol)
    keep = pol.keep(HT, np.ones((1, 5)), np.array([4]))
    assert keep.tolist() == [[True, False, False, False, False]]


def test_middle_width_when_acceptance_fades():
    pol = policy({1: {1: 10, 5: 14}})
    p = np.array([[1.0, 0.9, 0.8, 0.05, 0.01]])
    assert pol.width(p, np.array([4])) == 3  # 2.7 tokens / 12 ms beats 2.75 / 13 and 1.9 / 11


def test_unmeasured_batch_explores_full_width_then_plain():
    pol = policy()
    p = np.array([[1.0, 0.5, 0.25, 0.1, 0.05]])
    assert pol.width(p, np.array([4])) == 5
    pol.learn_cost(1, 5, 0.02, 0.001)
    assert pol.width(p, np.array([4])) == 1
    pol.learn_cost(1, 1, 0.01, 0.001)
    assert pol.curve.known(1, 1) and pol.curve.known(1, 5) and pol.curve.known(1)


def test_drafting_pauses_after_plain_steps_and_probes_again():
    pol = policy(skip_after=2)
    limits = np.array([4])
    for _ in range(2):
        assert not pol.skip_draft(limits)
        pol.learn_cost(1, 1, 0.01, 0.0)
    skipped = [pol.skip_draft(limits) for _ in range(4)]
    assert skipped == [True, False, True, False]  # every skip_after-th step drafts again
    pol.learn_cost(1, 3, 0.01, 0.0)  # a draft was worth verifying: drafting resumes
    assert not pol.skip_draft(limits)


def test_a_new_batch_size_borrows_the_measured_shape():
    """Batch sizes met later (requests finishing) use the nearest measured curve, scaled to their own point."""
    c = CostCurve()
    c.learn(4, 1, 0.040)
    c.learn(4, 5, 0.060)
    assert np.allclose(c(3, np.array([1, 5])), [0.040, 0.060])  # nothing of its own: the shape as is
    c.learn(2, 1, 0.020)
    assert np.allclose(c(2, np.array([1, 5])), [0.020, 0.030])  # one point of its own: scaled to it
    pol = policy()
    pol.curve = c
    assert pol.width(np.array([[1.0, 0.9, 0.9, 0.9, 0.9]]), np.array([4])) == 5  # no exploration at B = 1
