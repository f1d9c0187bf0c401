"""The report's decode measures the head: every round verifies the whole draft, whatever the default policy is."""
from __future__ import annotations

import torch

import specpipe.run
from specpipe.models.hf.load import load_tiny
from specpipe.train.__main__ import compose_train
from specpipe.train.evaluate import decode_metrics
from specpipe.train.heads import new_head, save_head


def test_the_decode_verifies_every_draft_under_the_static_policy(tmp_path, monkeypatch):
    """Under the default `cost`, a head that does not pay on the machine is paused and the acceptance measured is
    near 1 (a SmolLM2 head: 1.01 under cost, 1.56 verifying every draft); the report must say what the head drafts."""
    pair = load_tiny(draft_path=None)
    head = new_head(type("H", (), {"kind": "eagle3", "aux_layers": None, "norm_before_residual": False}),
                    pair.target, torch.arange(200), seed=5)
    save_head(head, tmp_path / "head", "specforge", pair.target, 3)
    seen = []

    def fake_run(cfg, **kw):
        seen.append((cfg.speculation, cfg.draft.path))
        return {"metrics": {"accept_length_mean": 1.5, "acceptance_rate_per_position": [0.5], "tokens_per_s": 1.0}}

    monkeypatch.setattr(specpipe.run, "run", fake_run)
    cfg = compose_train(["model=tiny", f"out={tmp_path / 'head'}", "eval.decode_prompts=2"])
    out = decode_metrics(cfg, pair, tmp_path / "head", "float32", "cpu")
    assert len(seen) == 2 and {k for k in ("chain", "tree") if out[k]["accept_length_mean"] == 1.5} == {"chain", "tree"}
    for speculation, path in seen:
        assert speculation._target_ == "specpipe.speculation.static.StaticPolicy", speculation
        assert path == str(tmp_path / "head")
