"""Linear weight layouts: same values in the chosen storage, shared weights stay shared, auto keeps the faster."""
import pytest
import torch
from torch import nn

from specpipe.devices.base import Device
from specpipe.devices.cpu import CpuDevice
from specpipe.devices.weight_layout import MARGIN, as_layout, is_column_major, lay_out_weights, linear_weights
from specpipe.models.random_tiny import build_random_tiny


def linears(model):
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


def test_column_layout_keeps_values_and_shape():
    w = torch.randn(7, 5)
    c = as_layout(w, "column")
    assert c.shape == w.shape and torch.equal(c, w)
    assert is_column_major(c) and not is_column_major(w) and c.stride() == (1, 7)
    assert as_layout(c, "column") is c  # already so: no copy
    r = as_layout(c, "row")
    assert r.is_contiguous() and torch.equal(r, w)


def test_column_layout_of_a_model_gives_the_same_forward_and_keeps_ties():
    pair = build_random_tiny(tie_word_embeddings=True, seed=3)
    target, head = pair.target, pair.draft
    ids = torch.randint(0, 258, (2, 9))
    with torch.no_grad():
        before = target.logits(target(ids))
    shared = {id(p) for p in head.parameters()} & {id(p) for p in target.parameters()}
    report = lay_out_weights([target, head], "column")
    tied = target.lm_head.weight
    assert tied is target.embed_tokens.weight and tied.is_contiguous()  # the embedding reads rows: untouched
    moved = [m.weight for m in linears(target) + linears(head) if m.weight is not tied]
    assert moved and all(is_column_major(w) for w in moved)
    # parameters the head shares with the target are still the same objects (changed in place)
    assert shared == {id(p) for p in head.parameters()} & {id(p) for p in target.parameters()}
    with torch.no_grad():
        after = target.logits(target(ids))
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    assert all(e["layout"] == "column" for e in report.values())
    assert sum(e["count"] for e in report.values()) == len(moved)
    lay_out_weights([target, head], "row")  # and back
    assert all(w.is_contiguous() for w in moved)


def fake_timer(speed):
    """A timer that reports speed[(out, in, layout)] seconds and counts its calls."""
    calls = []

    def timer(weights, rows):
        w = weights[0]
        lay = "column" if is_column_major(w) else "row"
        calls.append((tuple(w.shape), rows, lay))
        return speed[(w.shape[0], w.shape[1], lay)] * rows
    timer.calls = calls
    return timer


def test_auto_keeps_the_faster_layout_per_shape_and_times_each_once():
    model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.Linear(16, 8, bias=False), nn.Linear(8, 16, bias=False))
    speed = {(16, 8, "row"): 2.0, (16, 8, "column"): 1.0,  # column clearly faster
             (8, 16, "row"): 1.0, (8, 16, "column"): 1.0 - MARGIN / 2}  # within the margin: keep row
    timer = fake_timer(speed)
    report = lay_out_weights([model], "auto", rows=(1, 4), timer=timer)
    assert is_column_major(model[0].weight) and is_column_major(model[2].weight)
    assert model[1].weight.is_contiguous()
    assert report["16x8 float32"]["layout"] == "column" and report["16x8 float32"]["count"] == 2
    assert report["8x16 float32"]["layout"] == "row"
    assert report["16x8 float32"]["us"] == {"row": 10e6, "column": 5e6}  # summed over rows 1 and 4
    assert sorted(timer.calls) == sorted((s, r, lay) for s in ((16, 8), (8, 16)) for r in (1, 4)
                                         for lay in ("row", "column"))
    n = len(timer.calls)
    lay_out_weights([model], "auto", rows=(1, 4), timer=timer)  # measured before in this process
    assert len(timer.calls) == n


