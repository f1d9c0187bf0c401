"""An EAGLE-3 head (random weights, reduced draft vocabulary) drafts through the pipeline, losslessly."""
import copy

import torch

from helpers import compose, randomize_eagle3
from specpipe.run import run
from specpipe.models.eagle3 import Eagle3Head
from specpipe.models.random_tiny import build_random_tiny

PROMPTS = ["def main():", "x = [1, 2, 3]\nfor i in x:", "import os"]


def _plain_and_drafted(pair, prompts_file, *drafted):
    """(plain greedy output ids, the drafted run's result) over PROMPTS, batch 3 unless `drafted` says otherwise."""
    path = prompts_file(PROMPTS)
    common = ["model=random_tiny", "model.num_layers=4", "device.dtype=float64", f"workload.prompts_file={path}",
              "workload.max_new_tokens=16", "workload.batch_size=3"]
    want = [r.output_ids for r in run(compose(*common, "draft=none"), quiet=True, pair=pair)["requests"]]
    out = run(compose(*common, "draft.topk=2", "draft.num_steps=3", *drafted), quiet=True, pair=pair)
    assert out["metrics"]["kv_leaked_slots"] == 0 and out["metrics"]["num_verify_steps"] > 0
    return want, out


def test_eagle3_head_drafts_losslessly(prompts_file):
    pair = build_random_tiny(seed=4, dtype="float64", num_layers=4)
    pair.draft = randomize_eagle3(
        Eagle3Head(pair.target.config, pair.target, draft_vocab_size=200, aux_layers=[0, 1, 3]), 0)
    want, out = _plain_and_drafted(pair, prompts_file)
    assert [r.output_ids for r in out["requests"]] == want
    # the target's forwards that also return aux layers go through its forward (and so the model timer)
    sm, mm = out["metrics"]["stage_ms"], out["metrics"]["stage_model_ms"]
    assert 0 < mm["verify"] <= sm["verify"] and 0 < mm["prefill"] <= sm["prefill"]


def test_eagle3_head_without_aux_hidden_states_drafts_losslessly_from_the_final_hidden(prompts_file):
    """use_aux_hidden_state false: the pipeline gives the head the target's final hidden (no aux layers); the
    head's first forward (the draft extend over the prompt) sees exactly the target's final hidden of the prompt."""
    pair = build_random_tiny(seed=4, dtype="float64", num_layers=4)
    t = pair.target
    head = pair.draft = randomize_eagle3(Eagle3Head(t.config, t, use_aux_hidden_state=False), 0)
    seen = []
    forward = head.forward
    head.forward = lambda ids, hidden, batch=None, **kw: (seen.append(hidden.detach().clone()),
                                                         forward(ids, hidden, batch, **kw))[1]
    want, out = _plain_and_drafted(pair, prompts_file, "workload.batch_size=1")
    assert [r.output_ids for r in out["requests"]] == want
    prompt = out["requests"][0].prompt_ids
    t.kv = None
    with torch.no_grad():
        final = t(torch.tensor([prompt]))
    assert seen[0].shape == final.shape and torch.allclose(seen[0], final)
    assert all(h.shape[-1] == t.config.hidden_size for h in seen)


def test_eagle3_head_of_two_layers_drafts_losslessly(prompts_file):
    pair = build_random_tiny(seed=4, dtype="float64", num_layers=4)
    cfg = copy.deepcopy(pair.target.config)
    cfg.num_hidden_layers = 2
    head = pair.draft = randomize_eagle3(Eagle3Head(cfg, pair.target, draft_vocab_size=200, aux_layers=[0, 1, 3]), 1)
    want, out = _plain_and_drafted(pair, prompts_file)
    assert [r.output_ids for r in out["requests"]] == want
    assert len(head.kv.keys) == 2
