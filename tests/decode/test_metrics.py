"""Metric definitions on hand-made verify traces."""
import pytest

from specpipe.decode.metrics import Metrics


def trace():
    # num_steps=3, topk=2, num_draft_tokens=6 (5 draft slots). Four (request, round) records:
    #   accepted 0 | accepted 3 (ranks 0,1,0) | accepted 1 (rank 1) | accepted 2 (ranks 0,0)
    m = Metrics(num_steps=3, topk=2, num_draft_tokens=6)
    m.record_round([0, 3], [[0, 0, 0], [0, 1, 0]], [5, 5])
    m.record_round([1, 2], [[1, 0, 0], [0, 0, 1]], [4, 2])
    m.num_verify_steps = 2
    m.generated_tokens = 10
    return m.summary(wall_s=2.0, recompiles=0)


def test_acceptance_length_counts_the_bonus():
    s = trace()
    assert s["accept_length_mean"] == pytest.approx((1 + 4 + 2 + 3) / 4)
    assert s["mean_acceptance_length"] == s["accept_length_mean"]
    assert s["accept_length_histogram"] == [1, 1, 1, 1]  # rounds committing 1, 2, 3, 4 tokens


def test_per_position_is_unconditional_and_per_depth_conditional():
    s = trace()
    assert s["acceptance_rate_per_position"] == pytest.approx([3 / 4, 2 / 4, 1 / 4])
    assert s["acceptance_rate_by_depth"] == pytest.approx([3 / 4, 2 / 3, 1 / 2])
    assert s["num_accepted_tokens_per_pos"] == [3, 2, 1]


def test_rank_of_accepted_children_uses_only_accepted_depths():
    s = trace()
    # accepted nodes' ranks: (0,1,0) + (1) + (0,0) -> rank 0: 4, rank 1: 2
    assert s["acceptance_by_rank"] == pytest.approx([4 / 6, 2 / 6])


def test_rounds_without_a_draft_count_for_the_speed_not_in_vllms_counters():
    """An n-gram miss (no node linked) commits one token: accept_length_mean, over every round, counts it;
    vLLM's num_drafts and mean_acceptance_length count only requests that had drafts scheduled."""
    m = Metrics(num_steps=3, topk=1, num_draft_tokens=4)
    m.record_round([2, 0], [[0, 0, 0], [0, 0, 0]], [3, 0])  # the second request found no match
    m.record_round([0, 1], [[0, 0, 0], [0, 0, 0]], [3, 3])
    m.num_verify_steps = 2
    s = m.summary(wall_s=1.0, recompiles=0)
    assert s["accept_length_mean"] == pytest.approx(1 + 3 / 4) and s["num_rounds"] == 4
    assert s["mean_acceptance_length"] == pytest.approx(1 + 3 / 3) and s["num_drafts"] == 3
    assert s["draft_acceptance_rate"] == pytest.approx(3 / 9)


def test_depth_one_is_conditioned_on_rounds_that_drafted():
    """An n-gram miss (no node linked) has no depth 1 to lose: it counts in per-position (over rounds), not in
    P(depth 1 accepted | a draft)."""
    m = Metrics(num_steps=2, topk=1, num_draft_tokens=3)
    m.record_round([1, 0, 0], [[0, 0], [0, 0], [0, 0]], [2, 2, 0])  # the third request found no match
    s = m.summary(wall_s=1.0, recompiles=0)
    assert s["acceptance_rate_per_position"] == pytest.approx([1 / 3, 0.0])
    assert s["acceptance_rate_by_depth"] == pytest.approx([1 / 2, 0.0])


def test_rounds_that_drafted_nothing_give_no_draft_rates_rather_than_zero():
    """Every round an n-gram miss: 0 accepted of 0 drafted is no rate (it read 0.0, and rank shares [0, 0] that
    summed to 0), while the rounds' own numbers (1 token each) stand."""
    m = Metrics(num_steps=2, topk=2, num_draft_tokens=4)
    m.record_round([0, 0], [[0, 0], [0, 0]], [0, 0])
    s = m.summary(wall_s=1.0, recompiles=0)
    assert s["accept_length_mean"] == 1.0 and s["num_rounds"] == 2 and s["num_drafts"] == 0
    assert s["draft_acceptance_rate"] is None and s["mean_acceptance_length"] is None
    assert s["acceptance_rate_by_depth"] == [None, None] and s["acceptance_by_rank"] == []
    assert s["acceptance_rate_per_position"] == [0.0, 0.0]


def test_nothing_drafted_gives_no_rates_rather_than_zero():
    m = Metrics(num_steps=3, topk=2, num_draft_tokens=6)
    s = m.summary(wall_s=1.0, recompiles=0)
    assert s["acceptance_rate_per_position"] == [None] * 3 and s["acceptance_rate_by_depth"] == [None] * 3
    assert s["accept_length_mean"] is None and s["num_drafts"] == s["num_rounds"] == 0


def test_a_depth_after_one_no_round_reached_has_no_rate_rather_than_zero():
    """P(depth d | depth d-1) has no data when no round reached depth d-1: null, not 0 (which would read as
    "the tree always loses its path there")."""
    m = Metrics(num_steps=4, topk=1, num_draft_tokens=5)
    m.record_round([1, 0], [[0, 0, 0, 0], [0, 0, 0, 0]], [4, 4])  # depth 1 reached once, depth 2 never
    s = m.summary(wall_s=1.0, recompiles=0)
    assert s["acceptance_rate_by_depth"] == [0.5, 0.0, None, None]  # depth 2 was tried (depth 1 reached): 0
    assert s["acceptance_rate_per_position"] == [0.5, 0.0, 0.0, 0.0]


