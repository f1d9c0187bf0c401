"""speculation.cost: the cost curve, and the width it chooses against it."""
import numpy as np
from omegaconf import OmegaConf

import torch

from specpipe.decode.request import Request
from specpipe.speculation.cost import CostCurve, CostPolicy, worth
from specpipe.speculation.trim import HostTree
from specpipe.stages.tree_layout import tree_from_parents

CHAIN = np.array([[-1, 0, 1, 2, 3]])  # a 4-token chain
DEPTH = np.array([[0, 1, 2, 3, 4]])
HT = HostTree.of(tree_from_parents(torch.arange(5)[None], torch.from_numpy(CHAIN), torch.tensor([0]), 4))


def policy(cost_ms=None, skip_after=4, warm=True):
    pol = CostPolicy(OmegaConf.create({"max_context": None, "skip_after": skip_after, "cost_ms": cost_ms,
                                       "min_gain": 0.05}), 5, 4)
    pol.warm = warm  # (a run's first step is not measured)
    return pol


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


def test_unmeasured_batch_explores_from_the_cheap_end_doubling():
    """Plain first, then at most twice the widest measured width; past it the curve is guessed flat, so a width
    is tried when it would pay at that cost, and dropped once measured too dear."""
    pol = policy()
    p = np.array([[1.0, 0.9, 0.8, 0.7, 0.6]])
    assert pol.width(p, np.array([4])) == 1
    pol.learn_cost(1, 1, 0.010, 0.0, False)
    assert pol.width(p, np.array([4])) == 2
    pol.learn_cost(1, 2, 0.011, 0.0, True)
    assert pol.width(p, np.array([4])) == 4
    pol.learn_cost(1, 4, 0.012, 0.0, True)
    assert pol.width(p, np.array([4])) == 5  # nearly free all the way
    steep = policy()
    for n, s in ((1, 0.010), (2, 0.020), (4, 0.040)):  # cost in proportion to tokens: no width pays
        steep.learn_cost(1, n, s, 0.0, n > 1)
    assert steep.width(p, np.array([4])) == 1


def test_a_noisy_first_measurement_keeps_the_minimum():
    c = CostCurve()
    for s in (0.030, 0.012, 0.014):  # one slow step among the first: interference, not the width's cost
        c.learn(1, 4, s)
    assert c.points[1][4] == 0.012
    c.learn(1, 4, 0.016)  # then an average, which follows contexts as they grow
    assert 0.012 < c.points[1][4] < 0.016


def test_the_first_step_is_not_a_measurement():
    pol = policy(warm=False)
    pol.learn_cost(1, 1, 0.500, 0.0, False)  # one-time costs
    assert not pol.curve.points
    pol.learn_cost(1, 1, 0.010, 0.0, False)
    assert pol.curve.points == {1: {1: 0.010}}


def test_a_step_is_padded_to_a_cheaper_measured_width():
    """A plain step laid out 5 wide when the curve says 5 costs less (oneDNN's one-row GEMMs on CPU); not when
    the saving is within noise, nor past the tree's width, nor on a width measured too few times."""
    assert policy({1: {1: 53, 3: 52, 5: 48}}).pad_to(1, 1) == 5
    assert policy({1: {1: 53, 3: 52, 5: 48}}).pad_to(1, 3) == 5
    assert policy({1: {1: 50, 5: 49}}).pad_to(1, 1) == 1
    assert policy({1: {1: 53, 6: 40}}).pad_to(1, 1) == 1  # 6 > the tree's 5 nodes
    assert policy({1: {1: 53, 5: 48}}).pad_to(2, 1) == 1  # nothing measured at batch 2
    pol = policy()
    for _ in range(3):
        pol.learn_cost(1, 1, 0.053, 0.0, False)
    pol.learn_cost(1, 5, 0.048, 0.0, True)
    assert pol.pad_to(1, 1) == 1  # 5 measured once
    pol.learn_cost(1, 5, 0.048, 0.0, False)
    pol.learn_cost(1, 5, 0.048, 0.0, False)
    assert pol.pad_to(1, 1) == 5


def test_a_learned_curve_extends_its_last_slope_past_one_row():
    """Past the widest measured width, a learned curve rises as its last segment does (a batch of 8 on SmolLM2
    measured 134 ms at width 4 and 227 at 8, then tried 16 at 426 when guessed flat); a segment from one row (the
    GEMV-to-GEMM jump) is not extended, so the exploration of a flat curve goes on."""
    c = CostCurve()
    for n, s in ((1, 0.072), (2, 0.094), (4, 0.134), (8, 0.227)):
        c.learn(8, n, s)
    assert np.allclose(c(8, np.array([16])), [0.227 + 8 * (0.227 - 0.134) / 4])
    pol = policy()
    for n, s in ((1, 0.072), (2, 0.094), (4, 0.134), (8, 0.227)):
        pol.learn_cost(8, n, s, 0.0, n > 1)
    p = np.tile([[1.0, 0.9, 0.8, 0.7, 0.6] + [0.5] * 11], (8, 1))  # 16 nodes, as a 16-token tree would give
    pol.N = 16
    assert pol.width(p, np.full(8, 15)) < 16
    two = CostCurve()
    two.learn(1, 1, 0.010)
    two.learn(1, 2, 0.020)
    assert np.allclose(two(1, np.array([4])), [0.020])


