"""compile.verify.round: a greedy round's verify (tree batch, target forward, acceptance, commit bookkeeping) as
one call, with the separate calls' tokens; runs that cannot use it say so and verify as before."""
import pytest

from helpers import compose, random_eagle3_pair
from pipeline_spy import run_watched

AOT = "'compile(dynamic=true, fullgraph=true, backend=aot_eager)'"
BASE = ["model=random_tiny", "device.dtype=float64", "workload.num_prompts=5", "workload.max_new_tokens=12",
        "workload.batch_size=3", "speculation=static"]  # every tree verified whole: the same rounds eager and fused


def counted(monkeypatch, cfg):
    """(outputs, metrics, rounds verified through the separate accept call, whether the pipeline verified in
    one call)."""
    from specpipe.decode.speculative import SpecPipeline

    calls = [0]
    accept = SpecPipeline.accept

    def counting(self, *a):
        calls[0] += 1
        return accept(self, *a)

    monkeypatch.setattr(SpecPipeline, "accept", counting)
    from specpipe.drafters.eagle import EagleProposer

    after = EagleProposer.after_verify

    def counting_extend(self, *a):
        calls.append("extend")
        return after(self, *a)

    monkeypatch.setattr(EagleProposer, "after_verify", counting_extend)
    seen = run_watched(monkeypatch, cfg)
    counted.extends = calls.count("extend")
    return [r.output_ids for r in seen["requests"]], seen["metrics"], calls[0], seen["pipe"].fused_verify


@pytest.mark.parametrize("draft", [["draft.topk=1", "draft.num_steps=4", "draft.num_draft_tokens=5"],
                                   ["draft.topk=4", "draft.num_steps=3", "draft.num_draft_tokens=8"],
                                   ["draft=ngram"]],
                         ids=["eagle-chain", "eagle-tree", "ngram"])
def test_one_verify_call_per_round_gives_the_separate_calls_tokens(draft, monkeypatch):
    eager, m_eager, separate, _ = counted(monkeypatch, compose(*BASE, *draft))
    assert separate == m_eager["num_verify_steps"] > 0
    eager_extends = counted.extends
    fused, m_fused, separate, one_call = counted(monkeypatch, compose(*BASE, *draft, f"compile.verify.round={AOT}"))
    assert separate == 0 and one_call
    if draft[0] != "draft=ngram":  # EAGLE: the head's extend over the committed tokens ran inside the verify call
        assert eager_extends > 0 and counted.extends == 0
    assert fused == eager
    for key in ("accept_length_mean", "acceptance_rate_per_position", "kv_leaked_slots"):
        assert m_fused[key] == m_eager[key], key
    assert m_fused.get("unapplied_compile_policies") is None


@pytest.mark.parametrize("why, extra", [
    ("some request samples", ["sampling.temperature=0.8", "sampling.seed=3"]),
    ("a repetition penalty changes each tree node's logits first", ["sampling.repetition_penalty=1.3"]),
    ("workload.logprobs reads the raw logits", ["workload.logprobs=true"]),
    ("the SWA window pool's slots are translated", ["model.sliding_window=8", "allocator=swa"]),
])
def test_runs_that_cannot_verify_in_one_call_say_so_and_decode_as_before(why, extra, monkeypatch, capsys):
    ref, m_ref, _, _ = counted(monkeypatch, compose(*BASE, *extra))
    out, m, separate, one_call = counted(monkeypatch, compose(*BASE, *extra, f"compile.verify.round={AOT}"))
    assert separate == m["num_verify_steps"] > 0 and not one_call and out == ref
    assert m["unapplied_compile_policies"] == [f"compile.verify.round={AOT.strip(chr(39))}"]
    err = capsys.readouterr().err
    assert "the rounds verify in separate calls in this run" in err and why in err


def test_draft_none_has_no_round_to_verify(capsys):
    from specpipe.run import run

    m = run(compose(*BASE, "draft=none", "compile.verify.round=compile"), quiet=True)["metrics"]
    assert m["unapplied_compile_policies"] == ["compile.verify.round=compile"]
    assert "no branch of this run (draft=none) reads it" in capsys.readouterr().err


def test_an_eagle3_head_extends_inside_the_verify_call(monkeypatch):
    """EAGLE-3 drafts from chosen target layers: the extend inside verify.round must read those features, as the
    separate after_verify does (the acceptance would drop otherwise)."""
    pair = random_eagle3_pair()
    common = ["model=random_tiny", "model.num_layers=4", *BASE, "draft.topk=2", "draft.num_steps=3"]
    eager = run_watched(monkeypatch, compose(*common), pair=pair)
    fused = run_watched(monkeypatch, compose(*common, f"compile.verify.round={AOT}"), pair=pair)
    assert fused["pipe"].fused_verify and fused["pipe"].verify.draft is not None
    assert [r.output_ids for r in fused["requests"]] == [r.output_ids for r in eager["requests"]]
    assert fused["metrics"]["accept_length_mean"] == eager["metrics"]["accept_length_mean"] > 1