def test_budget_and_counters():
    s = trace()
    assert s["num_drafts"] == s["num_rounds"] == 4 and s["num_accepted_tokens"] == 6
    assert s["num_draft_tokens"] == 16
    assert s["draft_acceptance_rate"] == pytest.approx(6 / 16)
    assert s["tree_budget_use"] == pytest.approx((16 / 4) / 5)
    assert s["tokens_per_s"] == 5.0


def test_host_time_is_stage_time_minus_model_time():
    m = Metrics(1)
    m.attach_model_timer([], lambda: None)
    m.stage_s["verify"], m.model_s["verify"] = 0.5, 0.3
    m.num_verify_steps = 10
    s = m.summary(1.0, 0)
    assert s["stage_ms"]["verify"] == pytest.approx(50)
    assert s["stage_model_ms"]["verify"] == pytest.approx(30)
    assert s["stage_host_ms"]["verify"] == pytest.approx(20)
    assert s["model_share"] == pytest.approx(0.6)


def test_empty_run_has_no_acceptance():
    s = Metrics(2).summary(0.0, 0)
    assert s["accept_length_mean"] is None and s["tokens_per_s"] == 0.0


class Clock:
    """perf_counter that advances by exactly 1 s per read: durations count the reads between them."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        self.t += 1.0
        return self.t


def test_model_timer_counts_a_compiled_model_branch_once(monkeypatch):
    import torch

    import specpipe.decode.metrics as metrics_mod

    lin = torch.nn.Linear(4, 4)
    m = Metrics(1)
    syncs = []
    m.attach_model_timer([lin], lambda: syncs.append(1))
    clock = Clock()
    monkeypatch.setattr(metrics_mod.time, "perf_counter", clock)
    x = torch.randn(2, 4)
    with m.stage("verify"):
        lin(x)  # eager: the hooks time it (two clock reads apart)
    assert m.model_s["verify"] == 1.0
    # a compiled branch running the module: fullgraph fails if the hooks read the clock inside the graph
    branch = m.model_branch(torch.compile(lambda t: lin(t) * 2, backend="eager", fullgraph=True))
    with m.stage("draft"):
        out = branch(x)
    assert torch.allclose(out, lin(x) * 2)
    assert m.model_s["draft"] == 1.0  # the branch as a whole, not again by the hooks
    m.detach()


def test_model_timer_counts_the_logits_call_and_a_nested_call_once(monkeypatch):
    """Models compute logits in a call of their own (`model.logits(h)` -> lm_head), after forward: that is
    model time; an lm_head called inside a timed forward adds nothing twice."""
    import torch

    import specpipe.decode.metrics as metrics_mod

    class Net(torch.nn.Module):
        def __init__(self, inner_head: bool):
            super().__init__()
            self.body, self.lm_head, self.inner_head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 8), inner_head

        def forward(self, x):
            h = self.body(x)
            return self.lm_head(h) if self.inner_head else h

    for inner in (False, True):
        net, m = Net(inner), Metrics(1)
        m.attach_model_timer([net], lambda: None)
        monkeypatch.setattr(metrics_mod.time, "perf_counter", Clock())
        with m.stage("verify"):
            out = net(torch.randn(2, 4))
            if not inner:
                net.lm_head(out)
        assert m.model_s["verify"] == (1.0 if inner else 2.0)  # one clock tick per timed outermost call
        m.detach()
        with m.stage("verify"):
            net(torch.randn(2, 4))  # after the run: the hooks stay, timing nothing
        assert m.model_s["verify"] == (1.0 if inner else 2.0)
        hooks = (len(net._forward_hooks), len(net.lm_head._forward_hooks))
        again = Metrics(1)
        again.attach_model_timer([net], lambda: None)  # a later run: no new hooks (a compiled caller guards on them)
        assert (len(net._forward_hooks), len(net.lm_head._forward_hooks)) == hooks
        with again.stage("verify"):
            net(torch.randn(2, 4))
        assert again.model_s["verify"] == 1.0 and m.model_s["verify"] == (1.0 if inner else 2.0)
        again.detach()


@pytest.mark.parametrize("compiled", [False, True])
def test_model_timing_off_adds_no_device_syncs(monkeypatch, compiled):
    """model_timing=false: no device synchronize anywhere in a run (eager forwards or a compiled model branch),
    and the model / host split is null rather than a wrong number; on, every forward is synchronized."""
    from helpers import compose
    from specpipe.run import run
    from specpipe.devices.cpu import CpuDevice

    syncs = []
    monkeypatch.setattr(CpuDevice, "synchronize", lambda self: syncs.append(1))
    policy = ['compile.verify.target_forward="compile(backend=eager)"'] if compiled else []
    base = ["model=random_tiny", "workload.num_prompts=2", "workload.max_new_tokens=8", *policy]
    out = run(compose(*base, "model_timing=false"), quiet=True)
    m = out["metrics"]
    assert syncs == [] and m["stage_model_ms"] is None and m["stage_host_ms"] is None and m["model_share"] is None
    assert m["stage_ms"]["verify"] > 0 and m["generated_tokens"] == 16
    on = run(compose(*base), quiet=True)["metrics"]
    assert len(syncs) >= 2 * on["num_verify_steps"] and on["stage_model_ms"]["verify"] > 0
