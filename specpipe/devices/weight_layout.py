"""Which memory layout each Linear weight keeps, chosen per weight shape by timing the GEMM that uses it.

A Linear weight [out, in] can be stored row-major (HF's layout) or column-major (the same values
and shape, strides (1, out): a transposed view of an [in, out] tensor). F.linear accepts both and
hands the BLAS a different transpose flag, and on CPUs the two run at very different speeds, in a
direction that depends on the shape, the row count and the machine: on the 2-core AMD EPYC this was
written on (MKL, fp32, rows = 1) a 704x256 gate/up projection ran 84 µs row-major and 50 µs
column-major, while the 256x704 down projection ran 54 µs row-major and 82 µs column-major. So
`auto` times both layouts per distinct (shape, dtype) on the row counts the decode loop will use
(`run.decode_rows`) and keeps the one with the least slowdown summed over them (`choose`; `row` unless
another's is MARGIN less); `row` and `column` force
one layout for every weight (reproducible numerics across runs; `auto` may pick differently on
a noisy machine, and the two layouts round differently in the last bits).

`packed` (CPU builds with oneDNN) stores each weight as oneDNN's blocked copy and runs the module through
oneDNN's linear (`PackedLinear`). MKL's sgemm at 2-12 rows costs ~2x its one-row time although it reads the
same weight once, which made a verify forward of 5 tokens cost ~1.6x a one-token decode; the packed kernel
does not (SmolLM2-135M's 3072x576 gate|up, 1 thread: 483 µs row-major vs 183 µs packed at 5 rows, 138 vs
111 at one row). One packed weight serves every row count and [B, Q, D] inputs. Where oneDNN can pack
(float32, bfloat16), `auto` times it as a third layout. The packed tensor is opaque (MkldnnCPU: its dtype,
shape and device read as before, its values cannot), so state_dict() gives the row-major values (the
HF save path sees dense weights), a forward that would need gradients is refused (the op has no
backward), and any other layout unpacks it first. Inductor lowers oneDNN's packed linear only in graphs it
froze itself, so a run that compiles a model forward unpacks its weights before the first trace
(`freeze_layouts`: the report says `"compiled": true` and gives the layout kept).

Once a model forward has been compiled on a weight, `auto` keeps that weight's layout in later runs
(sweeps, the Python API), though their row counts may favour the other: a flip would change the
strides the compiled forward was specialised for and recompile it in every job that flips. Eager
models are re-timed for each run's row counts (the timings themselves are cached per process).

Weights shared with an Embedding (tied lm_head) stay row-major under `row` and `column`: the embedding reads
rows. Packing one costs a second copy (the embedding keeps the rows), which `packed` and `auto` pay (PACK_TIED).
The change is made in place (`param.data`; a packed weight is a new Parameter in every module that held the
old one, which keeps the old object, emptied, to go back to), so parameters shared between modules stay shared.
"""
from __future__ import annotations

import math
import time
from typing import Callable, Iterable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specpipe.models.attention import refresh_fused_views
from specpipe.config.schema import WEIGHT_LAYOUTS as LAYOUTS

MARGIN = 0.05  # another layout must be this much faster to replace the default (row-major) layout
PLAIN_SLACK = MARGIN  # the fewest rows timed (a trimming policy's plain step) run at most this much over their fastest
COLD_BYTES = 32 << 20  # time on rotating copies this large: a model bigger than the cache streams its weights
# pack an lm_head tied to the embedding, at the cost of a copy: on SmolLM2-135M (49152x576, fp32, 113 MB next to a
# 540 MB model, 1 thread) it saved 4 ms of a 57 ms decode and 16 ms of a 5-token verify at batch 1
# (scripts/bench_verify_cost.py --layouts packed packed-untied)
PACK_TIED = True
COMPILED_NOTE = ("a compiled model forward cannot run oneDNN-packed weights (inductor lowers that op only in graphs "
                 "it froze itself): they were unpacked for this run's compiled forwards")


def is_column_major(w: torch.Tensor) -> bool:
    return (w.dim() == 2 and w.layout == torch.strided and w.stride(0) == 1 and w.stride(1) == w.shape[0]
            and w.shape[0] > 1)


