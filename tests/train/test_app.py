"""python -m specpipe.train on the shipped tiny target: the head it saves loads through draft.path and drafts better
than a random head; a stopped run resumes from its checkpoint; bad settings exit 2 with one paragraph."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specpipe.config.compose import compose_config
from specpipe.models.hf.load import load_draft, load_tiny
from specpipe.run import run
from specpipe.train.heads import new_head, save_head

ROOT = Path(__file__).resolve().parents[2]
# a small, quick run: the stdlib sample, 4 held-out prompts, a short budget
FAST = ["model=tiny", "data.sources=[stdlib]", "data.max_chars=400000",
        "data.distill_batch=8", "data.distill_new_tokens=64", "data.seq_len=256", "train.batch_tokens=2048",
        "train.lr=3e-3", "eval.heldout_prompts=4", "eval.heldout_tokens=4096", "eval.decode_prompts=0", "eval.steps=4",
        "device.num_threads=1"]  # (the machine's cores are shared: two OpenMP threads on one core crawl)
VD = ["head.draft_vocab_size=200"]  # EAGLE-3: a draft vocabulary smaller than the target's 258 ids


def train_cli(*args, cwd=ROOT):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "specpipe.train", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A head trained for a few steps, stopped (its checkpoint kept), then resumed to more steps."""
    out = tmp_path_factory.mktemp("train") / "head"
    first = train_cli(*FAST, *VD, f"out={out}", "train.minutes=0.5", "train.max_steps=3")
    assert first.returncode == 0, first.stderr
    state = torch.load(out / "checkpoint" / "state.pt", weights_only=True)
    assert state["step"] == 3
    # a longer budget (the resumed run trains until train.max_steps)
    again = train_cli(*FAST, *VD, f"out={out}", "train.minutes=3", "train.max_steps=30", "resume=true")
    assert again.returncode == 0, again.stderr
    return out, first, again


def accept_length(head_dir) -> float:
    cfg = compose_config(["model=tiny", f"draft.path={head_dir}", "draft.topk=1", "draft.num_steps=4",
                          "draft.num_draft_tokens=5", "workload.prompt_set=heldout", "workload.num_prompts=4",
                          "workload.max_new_tokens=48", "speculation=static"])  # the whole chain every round: the
    # head's own acceptance, not the cost policy's timing-dependent choice of what to verify
    return run(cfg, quiet=True)["metrics"]["accept_length_mean"]


def test_resume_goes_on_from_the_checkpoint(trained):
    out, first, again = trained
    state = torch.load(out / "checkpoint" / "state.pt", weights_only=True)
    assert state["step"] == 30  # 3 steps, then 27 more after the resume
    report = json.loads((out / "train_report.json").read_text())
    assert report["train"]["step"] == 30
    assert "data" not in report["time_s"]  # the resumed run decoded nothing again: the data came from data.pt


def test_trained_head_drafts_better_than_a_random_one(trained, tmp_path):
    out, _, _ = trained
    target = load_tiny(draft_path=None).target
    head = new_head(type("H", (), {"kind": "eagle3", "aux_layers": None, "norm_before_residual": False}),
                    target, torch.arange(200), seed=5)
    save_head(head, tmp_path / "random", "specforge", target, 3)  # what the trainer starts from
    trained_al, random_al = accept_length(out), accept_length(tmp_path / "random")
    assert trained_al > 1.3 and trained_al > random_al + 0.2, (trained_al, random_al)


def test_report_says_what_was_trained_on_and_how_well_it_drafts(trained):
    out, _, _ = trained
    r = json.loads((out / "train_report.json").read_text())
    d = r["data"]
    assert d["corpus_pieces"] > 0 and d["distill_sequences"] > 0 and d["train_windows_tokens"] > 0
    assert d["distill_greedy"] > 0 and d["distill_sampled"] > 0  # both kinds of self-distillation
    assert d["heldout_prompts"] == 4 and d["heldout_greedy_tokens"] > 0
    h = r["heldout"]
    assert 0.3 < h["top1_agreement"] <= 1 and len(h["top1_agreement_per_step"]) == 4
    sim = h["simulated"]
    assert len(sim["acceptance_rate_per_position"]) == 4 and sim["rounds"] > 0
    assert 1 < sim["chain_acceptance_length"]["1"] <= sim["chain_acceptance_length"]["4"] <= 5
    assert r["head"]["kind"] == "eagle3" and r["head"]["draft_vocab_size"] == 200
    assert {"features", "train", "eval", "total"} <= set(r["time_s"])