def test_extrapolation_never_falls():
    c = CostCurve()
    c.learn(1, 1, 0.012)
    c.learn(1, 2, 0.010)  # noise: the wider step measured cheaper
    assert np.allclose(c(1, np.array([4, 8])), [0.010, 0.010])


def test_drafting_pauses_after_plain_steps_and_probes_again():
    pol = policy(skip_after=2)
    limits = np.array([4])
    for _ in range(2):
        assert not pol.skip_draft(limits)
        pol.learn_cost(1, 5, 0.01, 0.0, False)  # (padded steps without a draft count as plain)
    skipped = [pol.skip_draft(limits) for _ in range(4)]
    assert skipped == [True, False, True, False]  # every skip_after-th step drafts again
    pol.paid = True  # a draft was worth verifying, and worth making: drafting resumes
    pol.learn_cost(1, 3, 0.01, 0.0, True)
    assert not pol.skip_draft(limits)


def test_drafting_pauses_when_it_pays_only_once_made():
    """A costly draft stage (8 ms against a 10 ms plain step) with a 30 % first token: once made, verifying 2 tokens
    beats verifying 1 (1.3 tokens / 18.25 ms against 1 / 18 ms), but a plain step without drafting beats both
    (1 / 10 ms), so drafting pauses. With a 0.5 ms draft stage the same draft pays and drafting goes on."""
    limits = np.array([4])
    p = np.array([[1.0, 0.3, 0.1, 0.05, 0.01]])
    for draft_ms, pauses in ((8.0, True), (0.5, False)):
        pol = policy({1: {1: 10, 2: 10.25, 5: 11}}, skip_after=2)
        pol.draft_s[1] = draft_ms / 1000
        for _ in range(2):
            assert not pol.skip_draft(limits)
            assert pol.width(p, limits) > 1  # the draft made is still verified
            pol.learn_cost(1, 2, 0.01025, 0.0, True)
        assert pol.skip_draft(limits) == pauses, draft_ms


def test_a_draft_pays_against_a_plain_step_padded_where_that_is_cheaper():
    """oneDNN's packed GEMMs run one row slower than four: a plain step padded to width 4 costs 55 ms, not 67. A
    12 ms draft of 0.15 expected tokens beats the unpadded plain step (1.15 / 67 ms against 1 / 67 ms) but not the
    padded one (1 / 55 ms)."""
    pol = policy({1: {1: 67, 4: 55, 5: 56}})
    pol.draft_s[1] = 0.012
    p = np.array([[1.0, 0.15, 0.0, 0.0, 0.0]])
    assert pol.width(p, np.array([4])) > 1 and not pol.paid
    pol.draft_s[1] = 0.001
    assert pol.width(p, np.array([4])) > 1 and pol.paid


def test_failed_probes_back_off_as_far_as_a_dear_draft_stage_warrants():
    """Each probe that finds nothing doubles the gap to the next, up to where probes cost 2 % of the paused steps'
    time: a 22 ms EAGLE head against a 58 ms plain step backs off 4, 8, 16, 19, 19; a 1 ms n-gram drafter stays at 4.
    A draft that pays resumes drafting and the gap starts again at skip_after."""
    limits = np.array([4])
    for draft_ms, gaps in ((22.0, [4, 8, 16, 19, 19]), (1.0, [4, 4, 4, 4, 4])):
        pol = policy({1: {1: 58, 5: 70}}, skip_after=4)
        pol.draft_s[1] = draft_ms / 1000
        pol.plain_run = 4  # (paused)
        probes, step = [], 0
        while len(probes) < 5:
            step += 1
            if pol.skip_draft(limits):
                pol.skipped_step()
            else:
                probes.append(step)
                pol.proposed, pol.paid = True, False  # (a probe whose draft did not pay)
            pol.learn_cost(1, 1, 0.058, 0.0, False)
        assert np.diff([0] + probes).tolist() == gaps, draft_ms
    pol.proposed = pol.paid = True
    pol.learn_cost(1, 2, 0.06, draft_ms / 1000, True)
    assert pol.every == 4 and not pol.skip_draft(limits)


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


def req(out: int, accepted: int, max_new: int = 64):
    return Request(0, "", [1], max_new, output_ids=[7] * out, num_accepted_tokens=accepted)


