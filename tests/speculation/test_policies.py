"""Every speculation policy with every drafter: greedy outputs equal plain decoding, the per-request counts add up to
the run's, per-request limits hold, and the trees a step verifies follow what the policy kept."""
import json

import pytest

from specpipe.run import run
from specpipe.speculation.cost import CostPolicy
from helpers import compose

POLICIES = ["static", "schedule", "adaptive", "cost"]
FREE = "{" + ",".join(f"{b}:{{1:10,12:10}}" for b in (1, 2, 3)) + "}"  # speculation.cost_ms: any width is free
STEEP = "{" + ",".join(f"{b}:{{1:10,12:30}}" for b in (1, 2, 3)) + "}"  # a verified token costs ~2 ms: trimming pays
DRAFTERS = ["ngram", "suffix", "eagle"]


def prompt_lines(extra=None):
    """Held-out-like code contexts of mixed lengths, so a batch holds requests with long and short drafts."""
    texts = ["def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
             "import os\nimport sys\n\n", "class Point:\n    def __init__(self, x, y):\n        self.x = x\n",
             "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(j)\nfor k in range(10):\n",
             "x = 1\n"]
    return [{"prompt": t, **((extra or {}).get(i, {}))} for i, t in enumerate(texts)]


def decode(tmp_path, *overrides, extra=None, name="p.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(x) + "\n" for x in prompt_lines(extra)))
    cfg = compose("model=tiny", "device.dtype=float64", f"workload.prompts_file={path}", "workload.max_new_tokens=24",
                  "workload.batch_size=3", *overrides)
    return run(cfg, quiet=True)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return [r.output_ids for r in decode(tmp_path_factory.mktemp("plain"), "draft=none")["requests"]]


@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_output_is_plain_decoding_and_counts_add_up(tmp_path, plain, drafter, policy):
    out = decode(tmp_path, f"draft={drafter}", f"speculation={policy}")
    reqs, m = out["requests"], out["metrics"]
    assert [r.output_ids for r in reqs] == plain
    assert sum(r.num_draft_tokens for r in reqs) == m["num_draft_tokens"]
    assert sum(r.num_accepted_tokens for r in reqs) == m["num_accepted_tokens"]
    assert sum(sum(r.accept_histogram) for r in reqs) == m["num_rounds"]
    assert m["kv_leaked_slots"] == 0
    widths = m["speculation"]["verify_width_histogram"]
    assert sum(widths.values()) == m["num_verify_steps"]
    if policy == "static":
        assert set(widths) == {m["config"]["draft"]["num_draft_tokens"]}


def test_trimming_verifies_fewer_tokens_than_static_with_the_same_output(tmp_path, plain):
    """n-gram padding and unlikely nodes are not verified under cost: fewer verified tokens per step. The curve is
    fixed: a measured one on a machine where width 12 costs what width 1 does rightly keeps every node."""
    static = decode(tmp_path, "draft=ngram", "speculation=static")["metrics"]["speculation"]
    cost = decode(tmp_path, "draft=ngram", "speculation=cost", f"speculation.cost_ms={STEEP}")
    assert [r.output_ids for r in cost["requests"]] == plain
    cost = cost["metrics"]["speculation"]
    def mean_width(h):
        return sum(w * n for w, n in h.items()) / sum(h.values())
    assert mean_width(cost["verify_width_histogram"]) < mean_width(static["verify_width_histogram"])
    assert cost["cost_curve_ms"]  # the curve it chose by is reported
    assert cost["acceptance_by_context"][0]["rounds"] > 0


@pytest.mark.parametrize("policy", ["static", "cost"])
def test_max_context_decodes_plainly(tmp_path, plain, policy):
    out = decode(tmp_path, "draft=ngram", f"speculation={policy}", "speculation.max_context=1")
    assert [r.output_ids for r in out["requests"]] == plain
    assert out["metrics"]["num_draft_tokens"] == 0


def test_schedule_off_past_a_batch_size(tmp_path, plain):
    out = decode(tmp_path, "draft=ngram", "speculation=schedule", "speculation.by_batch=[[1,3],[3,0]]")
    assert [r.output_ids for r in out["requests"]] == plain
    widths = out["metrics"]["speculation"]["verify_width_histogram"]
    assert max(widths) <= 4  # never more than 3 drafts per request, none while 3 run together
    assert out["metrics"]["speculation"]["steps_without_draft"] > 0


@pytest.mark.parametrize("policy", ["static", "cost"])
def test_per_request_limits(tmp_path, plain, policy):
    """"speculate": false never drafts; "max_spec_tokens" caps the drafts a request verifies per round."""
    extra = {0: {"speculate": False}, 3: {"max_spec_tokens": 1}, 1: {"max_spec_tokens": 0}}
    free = [f"speculation.cost_ms={FREE}"] if policy == "cost" else []  # (a measured curve may rule drafts out)
    out = decode(tmp_path, "draft=ngram", f"speculation={policy}", *free, extra=extra)
    reqs = out["requests"]
    assert [r.output_ids for r in reqs] == plain
    assert reqs[0].num_draft_tokens == 0 and reqs[1].num_draft_tokens == 0
    assert reqs[3].num_draft_tokens <= sum(reqs[3].accept_histogram)  # at most one draft per round
    assert len(reqs[3].accept_histogram) <= 2
    assert reqs[2].num_draft_tokens > sum(reqs[2].accept_histogram)  # an unlimited request drafts more than one


def test_completions_carry_the_counts(tmp_path):
    cfg = compose("model=tiny", "workload.num_prompts=2", "workload.max_new_tokens=16", "draft=ngram",
                  "speculation=cost", f"hydra.run.dir={tmp_path}")
    run(cfg, quiet=True, out_dir=str(tmp_path))
    lines = [json.loads(x) for x in (tmp_path / "completions.jsonl").read_text().splitlines()]
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert sum(x["num_draft_tokens"] for x in lines) == m["num_draft_tokens"]
    assert sum(x["num_accepted_tokens"] for x in lines) == m["num_accepted_tokens"]
    assert all(sum(x["acceptance_histogram"]) > 0 for x in lines)
    assert m["speculation"]["policy"] == "cost"


def test_a_policy_with_draft_none_is_noted_as_unread(capsys):
    """A policy other than the default, chosen with draft=none, is noted; the default one is not."""
    run(compose("model=tiny", "draft=none", "speculation=adaptive", "workload.num_prompts=1",
                "workload.max_new_tokens=2"), quiet=True)
    assert "speculation=adaptive is not read: draft=none drafts nothing" in capsys.readouterr().err
    run(compose("model=tiny", "draft=none", "workload.num_prompts=1", "workload.max_new_tokens=2"), quiet=True)
    assert "is not read" not in capsys.readouterr().err


def test_cost_pads_steps_to_a_cheaper_width_with_the_same_output(tmp_path, plain):
    """A curve where 5 tokens cost less than 1 (CPU, packed weights): every step is laid out at least 5 wide,
    drafts or not, and greedy output is unchanged."""
    rows = "{" + ",".join(f"{b}:{{1:50,5:40,12:400}}" for b in (1, 2, 3)) + "}"
    out = decode(tmp_path, "draft=ngram", "speculation=cost", f"speculation.cost_ms={rows}")
    assert [r.output_ids for r in out["requests"]] == plain
    assert min(out["metrics"]["speculation"]["verify_width_histogram"]) == 5


def test_cost_is_told_when_the_batch_drains(tmp_path, monkeypatch):
    """5 prompts on 3 rows: the policy sees 2 requests waiting for a row at first, then none (`cost.worth`)."""
    seen, limits = [], CostPolicy.limits
    monkeypatch.setattr(CostPolicy, "limits", lambda self, reqs, L, waiting=0: seen.append(waiting) or
                        limits(self, reqs, L, waiting))
    decode(tmp_path, "draft=ngram", "speculation=cost")
    assert seen[0] == 2 and seen[-1] == 0 and sorted(seen, reverse=True) == seen


def test_plain_step_latency_counts_only_steps_that_verified_no_draft(tmp_path):
    """metrics.json's plain_steps (and their median latency), by batch size: every step of draft=none and of cost
    past max_context (which never drafts); under static an EAGLE head drafts on (nearly) every step."""
    def plain(*overrides):
        m = decode(tmp_path, *overrides)["metrics"]
        assert m["plain_steps"].keys() == m["plain_step_ms_p50"].keys()
        return sum(m["plain_steps"].values()), m["num_verify_steps"]
    n, steps = plain("draft=none")
    assert n == steps
    n, steps = plain("draft=ngram", "speculation=cost", "speculation.max_context=1")
    assert n == steps
    n, steps = plain("draft=eagle", "speculation=static")
    assert n < steps / 2
