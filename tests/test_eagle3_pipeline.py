"""An EAGLE-3 head (random weights, reduced draft vocabulary) drafts through the pipeline, losslessly."""
import torch

from helpers import compose
from specpipe.app import run
from specpipe.models.eagle3 import Eagle3Head
from specpipe.models.random_tiny import build_random_tiny


def test_eagle3_head_drafts_losslessly(prompts_file):
    pair = build_random_tiny(seed=4, dtype="float64", num_layers=4)
    head = Eagle3Head(pair.target.config, pair.target, draft_vocab_size=200, aux_layers=[0, 1, 3])
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3 / max(1, p.shape[-1]) ** 0.5)
        head.d2t.zero_()  # draft ids 0..199 are target ids 0..199
    pair.draft = head.to(torch.float64)
    path = prompts_file(["def main():", "x = [1, 2, 3]\nfor i in x:", "import os"])
    common = ["model=random_tiny", "model.num_layers=4", "device.dtype=float64", f"workload.prompts_file={path}",
              "workload.max_new_tokens=16", "workload.batch_size=3"]
    want = [r.output_ids for r in run(compose(*common, "draft=none"), quiet=True, pair=pair)["requests"]]
    out = run(compose(*common, "draft.topk=2", "draft.num_steps=3"), quiet=True, pair=pair)
    assert [r.output_ids for r in out["requests"]] == want
    assert out["metrics"]["kv_leaked_slots"] == 0
    assert out["metrics"]["num_verify_steps"] > 0
    # the target's forwards that also return aux layers go through its forward (and so the model timer)
    sm, mm = out["metrics"]["stage_ms"], out["metrics"]["stage_model_ms"]
    assert 0 < mm["verify"] <= sm["verify"] and 0 < mm["prefill"] <= sm["prefill"]