def test_draft_vocabulary_maps_agree(trained):
    out, _, _ = trained
    from safetensors.torch import load_file

    t = load_file(str(out / "model.safetensors"))
    d2t, t2d = t["d2t"], t["t2d"]
    ids = torch.arange(d2t.numel()) + d2t  # the loader's rule: draft id d is target id d + d2t[d]
    assert d2t.numel() == 200 and t2d.dtype == torch.bool and int(t2d.sum()) == 200
    assert bool(t2d[ids].all()) and bool((ids[1:] > ids[:-1]).all())  # ascending, each one in t2d
    assert t["lm_head.weight"].shape[0] == 200


@torch.no_grad()
def test_saved_head_round_trips_both_layouts(trained, tmp_path):
    out, _, _ = trained
    target = load_tiny(draft_path=None).target
    head = load_draft(out, target)
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(0))
    aux = head.capture(target, ids)[1]
    want = head.logits(head(ids, aux))
    for layout in ("specforge", "speculators"):
        folder = save_head(head, tmp_path / layout, layout, target, 3)
        config = json.loads((folder / "config.json").read_text())
        again = load_draft(folder, target)
        assert again.aux_layers == head.aux_layers
        torch.testing.assert_close(again.logits(again(ids, aux)), want)
        if layout == "speculators":
            assert config["speculators_model_type"] == "eagle3"
            assert config["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in head.aux_layers]
        else:
            assert config["architectures"] == ["LlamaForCausalLMEagle3"]
            assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == head.aux_layers


def test_an_eagle1_head_trains_and_loads(tmp_path):
    out = tmp_path / "e1"
    p = train_cli(*FAST, "head=eagle1", f"out={out}", "train.minutes=0.3", "data.max_chars=100000",
                  "data.distill_share=0.1", "eval.decode_prompts=1")
    assert p.returncode == 0, p.stderr
    head = load_draft(out, load_tiny(draft_path=None).target)
    assert type(head).__name__ == "EagleHead"
    report = json.loads((out / "train_report.json").read_text())
    assert report["heldout"]["top1_agreement"] > 0.2
    assert report["decode"]["chain"]["accept_length_mean"] > 1 and report["decode"]["prompt_set"] == "heldout"


@pytest.mark.parametrize("args,said", [
    (["train.minutes=0"], "train.minutes=0.0 must be > 0"),
    (["head=eagle9"], "config group 'head' has no option 'eagle9' (valid: eagle1, eagle3)"),
    (["train.minuts=1"], "'train.minuts' is not a configuration key (valid keys under train:"),
    (["model=hf", "model.path=/nonexistent"], "model.path='/nonexistent' is not a model folder"),
    (["data.distill_share=0.6", "data.feature_share=0.4"], "leaves no time to train"),
    (["head.layout=vllm"], "head.layout='vllm' is unknown (valid: specforge, speculators)"),
    (["head.aux_layers=[1,99]"], "head.aux_layers=[1, 99] names a layer the target does not have"),
])
def test_bad_settings_exit_2_with_one_paragraph(tmp_path, args, said):
    p = train_cli(f"out={tmp_path / 'h'}", *args)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert said in p.stderr and "Traceback" not in p.stderr


def test_out_is_required_and_a_checkpoint_is_not_overwritten(tmp_path):
    p = train_cli()
    assert p.returncode == 2 and "out is required but not set" in p.stderr
    (tmp_path / "h" / "checkpoint").mkdir(parents=True)
    (tmp_path / "h" / "checkpoint" / "state.pt").write_bytes(b"")
    p = train_cli(f"out={tmp_path / 'h'}")
    assert p.returncode == 2 and "resume=true" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize("problem", ["", "no native bf16 here"])
def test_autocast_runs_in_float32_where_the_device_would_emulate_bf16(monkeypatch, problem):
    """On a CPU without native bf16 GEMMs, autocast made the features and each step ~8x slower: a run asked for it
    trains in float32 there, and says so."""
    from specpipe.devices.cpu import CpuDevice
    from specpipe.train.__main__ import compose_train
    from specpipe.train.app import load_target

    monkeypatch.setattr(CpuDevice, "bf16_autocast_problem", lambda self: problem)
    cfg = compose_train(["model=tiny", "out=unused", "train.autocast=true"])
    load_target(cfg)
    assert cfg.train.autocast is (not problem)
