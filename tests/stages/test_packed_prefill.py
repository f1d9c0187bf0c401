"""Prefill packs requests of different lengths into one row (no padding) when every layer is dense."""
import pytest

import specpipe.decode.pipeline as pipeline_mod
from helpers import compose, random_prompts
from specpipe.run import run
from specpipe.models.random_tiny import build_random_tiny

LENGTHS = [3, 17, 40, 9, 64, 1]
REAL_PACK = pipeline_mod.Pipeline.pack_prefill


def decode(path, pair, monkeypatch, packed: bool, *overrides):
    calls = []

    def spy(self, *a):
        out = REAL_PACK(self, *a) if packed else None
        calls.append(out is not None)
        return out
    monkeypatch.setattr(pipeline_mod.Pipeline, "pack_prefill", spy)
    cfg = compose("model=random_tiny", "device.dtype=float64", f"workload.prompts_file={path}",
                  "workload.max_new_tokens=12", "workload.batch_size=3", "speculation=static", *overrides)
    out = run(cfg, quiet=True, pair=pair)
    return [r.output_ids for r in out["requests"]], out["metrics"], calls


@pytest.mark.parametrize("draft", [["draft=none"], ["draft.topk=2", "draft.num_steps=3"], ["draft=ngram"]])
def test_packed_prefill_decodes_like_the_padded_one(draft, prompts_file, monkeypatch):
    """Same tokens and (EAGLE: the head reads the prefill's hidden states) the same acceptance."""
    path = prompts_file(random_prompts(7, LENGTHS))
    pair = build_random_tiny(seed=2, dtype="float64")
    want, m_pad, calls = decode(path, pair, monkeypatch, False, *draft)
    got, m_pack, calls = decode(path, pair, monkeypatch, True, *draft)
    assert any(calls), "no prefill was packed: the test would not exercise it"
    assert got == want
    assert m_pack["accept_length_mean"] == m_pad["accept_length_mean"]
    assert m_pack["kv_leaked_slots"] == 0


def test_window_and_sparse_models_keep_the_padded_prefill(prompts_file, monkeypatch):
    path = prompts_file(random_prompts(7, LENGTHS))
    for pair, extra in ((build_random_tiny(seed=2, dtype="float64", sliding_window=8), ["model.sliding_window=8",
                                                                                        "allocator=swa"]),
                        (build_random_tiny(seed=2, dtype="float64", sparse_top_k=4), ["model.sparse_top_k=4",
                                                                                      "allocator=hisparse"])):
        _, _, calls = decode(path, pair, monkeypatch, True, "draft=none", *extra)
        assert calls and not any(calls)


@pytest.mark.parametrize("draft", [["draft.topk=2", "draft.num_steps=3"],
                                   ["draft=standalone", "draft.topk=1", "draft.num_steps=3"]])
def test_draft_models_prefill_over_the_packed_prompts(draft, prompts_file, monkeypatch):
    """The draft model's forward over new prompts takes the packed row too (one [1, sum(lens)] input), not
    the padded [B, T] batch: ragged prompts otherwise cost the draft T * B tokens and T^2 attention."""
    from torch import nn

    path = prompts_file(random_prompts(7, LENGTHS))
    pair = build_random_tiny(seed=2, dtype="float64")
    draft_model = pair.draft if "draft=standalone" not in draft else None
    seen = []
    real_call = nn.Module.__call__

    def spy(self, *args, **kwargs):
        if self is draft_model or (draft_model is None and self is not pair.target
                                   and type(self).__name__ == "LlamaForCausalLM"):
            seen.append(tuple(args[0].shape))
        return real_call(self, *args, **kwargs)
    monkeypatch.setattr(nn.Module, "__call__", spy)
    for packed in (False, True):
        seen.clear()
        decode(path, pair, monkeypatch, packed, *draft)
        prefill = [s for s in seen if s[1] > 4]  # rounds see at most num_steps + 1 columns
        assert prefill, seen
        assert all(s[0] == 1 for s in prefill) == packed, (packed, prefill)  # padded: some [B > 1, T]
