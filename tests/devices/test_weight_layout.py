"""Linear weight layouts: same values in the chosen storage, shared weights stay shared, auto keeps the faster."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specpipe.devices.base import Device
from specpipe.devices.cpu import CpuDevice
from specpipe.devices.weight_layout import (MARGIN, PackedLinear, PackedPart, as_layout, is_column_major,
                                             lay_out_weights, linear, linear_weights, packable)
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


def test_auto_weighs_each_row_count_by_its_slowdown_not_its_seconds():
    """The widest verify's seconds dwarf a plain step's: summed in seconds, it alone would choose the layout, and the
    plain steps a trimming policy mostly takes would run in a layout 2x slower for them."""
    model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.Linear(8, 24, bias=False))
    speed = {(16, 1): {"row": 1.0, "column": 2.0}, (16, 64): {"row": 10.0, "column": 8.0},  # s: row 11, column 10
             (24, 1): {"row": 1.0, "column": 1.02}, (24, 64): {"row": 10.0, "column": 8.0}}

    def timer(weights, rows):
        return speed[weights[0].shape[0], rows]["column" if is_column_major(weights[0]) else "row"]
    report = lay_out_weights([model], "auto", rows=(1, 64), timer=timer)
    assert report["16x8 float32"]["layout"] == "row"  # slowdown: row 1 + 1.25, column 2 + 1
    assert report["16x8 float32"]["us"] == {"row": 11e6, "column": 10e6}
    assert report["24x8 float32"]["layout"] == "column"  # slowdown: row 1 + 1.25, column 1.02 + 1
    assert model[0].weight.is_contiguous() and is_column_major(model[1].weight)


def test_auto_keeps_the_plain_step_near_its_fastest_layout():
    """A layout 10 % slower on the fewest rows (a trimming policy's plain step, draft=none's whole step) is not
    chosen, however much it saves on the wide verifies; alone, those verifies choose it."""
    model = nn.Sequential(nn.Linear(8, 24, bias=False))
    speed = {1: {"row": 1.0, "column": 1.1}, 64: {"row": 10.0, "column": 5.0}}

    def timer(weights, rows):
        return speed[rows]["column" if is_column_major(weights[0]) else "row"]
    assert lay_out_weights([model], "auto", rows=(1, 64), timer=timer)["24x8 float32"]["layout"] == "row"
    assert lay_out_weights([model], "auto", rows=(64,), timer=timer)["24x8 float32"]["layout"] == "column"


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
        return (1.0 if rows < 8 else 6.0) if is_column_major(weights[0]) else 2.0
    first = lay_out_weights([model], "auto", rows=(1, 4), timer=timer)
    assert first["16x8 float32"]["layout"] == "column" and "kept" not in first["16x8 float32"]
    eager = lay_out_weights([model], "auto", rows=(64,), timer=timer)  # eager models: re-timed (a static policy)
    assert eager["16x8 float32"]["layout"] == "row" and model[0].weight.is_contiguous()
    lay_out_weights([model], "auto", rows=(1, 4), timer=timer)
    freeze_layouts([model])  # a forward was compiled on the column-major weights
    n = len(calls)
    later = lay_out_weights([model], "auto", rows=(64,), timer=timer)
    assert len(calls) == n  # not timed again
    assert is_column_major(model[0].weight) and is_column_major(model[1].weight)
    assert later["16x8 float32"] == {"layout": "column", "count": 1, "kept": True}
    lay_out_weights([model], "row", rows=(64,), timer=timer)  # forcing a layout still applies it
    assert model[0].weight.is_contiguous()
    lay_out_weights([model], "auto", rows=(64,), timer=timer)  # and auto goes back to what was compiled
    assert is_column_major(model[0].weight)
    fresh = nn.Sequential(nn.Linear(8, 16, bias=False))  # a newly loaded model is timed for its own rows
    report = lay_out_weights([fresh], "auto", rows=(64,), timer=timer)
    assert report["16x8 float32"]["layout"] == "row" and "kept" not in report["16x8 float32"]


# ---- packed (oneDNN's blocked weights) -------------------------------------------------------
needs_onednn = pytest.mark.skipif(not packable(torch.float32), reason="this torch build has no oneDNN packed linear")


def dense_linears(model):
    """The Linears a forward runs: fused projections, not the parts they replaced."""
    parts = {id(p) for m in linears(model) for p in getattr(m, "fused_parts", ())}
    return [m for m in linears(model) if id(m) not in parts]


@needs_onednn
def test_packed_linear_equals_f_linear_for_every_row_count_and_3d_inputs():
    """One packed weight (packed for no row count in particular) serves 1..16 rows, [B, Q, D] inputs, strided
    inputs and a bias; the kernels round differently in the last bits only."""
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 40, generator=gen), torch.randn(96, generator=gen)
    p = as_layout(w, "packed")
    assert p.is_mkldnn and p.shape == w.shape and torch.equal(as_layout(p, "row"), w)  # the reorder is exact
    for m in range(1, 17):
        x = torch.randn(m, 40, generator=gen)
        torch.testing.assert_close(linear(x, p), F.linear(x, w), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(linear(x, p, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    x = torch.randn(3, 5, 40, generator=gen)  # [B, Q, D]
    torch.testing.assert_close(linear(x, p), F.linear(x, w), rtol=1e-5, atol=1e-5)
    x = torch.randn(4, 7, 80, generator=gen)[..., ::2]  # not contiguous
    torch.testing.assert_close(linear(x, p, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    lin = nn.Linear(40, 96)
    want = lin(x).detach()
    report = lay_out_weights([lin], "packed", packs=True)
    assert isinstance(lin, PackedLinear) and lin.weight.is_mkldnn and report["96x40 float32"]["layout"] == "packed"
    with torch.no_grad():
        torch.testing.assert_close(lin(x), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="no backward"):  # the op has none: training must not run through it
        lin(x.requires_grad_())


@needs_onednn
def test_packed_layout_replaces_the_weights_keeps_state_dict_dense_and_goes_back(tmp_path):
    """No second copy (fused parts emptied; only a tied lm_head is copied, its Embedding keeps the rows), state_dict()
    gives the dense values (the HF save path), and `row` restores the same Parameter objects, ties and views."""
    from specpipe.models.hf.load import load_target
    from specpipe.models.hf.save import save_target
    from specpipe.models.llama import fuse_projections

    pair = build_random_tiny(tie_word_embeddings=True, seed=5)
    target, head = pair.target, pair.draft
    fuse_projections([target, head])
    ids = torch.randint(0, 258, (2, 9))
    with torch.no_grad():
        before = target.logits(target(ids))
    sd_before = {(i, k): v.clone() for i, m in enumerate((target, head)) for k, v in m.state_dict().items()}
    params = {id(p) for p in [*target.parameters(), *head.parameters()]}
    used = dense_linears(target) + dense_linears(head)
    report = lay_out_weights([target, head], "packed", packs=True)
    assert all(isinstance(m, PackedLinear) and m.weight.is_mkldnn for m in used)
    tied = target.lm_head
    assert tied.weight is not target.embed_tokens.weight and target.embed_tokens.weight.is_contiguous()
    assert report["258x64 float32 tied"]["copy_bytes"] == 258 * 64 * 4
    parts = [p for m in used for p in getattr(m, "fused_parts", ())]
    assert parts and all(isinstance(p, PackedPart) and p.weight.numel() == 0 for p in parts)  # no dense rows kept
    assert all(m._unpacked[0].numel() == 0 for m in used if m is not tied)  # the dense Parameters, emptied
    assert tied._unpacked[0] is target.embed_tokens.weight
    with torch.no_grad():
        torch.testing.assert_close(target.logits(target(ids)), before, rtol=1e-5, atol=1e-5)
    sd = {(i, k): v for i, m in enumerate((target, head)) for k, v in m.state_dict().items()}
    assert sd.keys() == sd_before.keys()
    assert all(not t.is_mkldnn and torch.equal(t, sd_before[k]) for k, t in sd.items())
    saved = load_target(save_target(target, None, tmp_path))  # the HF save path, on packed weights
    assert all(torch.equal(t, sd_before[0, k]) for k, t in saved.state_dict().items())
    assert not linear_weights([target, head])  # nothing dense left to lay out
    lay_out_weights([target, head], "row")
    assert {id(p) for p in [*target.parameters(), *head.parameters()]} == params  # the same objects again
    assert target.lm_head.weight is target.embed_tokens.weight
    assert all(type(m) is nn.Linear and m.weight.is_contiguous() for m in linears(target) + linears(head))
    for f in (m for m in used if hasattr(m, "fused_parts")):
        assert all(p.weight.untyped_storage().data_ptr() == f.weight.untyped_storage().data_ptr()
                   for p in f.fused_parts)
    assert all(torch.equal(t, sd_before[i, k]) for i, m in enumerate((target, head)) for k, t in m.state_dict().items())


def test_auto_times_packed_too_and_a_compiled_forward_unpacks_it():
    """auto picks packed where it is fastest; a compiled forward cannot run it, so freezing unpacks it to the faster
    dense layout (and auto keeps that afterwards)."""
    from specpipe.devices.weight_layout import freeze_layouts

    model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.Linear(16, 8, bias=False))
    speed = {(16, 8, "row"): 3.0, (16, 8, "column"): 2.0, (16, 8, "packed"): 1.0,
             (8, 16, "row"): 1.0, (8, 16, "column"): 1.0, (8, 16, "packed"): 2.0}

    def timer(weights, rows):
        w = weights[0]
        lay = "packed" if w.is_mkldnn else "column" if is_column_major(w) else "row"
        return speed[(w.shape[0], w.shape[1], lay)]
    if not packable(torch.float32):
        pytest.skip("this torch build has no oneDNN packed linear")
    report = lay_out_weights([model], "auto", rows=(1, 5), timer=timer, packs=True)
    assert report["16x8 float32"]["layout"] == "packed" and report["16x8 float32"]["us"]["packed"] == 2e6
    assert isinstance(model[0], PackedLinear) and model[1].weight.is_contiguous()
    assert freeze_layouts([model]) == {"16x8 float32": "column"}
    assert type(model[0]) is nn.Linear and is_column_major(model[0].weight)
    again = lay_out_weights([model], "auto", rows=(1, 5), timer=timer, packs=True)
    assert again["16x8 float32"] == {"layout": "column", "count": 1, "kept": True}


class NoOneDnnDevice(Device):
    """A device of another kind (CUDA, NPU) as far as weight layouts go: no oneDNN packed linear."""
    name = "stub"

    def make_torch_device(self, index):
        return torch.device("cpu")


def test_packed_on_a_device_without_onednn_resolves_to_row():
    from specpipe.devices.cuda import CudaDevice
    from specpipe.devices.npu import NpuDevice

    assert not CudaDevice.packs_weights and not NpuDevice.packs_weights and not Device.packs_weights
    model = nn.Sequential(nn.Linear(64, 256, bias=False))
    report = NoOneDnnDevice(weight_layout="packed").lay_out_weights([model], (1, 5))
    assert type(model[0]) is nn.Linear and model[0].weight.is_contiguous()
    assert report["256x64 float32"]["layout"] == "row" and "no oneDNN packed linear" in report["256x64 float32"]["note"]
    assert CpuDevice().packs_weights == packable(torch.float32)


def test_the_validate_message_lists_packed():
    from helpers import compose

    from specpipe.config.validate import validate
    from specpipe.errors import ConfigError

    with pytest.raises(ConfigError, match="use one of auto, row, column, packed"):
        validate(compose("device.weight_layout=diagonal"))
    validate(compose("device.weight_layout=packed"))


@needs_onednn
def test_a_packed_model_decodes_the_same_greedy_tokens_as_row(prompts_file):
    """random_tiny in float32 (fp32 is what oneDNN packs; the lossless tests run float64): plain and speculative
    greedy decoding with packed weights give row's tokens, and a compiled forward runs them unpacked."""
    from helpers import compose, random_prompts

    from specpipe.run import run

    pair = build_random_tiny(seed=2)
    path = prompts_file(random_prompts(2, [3, 8, 21, 40]))
    base = ["model=random_tiny", f"workload.prompts_file={path}", "workload.max_new_tokens=16", "workload.batch_size=4"]

    def decode(*overrides):
        res = run(compose(*base, *overrides), quiet=True, pair=pair)
        return [r.output_ids for r in res["requests"]], res["metrics"]["weight_layout"]
    want, _ = decode("draft=none", "device.weight_layout=row")
    got, layout = decode("draft=none", "device.weight_layout=packed")
    assert got == want and layout and all(e["layout"] == "packed" for e in layout.values())
    got, _ = decode("draft=eagle", "draft.topk=2", "draft.num_steps=3", "draft.num_draft_tokens=6",
                    "device.weight_layout=packed")
    assert got == want
    got, layout = decode("draft=none", "device.weight_layout=packed",
                         "compile.verify.target_forward='compile(dynamic=true, backend=aot_eager)'")
    assert got == want and all(e["layout"] == "row" and e["compiled"] for e in layout.values())
    assert not any(isinstance(m, PackedLinear) for m in linears(pair.target))