def test_devices_resolve_auto():
    model = nn.Sequential(nn.Linear(64, 256, bias=False))
    assert not Device.times_weight_layout and CpuDevice.times_weight_layout
    dev = CpuDevice(weight_layout="column")
    dev.lay_out_weights([model], (1,))
    assert is_column_major(model[0].weight)
    dev = CpuDevice(weight_layout="row")
    dev.lay_out_weights([model], (1,))
    assert model[0].weight.is_contiguous()
    report = CpuDevice().lay_out_weights([model], (1,))  # auto on CPU: really timed
    assert report["256x64 float32"]["us"]["row"] > 0 and report["256x64 float32"]["us"]["column"] > 0


def test_bad_layout_is_refused():
    with pytest.raises(ValueError, match="diagonal"):
        lay_out_weights([nn.Linear(2, 2)], "diagonal")


def test_run_applies_and_reports_the_layout():
    from helpers import compose

    from specpipe.run import run

    pair = build_random_tiny(seed=1)
    cfg = compose("model=random_tiny", "workload.num_prompts=2", "workload.max_new_tokens=4", "draft=eagle",
                  "device.weight_layout=column")
    res = run(cfg, quiet=True, pair=pair)
    layout = res["metrics"]["weight_layout"]
    assert layout and all(e["layout"] == "column" for e in layout.values())
    # run() fuses q|k|v and gate|up: the fused weights are laid out, their parts stay views into them
    fused = [m for m in linears(pair.target) + linears(pair.draft) if hasattr(m, "fused_parts")]
    parts = {id(p) for f in fused for p in f.fused_parts}
    used = [m for m in linears(pair.target) + linears(pair.draft) if id(m) not in parts]
    assert fused and all(is_column_major(m.weight) for m in used)
    for f in fused:
        assert torch.equal(torch.cat([p.weight for p in f.fused_parts]), f.weight)
        assert all(p.weight.untyped_storage().data_ptr() == f.weight.untyped_storage().data_ptr()
                   for p in f.fused_parts)
    assert sum(e["count"] for e in layout.values()) == len({id(m.weight) for m in used})
    assert len(linear_weights([pair.target, pair.draft])) == len(layout)


def test_auto_keeps_the_layout_a_compiled_forward_froze_though_later_row_counts_prefer_the_other():
    """A compiled forward is specialised for its weights' strides: a flip recompiles it in every run that flips."""
    from specpipe.devices.weight_layout import freeze_layouts

    model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.Linear(16, 8, bias=False))
    calls = []

    def timer(weights, rows):  # column wins for few rows, row wins for many
        calls.append(rows)
        return (1.0 if rows < 8 else 3.0) if is_column_major(weights[0]) else 2.0
    first = lay_out_weights([model], "auto", rows=(1, 4), timer=timer)
    assert first["16x8 float32"]["layout"] == "column" and "kept" not in first["16x8 float32"]
    eager = lay_out_weights([model], "auto", rows=(1, 64), timer=timer)  # eager models: re-timed for these rows
    assert eager["16x8 float32"]["layout"] == "row" and model[0].weight.is_contiguous()
    lay_out_weights([model], "auto", rows=(1, 4), timer=timer)
    freeze_layouts([model])  # a forward was compiled on the column-major weights
    n = len(calls)
    later = lay_out_weights([model], "auto", rows=(1, 64), timer=timer)
    assert len(calls) == n  # not timed again
    assert is_column_major(model[0].weight) and is_column_major(model[1].weight)
    assert later["16x8 float32"] == {"layout": "column", "count": 1, "kept": True}
    lay_out_weights([model], "row", rows=(1, 64), timer=timer)  # forcing a layout still applies it
    assert model[0].weight.is_contiguous()
    lay_out_weights([model], "auto", rows=(1, 64), timer=timer)  # and auto goes back to what was compiled
    assert is_column_major(model[0].weight)
    fresh = nn.Sequential(nn.Linear(8, 16, bias=False))  # a newly loaded model is timed for its own rows
    report = lay_out_weights([fresh], "auto", rows=(1, 64), timer=timer)
    assert report["16x8 float32"]["layout"] == "row" and "kept" not in report["16x8 float32"]
