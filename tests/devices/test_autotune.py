"""`auto`: measures on real inputs, returns eager output while measuring, keeps the fastest correct
candidate, records both timings, and `collect_decisions` finds every decision of a pipeline."""
import random

import pytest
import torch
from torch.utils._pytree import tree_flatten

from draft_inputs import draft_round
from helpers import compose
from pipeline_spy import run_watched
from specpipe.run import run
from specpipe.devices.autotune import AutoBranch, collect_decisions, same_outputs
from specpipe.config.compile_policy import parse_policy
from specpipe.devices.cpu import CpuDevice
from specpipe.stages.draft_topk import DraftTopK


class FakeClock:
    """Time advances only when a candidate runs, by that candidate's cost: decisions are deterministic."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t

    def costing(self, seconds, fn=lambda x: x * 2):
        def run(x):
            run.calls += 1
            self.t += seconds
            return fn(x)
        run.calls = 0
        return run


def auto_with(costs: dict, **fns):
    clock = FakeClock()
    cands = {name: clock.costing(c, fns.get(name, lambda x: x * 2)) for name, c in costs.items()}
    return AutoBranch("stage.branch", cands, trials=2, clock=clock), cands


def test_picks_the_faster_and_records_both_timings():
    auto, _ = auto_with({"eager": 10e-6, "compile": 4e-6})
    x = torch.arange(4)
    for _ in range(3):
        assert torch.equal(auto(x), x * 2)
    d = auto.decision
    assert (d["choice"], d["status"], d["trials"]) == ("compile", "decided", 2)
    assert d["timings_us"] == {"eager": pytest.approx(10.0), "compile": pytest.approx(4.0)}
    assert d["first_call_s"]["compile"] == pytest.approx(2 * 4e-6)


def test_a_lead_within_the_margin_keeps_eager():
    auto, _ = auto_with({"eager": 10e-6, "compile": 9.7e-6})
    for _ in range(2):
        auto(torch.ones(2))
    assert auto.decision["choice"] == "eager"


def test_wrong_or_failing_candidates_are_dropped_and_eager_output_returned():
    def boom(x):
        raise RuntimeError("backend exploded\nlong trace")

    auto, _ = auto_with({"eager": 10e-6, "compile": 1e-6, "graph": 1e-6}, compile=lambda x: x * 3, graph=boom)
    out = [auto(torch.ones(3)) for _ in range(3)]
    assert all(torch.equal(o, torch.full((3,), 2.0)) for o in out)
    d = auto.decision
    assert d["choice"] == "eager"
    assert d["rejected"] == {"compile": "output 0 differs from eager beyond float tolerance",
                             "graph": "RuntimeError: backend exploded"}


def test_after_deciding_only_the_choice_runs():
    auto, cands = auto_with({"eager": 10e-6, "compile": 1e-6})
    for _ in range(2):
        auto(torch.ones(1))
    before = {n: c.calls for n, c in cands.items()}
    auto(torch.ones(1))
    assert cands["compile"].calls == before["compile"] + 1 and cands["eager"].calls == before["eager"]
    assert list(auto.candidates) == ["compile"]  # the losers are released


def test_same_outputs():
    a = (torch.tensor([1, 2]), torch.tensor([0.5, 1.0]))
    assert same_outputs(a, (torch.tensor([1, 2]), torch.tensor([0.5, 1.0 + 1e-9]))) is None
    assert "output 0 differs" in same_outputs(a, (torch.tensor([1, 3]), a[1]))
    assert "different structure" in same_outputs(a[:1], a)
    assert "eager gives" in same_outputs((a[0].float(), a[1]), a)


def test_real_branch_on_cpu_picks_eager_over_slow_aot_eager_and_matches_eager():
    """On 2 CPU cores aot_eager costs ~3.5x eager per draft top-k step (measurements.md): auto must see it."""
    dev = CpuDevice()
    stage = DraftTopK(4)
    stage.bind(lambda st, br, fn: dev.compile(fn, parse_policy("auto(backend=aot_eager)")))
    for B in (4, 3, 1, 2):
        want = draft_round(DraftTopK(4), B, 4, 64, 4, seed=B)
        got = draft_round(stage, B, 4, 64, 4, seed=B)
        assert all(torch.equal(w, g) for w, g in zip(tree_flatten(want)[0], tree_flatten(got)[0]))
    dec = collect_decisions([stage])
    assert set(dec) == {"draft_topk.first", "draft_topk.later"}
    later = dec["draft_topk.later"]
    assert later["status"] == "decided" and set(later["timings_us"]) == {"eager", "compile"}
    assert later["choice"] == "eager", later


def test_pipeline_with_auto_decides_every_branch_and_stays_lossless(prompts_file, monkeypatch):
    rng = random.Random(1)
    path = prompts_file(["".join(rng.choice("abc de=()\n") for _ in range(n)) for n in (4, 19, 9, 30, 2, 14)])
    aot = "'auto(backend=aot_eager)'"  # compile cheaply; the deciding logic is the same as with inductor
    common = ("model=random_tiny", f"workload.prompts_file={path}", "workload.batch_size=3",
              "workload.max_new_tokens=24")
    branches = ("draft_topk.first", "draft_topk.later", "build_tree.build", "verify.greedy")
    cfg = compose(*common, "compile=auto", *(f"compile.{k}={aot}" for k in branches))
    seen = run_watched(monkeypatch, cfg)
    dec = collect_decisions(seen["pipe"])  # the hook app.run calls for metrics.json
    assert set(dec) == set(branches)
    assert all(d["status"] == "decided" and d["choice"] in ("eager", "compile") for d in dec.values()), dec
    assert all(set(d["timings_us"]) == {"eager", "compile"} for d in dec.values()), dec
    want = run(compose(*common, "compile=eager"), quiet=True)["requests"]
    assert [r.output_ids for r in seen["requests"]] == [r.output_ids for r in want]


def test_a_fused_top_k_decision_is_recorded_under_its_policy_key(prompts_file, monkeypatch):
    """compile=whole runs both top-k steps as one function under `later`'s policy: its decision is recorded as
    draft_topk.later (the key the user set), not under the function's own name (draft_topk.fused)."""
    path = prompts_file(["abc de=()\n" * 2, "x = (a"])
    cfg = compose("model=random_tiny", f"workload.prompts_file={path}", "workload.max_new_tokens=8", "compile=whole",
                  "compile.draft_topk.later='auto(backend=aot_eager)'")
    dec = collect_decisions(run_watched(monkeypatch, cfg)["pipe"])
    assert set(dec) == {"draft_topk.later"}, dec