def as_layout(w: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values in `layout` ('row', 'column' or 'packed'); `w` itself when already so."""
    if layout == "packed":
        return w if w.is_mkldnn else torch.ops.mkldnn._reorder_linear_weight(w, None)  # every row count alike
    if w.is_mkldnn:
        w = w.to_dense()  # row-major, the same values (the reorder is exact)
    if layout == "column":
        return w if is_column_major(w) else w.t().contiguous().t()
    return w if w.is_contiguous() else w.contiguous()


def linear(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear for a dense weight of either stride, oneDNN's linear for a packed one; x [..., in] -> [..., out]."""
    if w.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    return F.linear(x, w, b)


def packing_available() -> bool:
    """This torch build has oneDNN's packed linear (CPU only: on CUDA and NPU, `packed` runs as `row`)."""
    try:
        return torch.backends.mkldnn.is_available() and all(
            hasattr(torch.ops.mkldnn, op) for op in ("_reorder_linear_weight", "_linear_pointwise"))
    except (AttributeError, RuntimeError):
        return False


_PACKABLE: dict = {}


def packable(dtype: torch.dtype) -> bool:
    """oneDNN packs `dtype` on this CPU (float32 and bfloat16; float16 needs AVX512-FP16 or AVX-NE-CONVERT,
    float64 never): tried once per process on an 8x8 weight."""
    if dtype not in _PACKABLE:
        ok = False
        if packing_available():
            try:
                w = torch.ones(8, 8, dtype=dtype)
                ok = torch.equal(linear(torch.ones(2, 8, dtype=dtype), as_layout(w, "packed")), F.linear(w[:2], w))
            except RuntimeError:
                pass
        _PACKABLE[dtype] = ok
    return _PACKABLE[dtype]


class PackedLinear(nn.Linear):
    """An nn.Linear whose weight is oneDNN's blocked copy (`as_layout(w, 'packed')`), for inference.

    `_unpacked` is (the dense Parameter it replaced, that module's class, whether the Parameter is an
    Embedding's (kept intact) or was emptied, the layout to go back to): `unpack_weights` restores them."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if torch.is_grad_enabled() and (x.requires_grad or (self.bias is not None and self.bias.requires_grad)):
            raise RuntimeError("a oneDNN-packed Linear (device.weight_layout=packed) has no backward: lay the weights "
                               "out as row (weight_layout.lay_out_weights(models, 'row')) before training")
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = self.weight.detach().to_dense()  # the row-major values, never the blocks

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        raise RuntimeError(f"{prefix}weight is oneDNN-packed: lay the weights out as row before loading into them")

    def extra_repr(self) -> str:
        return super().extra_repr() + ", packed"


class PackedPart(nn.Linear):
    """A part of a packed fused projection (q_proj of qkv_proj): its rows live only in the fused module's packed
    weight, so its own weight is emptied; state_dict() still gives its values. `_rows`: (fused, first row, class)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this projection is fused and its fused weight packed: it runs through the fused module")

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        fused, a, _ = self._rows
        destination[prefix + "weight"] = fused.weight.detach().to_dense()[a:a + self.out_features].clone()


def _holders(models: list) -> dict[int, list[nn.Linear]]:
    """id(weight Parameter) -> the Linear modules whose weight it is."""
    out: dict[int, list] = {}
    for model in models:
        for mod in model.modules():
            if isinstance(mod, nn.Linear) and mod.weight is not None and mod not in out.get(id(mod.weight), ()):
                out.setdefault(id(mod.weight), []).append(mod)
    return out


def pack(param: nn.Parameter, mods: list, tied: bool, fallback: str) -> None:
    """Make `mods` (every Linear holding `param`) PackedLinears sharing one packed copy of it; `param` is emptied
    unless an Embedding reads it (`tied`), so the values live once (twice for a tied head)."""
    packed = nn.Parameter(as_layout(param.detach(), "packed"), requires_grad=False)
    for mod in mods:
        mod.weight = packed
        mod._unpacked = (param, type(mod), tied, fallback)
        mod.__class__ = PackedLinear
    if not tied:
        param.data = torch.empty(0, dtype=param.dtype, device=param.device)
    for fused in (m for m in mods if hasattr(m, "fused_parts")):  # its parts viewed the dense rows: empty them
        a = 0
        for part in fused.fused_parts:
            part.weight.data = torch.empty(0, dtype=part.weight.dtype, device=part.weight.device)
            part._rows = (fused, a, type(part))
            part.__class__ = PackedPart
            a += part.out_features


def unpack_weights(models: Iterable[Optional[nn.Module]]) -> dict[str, str]:
    """Every packed Linear of `models` back to its dense Parameter, in the layout it is to go back to; returns
    {shape key: that layout} for the weights unpacked."""
    mods = [m for m in models if m is not None]
    done: dict[int, nn.Parameter] = {}
    out = {}
    for model in mods:
        for mod in [m for m in model.modules() if isinstance(m, PackedLinear)]:
            packed = mod.weight
            param, cls, tied, fallback = mod._unpacked
            if id(packed) not in done:
                if not tied:
                    param.data = as_layout(packed.detach(), fallback)
                done[id(packed)] = param
                out[shape_key(param.shape, param.dtype, tied)] = fallback
            mod.weight = param
            del mod._unpacked
            mod.__class__ = cls
            for part in getattr(mod, "fused_parts", ()):
                if isinstance(part, PackedPart):
                    _, a, part_cls = part._rows
                    del part._rows
                    part.__class__ = part_cls
                    part.weight.data = param.data[a:a + part.out_features]  # a view again, as refresh_fused_views
    return out


def shape_key(shape: Sequence[int], dtype: torch.dtype, tied: bool = False) -> str:
    """A report key: "OUTxIN dtype", " tied" for an lm_head an Embedding shares."""
    return f"{shape[0]}x{shape[1]} {str(dtype).replace('torch.', '')}" + (" tied" if tied else "")


def linear_weights(models: Iterable[Optional[nn.Module]], tied: bool = False) -> dict[tuple, list[nn.Parameter]]:
    """Dense Linear weights by (out, in, dtype), each parameter once; those shared with an Embedding left out,
    or (`tied`) grouped apart under (out, in, dtype, True)."""
    embedded, seen, groups = set(), set(), {}
    mods = [m for m in models if m is not None]
    for model in mods:
        for mod in model.modules():
            if isinstance(mod, nn.Embedding):
                embedded.add(id(mod.weight))
    dense = [mod for model in mods for mod in model.modules()
             if isinstance(mod, nn.Linear) and not isinstance(mod, (PackedLinear, PackedPart))
             and mod.weight is not None]
    owner = {}  # storage -> its largest Linear weight: a fused projection, not the parts viewing into it
    for mod in dense:
        key = mod.weight.untyped_storage().data_ptr()
        if key not in owner or mod.weight.numel() > owner[key].numel():
            owner[key] = mod.weight
    for mod in dense:
        w = mod.weight
        if id(w) in seen or (id(w) in embedded and not tied) or owner[w.untyped_storage().data_ptr()] is not w:
            continue
        seen.add(id(w))
        groups.setdefault((w.shape[0], w.shape[1], w.dtype) + ((True,) if id(w) in embedded else ()), []).append(w)
    return groups


def time_linear(weights: Sequence[torch.Tensor], rows: int, repeats: int = 3, budget_s: float = 0.01) -> float:
    """Best-of-`repeats` seconds per linear over `rows` rows, cycling through `weights`."""
    x = torch.randn(rows, weights[0].shape[1], generator=torch.Generator().manual_seed(0)).to(
        dtype=weights[0].dtype, device=weights[0].device)  # its own generator: the caller's stream is theirs
    with torch.no_grad():
        t0 = time.perf_counter()
        for w in weights:  # warm-up, and a first estimate of one call
            linear(x, w)
        one = (time.perf_counter() - t0) / len(weights)
        calls = max(len(weights), min(20 * len(weights), int(budget_s / max(one, 1e-7))))
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            for i in range(calls):
                linear(x, weights[i % len(weights)])
            best = min(best, (time.perf_counter() - t0) / calls)
    return best


def measure(shape: tuple, rows: int, timer: Callable = time_linear,
            layouts: Sequence[str] = ("row", "column")) -> dict[str, float]:
    """Seconds per linear over `rows` rows, for each of `layouts` of a weight of `shape` (on the host)."""
    out, inp, dtype = shape[:3]
    nbytes = out * inp * torch.empty((), dtype=dtype).element_size()
    copies = max(1, min(32, -(-COLD_BYTES // nbytes)))
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(out, inp, generator=gen).to(dtype) for _ in range(copies)]
    return {lay: timer([as_layout(w, lay) for w in base], rows) for lay in layouts}


_MEASURED: dict = {}  # (shape, rows, timer, layouts) -> seconds per layout: timed once per process (sweeps, tests)
DECIDED = "_specpipe_auto_layout"  # on a Parameter: (layout, µs per layout) auto chose when it was frozen


def freeze_layouts(models: Iterable[Optional[nn.Module]]) -> dict[str, str]:
    """A forward of these models is to be compiled: packed weights go back to row/column first (COMPILED_NOTE), and
    later `auto` runs keep each weight's present layout (a forced `row` or `column` run leaves it, so the next `auto`
    run goes back to what the compiled graphs expect). Returns {shape key: layout} for the weights unpacked."""
    models = list(models)
    unpacked = unpack_weights(models)
    for params in linear_weights(models).values():
        for p in params:
            setattr(p, DECIDED, ("column" if is_column_major(p.data) else "row",))
    return unpacked


def choose(shape: tuple, rows: Sequence[int], timer: Callable, layouts: tuple) -> tuple[str, str, dict]:
    """(the layout with the least slowdown summed over `rows`, row unless another's is MARGIN less; the best dense
    one, for a packed weight's compiled runs; seconds per layout summed over `rows`).

    Each row count weighs alike: a layout's slowdown at r rows is its time over r's fastest layout's. Summed in
    seconds instead, the widest verify decided alone, and the layout it chose ran the plain steps a trimming policy
    mostly takes on ordinary prompts 20-25 % slower (SmolLM2, 4 rows: 87 ms against 71 with the 4-row choice).

    And the fewest rows (`run.decode_rows`' plain step) keep a layout within PLAIN_SLACK of their fastest: a trimming
    policy's floor is draft=none's step, whose layout is chosen on those rows alone, and on prompts where no draft
    pays every step is plain. A wider verify gives up some speed only where drafts are being accepted."""
    t = dict.fromkeys(layouts, 0.0)
    slow = dict.fromkeys(layouts, 0.0)
    plain = None
    for r in sorted(rows):
        memo = (shape[:3], r, timer, layouts)
        if memo not in _MEASURED:
            _MEASURED[memo] = measure(shape, r, timer, layouts)
        at_r = _MEASURED[memo]
        fastest = min(at_r.values())
        plain = plain or {k: at_r[k] / fastest for k in layouts}
        t = {k: v + at_r[k] for k, v in t.items()}
        slow = {k: v + at_r[k] / fastest for k, v in slow.items()}

    def best(cands):
        fair = [k for k in cands if plain[k] <= 1 + PLAIN_SLACK] or [min(cands, key=plain.get)]
        top = min(fair, key=slow.get)
        return top if "row" not in fair or slow[top] < (1 - MARGIN) * slow["row"] else "row"
    return best(layouts), best([k for k in layouts if k != "packed"]), t


def lay_out_weights(models: Iterable[Optional[nn.Module]], mode: str, rows: Sequence[int] = (1,),
                    timer: Callable = time_linear, packs: bool = False) -> dict[str, dict]:
    """Apply `mode` ('auto' | 'row' | 'column' | 'packed') to every Linear weight of `models`; returns, per
    shape "OUTxIN dtype", the layout kept and (auto) the measured µs per call of each layout, or
    `kept: true` where a compiled forward froze it (`freeze_layouts`). `packs`: the device runs packed weights
    (else `packed` keeps `row` and `auto` times row and column only)."""
    if mode not in LAYOUTS:
        raise ValueError(f"weight layout {mode!r} is not one of {', '.join(LAYOUTS)}")
    models = [m for m in models if m is not None]
    unpack_weights(models)  # every layout starts from the dense weights
    packing = packs and (mode == "packed" or mode == "auto")
    holders = _holders(models) if packing else {}
    report = {}
    rows = tuple(sorted(set(int(r) for r in rows)))
    for shape, params in linear_weights(models, tied=packing and PACK_TIED).items():
        tied = len(shape) > 3
        can_pack = packing and packable(shape[2]) and all(type(m) is nn.Linear for p in params for m in holders[id(p)])
        if tied and not can_pack:
            continue  # a tied head stays row-major, unreported, as with row and column
        entry = {"layout": mode, "count": len(params)}
        fallback = "row"
        decided = next((getattr(p, DECIDED) for p in params if hasattr(p, DECIDED)), None)
        if mode == "auto" and decided is not None:  # frozen by a compiled forward (this weight or its shape's)
            entry["layout"], entry["kept"] = decided[0], True
        elif mode == "auto":
            layouts = ("row",) + ("column",) * (not tied) + ("packed",) * can_pack  # an Embedding reads rows
            entry["layout"], fallback, t = choose(shape, rows, timer, layouts)
            entry["us"] = {k: round(v * 1e6, 1) for k, v in t.items()}
        elif mode == "packed" and not can_pack:
            entry["layout"] = "row"
            entry["note"] = f"oneDNN cannot pack {str(shape[2]).replace('torch.', '')} weights here: kept row"
        if tied:
            if entry["layout"] != "packed":
                continue
            entry["copy_bytes"] = sum(p.numel() * p.element_size() for p in params)
        with torch.no_grad():
            for p in params:
                if entry["layout"] == "packed":
                    pack(p, holders[id(p)], tied, fallback)
                    continue
                p.data = as_layout(p.data, entry["layout"])
                if decided is not None and mode == "auto":
                    setattr(p, DECIDED, decided)  # a newly loaded weight of a frozen shape follows it
        report[shape_key(shape, shape[2], tied)] = entry
    for model in models:  # fused projections kept dense: re-view their parts
        for mod in model.modules():
            if hasattr(mod, "fused_parts") and not isinstance(mod, PackedLinear):
                refresh_fused_views(mod)
    return report
