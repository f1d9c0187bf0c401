"""compile.prefill.target_forward: the padded prefill's forward compiled, with the eager prefill's tokens."""
import pytest

from helpers import compose, random_eagle3_pair
from pipeline_spy import run_watched

AOT = "'compile(dynamic=true, fullgraph=true, backend=aot_eager)'"
BASE = ["device.dtype=float64", "workload.num_prompts=5", "workload.max_new_tokens=10", "workload.batch_size=1"]


def outputs(monkeypatch, cfg, pair=None):
    seen = run_watched(monkeypatch, cfg, pair=pair)
    return [r.output_ids for r in seen["requests"]], seen


@pytest.mark.parametrize("draft", ["draft=eagle", "draft=none", "draft=ngram"])
def test_a_compiled_prefill_decodes_like_the_eager_one(draft, monkeypatch):
    """Batch 1: every admission is one padded prompt of a new length (T symbolic: no graph per length)."""
    eager, _ = outputs(monkeypatch, compose("model=random_tiny", *BASE, draft))
    got, seen = outputs(monkeypatch,
                        compose("model=random_tiny", *BASE, draft, f"compile.prefill.target_forward={AOT}"))
    assert got == eager
    assert "target_forward" in seen["pipe"].prefill.wrapped and seen["metrics"]["recompile_limit_hits"] == 0
    lengths = {len(r.prompt_ids) for r in seen["requests"]}
    # one graph for every prompt length (an earlier case may already have compiled it on this cached model)
    assert len(lengths) == 5 and seen["graphs"][-1] - seen["graphs_before"] <= 2


def test_an_eagle3_target_prefill_compiled_gives_its_features(monkeypatch):
    """EAGLE-3 reads chosen target layers at prefill: the compiled branch returns those, not the final hidden."""
    pair = random_eagle3_pair()
    common = ["model=random_tiny", "model.num_layers=4", *BASE, "draft.topk=2", "draft.num_steps=3",
              "speculation=static"]  # (the same rounds in both runs: their acceptance is compared)
    want, _ = outputs(monkeypatch, compose(*common, "draft=none"), pair)
    eager, m_eager = outputs(monkeypatch, compose(*common), pair)
    got, m = outputs(monkeypatch, compose(*common, f"compile.prefill.target_forward={AOT}"), pair)
    assert got == eager == want
    assert m["metrics"]["accept_length_mean"] == m_eager["metrics"]["accept_length_mean"]