def test_worth_is_level_until_a_request_pulls_ahead():
    assert np.allclose(worth([req(10, 0), req(10, 0), req(10, 0)]), 1 / 3)
    w = worth([req(30, 20), req(30, 0), req(20, 0, max_new=40)])  # 34 left at 3 per step; 34 at 1; 20 at 1
    assert w[1] > 0.99 and w[0] < 1e-3 and w[2] < 1e-3


def test_draining_batch_drafts_only_for_the_request_that_ends_last():
    """Request 0 is sure of its drafts but well ahead; request 1, the last to finish, has none. While others
    queue, request 0's tokens pay for the wider verify; once the batch drains they would not shorten the run."""
    pol = policy({2: {1: 10, 5: 14}})
    p = np.array([[1.0, 0.9, 0.9, 0.9, 0.9], [1.0, 0.0, 0.0, 0.0, 0.0]])
    reqs = [req(40, 30), req(20, 0)]
    limits = pol.limits(reqs, np.array([50, 30]), waiting=3)
    assert pol.width(p, limits) == 5
    limits = pol.limits(reqs, np.array([50, 30]), waiting=0)
    assert pol.width(p, limits) == 1
    behind_with_drafts = pol.limits([req(20, 0), req(40, 30)], np.array([30, 50]), waiting=0)
    assert pol.width(p, behind_with_drafts) == 5


def test_a_later_run_on_the_same_target_and_settings_goes_on_from_the_measured_curve():
    """The cost of a step belongs to the model, the device and the settings: a second run with the same loaded
    target starts from the first run's curve and draft stage; other settings, another target or a fixed curve
    start afresh."""
    from specpipe.config.compose import compose_config

    target, other = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    cfg = compose_config(["draft=ngram", "speculation=cost"])
    first = CostPolicy.build(cfg, 5, 4, target)
    first.warm = True
    first.learn_cost(2, 1, 0.010, 0.002, False)
    again = CostPolicy.build(cfg, 5, 4, target)
    assert again.curve.points == {2: {1: 0.010}} and again.curve is first.curve
    assert CostPolicy.build(cfg, 5, 4, other).curve.points == {}
    assert CostPolicy.build(compose_config(["draft=suffix", "speculation=cost"]), 5, 4, target).curve.points == {}
    assert CostPolicy.build(compose_config(["draft=ngram", "device.num_threads=2"]), 5, 4, target).curve.points == {}
    fixed = compose_config(["draft=ngram", "speculation=cost", "+speculation.cost_ms={2: {1: 5}}"])
    assert CostPolicy.build(fixed, 5, 4, target).curve.points == {2: {1: 0.005}}


def test_a_draft_that_promises_less_than_min_gain_is_not_verified():
    """Verifying one draft at 9 % more cost for a 12 % chance promises 2.8 % more tokens per second: under the
    5 % margin (the best of noisy estimates is optimistic), a plain step; at 0 the draft is verified."""
    p = np.array([[1.0, 0.12, 0.0, 0.0, 0.0]])
    curve = {1: {1: 10, 2: 10.9}}
    pol = policy(curve)
    assert pol.width(p, np.array([4])) == 1 and not pol.paid
    eager = policy(curve)
    eager.min_gain = 0.0
    assert eager.width(p, np.array([4])) == 2
    assert policy(curve).width(np.array([[1.0, 0.5, 0.0, 0.0, 0.0]]), np.array([4])) == 2  # 38 % more: verified


def test_a_weak_heads_unlikely_drafts_are_not_verified_as_even_chances(monkeypatch):
    """A random EAGLE head's nodes have draft probabilities near 1/V. Verifying costs a plain step's time per
    token (the curve given), so a node must be likelier than ~1/4 to pay. Each cell's prior is the head's own
    probability: `cost` verifies next to nothing. With the even prior it verified a draft on most steps."""
    from helpers import compose
    from specpipe.run import run
    from specpipe.speculation.acceptance import Acceptance

    cfg = compose("model=random_tiny", "draft=eagle", "workload.num_prompts=3", "workload.batch_size=2",
                  "workload.max_new_tokens=24", "speculation=cost",
                  "speculation.cost_ms={1: {1: 1, 8: 8}, 2: {1: 1, 8: 8}}", "speculation.skip_after=0")

    def verified(out):
        return out["metrics"]["num_draft_tokens"], [r.output_ids for r in out["requests"]]
    drafts, ids = verified(run(cfg, quiet=True))
    monkeypatch.setattr(Acceptance, "prior_from_conf", lambda self: None)  # the even prior
    even, even_ids = verified(run(cfg, quiet=True))
    assert ids == even_ids  # (greedy: the target decides every token)
    assert even >= 40 and drafts <= even / 10, (drafts, even)