@needs_onednn
def test_shipped_tiny_pair_with_packed_weights_is_lossless(prompts_file):
    """tests/decode/test_lossless.py's shipped-pair check with device.weight_layout=packed (float32): EAGLE chains
    and trees verify with oneDNN's kernels at 2..13 rows and still equal plain greedy decoding."""
    from helpers import compose

    from specpipe.models.hf.load import load_tiny
    from specpipe.run import run

    pair = load_tiny(dtype="float32")
    path = prompts_file(["def fibonacci(n):\n    ", "class Stack:\n    def __init__(self):\n        ", "import os\n"])
    common = ["model=tiny", "device.dtype=float32", f"workload.prompts_file={path}", "workload.max_new_tokens=24",
              "workload.batch_size=3", "device.weight_layout=packed", "speculation=static"]
    want = [r.output_ids for r in run(compose(*common, "draft=none"), quiet=True, pair=pair)["requests"]]
    row = [r.output_ids for r in run(compose(*common, "draft=none", "device.weight_layout=row"), quiet=True,
                                     pair=pair)["requests"]]
    assert want == row
    for shape in (["draft.topk=1", "draft.num_steps=5"],
                  ["draft.topk=4", "draft.num_steps=4", "draft.num_draft_tokens=10"]):
        out = run(compose(*common, *shape), quiet=True, pair=pair)
        assert [r.output_ids for r in out["requests"]] == want, shape
        assert all(e["layout"] == "packed" for e in out["metrics"]["weight_layout"].values())
        assert out["metrics"]["accept_length_mean"] > 1.5
