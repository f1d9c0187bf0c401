"""Which memory layout each Linear weight keeps, chosen per weight shape by timing the GEMM that uses it.

A Linear weight [out, in] can be stored row-major (HF's layout) or column-major (the same values
and shape, strides (1, out): a transposed view of an [in, out] tensor). F.linear accepts both and
hands the BLAS a different transpose flag, and on CPUs the two run at very different speeds, in a
direction that depends on the shape, the row count and the machine: on the 2-core AMD EPYC this was
written on (MKL, fp32, rows = 1) a 704x256 gate/up projection ran 84 µs row-major and 50 µs
column-major, while the 256x704 down projection ran 54 µs row-major and 82 µs column-major. So
`auto` times both layouts per distinct (shape, dtype) on the row counts the decode loop will use
and keeps the faster one (`row` unless `column` wins by more than MARGIN); `row` and `column` force
one layout for every weight (reproducible numerics across runs; `auto` may pick differently on
a noisy machine, and the two layouts round differently in the last bits).

Once a model forward has been compiled on a weight, `auto` keeps that weight's layout in later runs
(sweeps, the Python API), though their row counts may favour the other: a flip would change the
strides the compiled forward was specialised for and recompile it in every job that flips. Eager
models are re-timed for each run's row counts (the timings themselves are cached per process).

Weights shared with an Embedding (tied lm_head) stay row-major: the embedding reads rows.
The change is made in place (`param.data`), so parameters shared between modules stay shared.
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

MARGIN = 0.05  # column-major must be this much faster to replace the default (row-major) layout
COLD_BYTES = 32 << 20  # time on rotating copies this large: a model bigger than the cache streams its weights


def is_column_major(w: torch.Tensor) -> bool:
    return w.dim() == 2 and w.stride(0) == 1 and w.stride(1) == w.shape[0] and w.shape[0] > 1


def as_layout(w: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values in `layout` ('row' or 'column'); `w` itself when already so."""
    if layout == "column":
        return w if is_column_major(w) else w.t().contiguous().t()
    return w if w.is_contiguous() else w.contiguous()


def linear_weights(models: Iterable[Optional[nn.Module]]) -> dict[tuple, list[nn.Parameter]]:
    """Linear weights by (out, in, dtype), each parameter once; those shared with an Embedding left out."""
    embedded, seen, groups = set(), set(), {}
    mods = [m for m in models if m is not None]
    for model in mods:
        for mod in model.modules():
            if isinstance(mod, nn.Embedding):
                embedded.add(id(mod.weight))
    owner = {}  # storage -> its largest Linear weight: a fused projection, not the parts viewing into it
    for model in mods:
        for mod in model.modules():
            w = getattr(mod, "weight", None)
            if isinstance(mod, nn.Linear) and w is not None:
                key = w.untyped_storage().data_ptr()
                if key not in owner or w.numel() > owner[key].numel():
                    owner[key] = w
    for model in mods:
        for mod in model.modules():
            w = getattr(mod, "weight", None)
            if not isinstance(mod, nn.Linear) or w is None or id(w) in embedded or id(w) in seen:
                continue
            if owner[w.untyped_storage().data_ptr()] is not w:
                continue
            seen.add(id(w))
            groups.setdefault((w.shape[0], w.shape[1], w.dtype), []).append(w)
    return groups


def time_linear(weights: Sequence[torch.Tensor], rows: int, repeats: int = 3, budget_s: float = 0.01) -> float:
    """Best-of-`repeats` seconds per F.linear over `rows` rows, cycling through `weights`."""
    x = torch.randn(rows, weights[0].shape[1], generator=torch.Generator().manual_seed(0)).to(
        dtype=weights[0].dtype, device=weights[0].device)  # its own generator: the caller's stream is theirs
    with torch.no_grad():
        t0 = time.perf_counter()
        for w in weights:  # warm-up, and a first estimate of one call
            F.linear(x, w)
        one = (time.perf_counter() - t0) / len(weights)
        calls = max(len(weights), min(20 * len(weights), int(budget_s / max(one, 1e-7))))
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            for i in range(calls):
                F.linear(x, weights[i % len(weights)])
            best = min(best, (time.perf_counter() - t0) / calls)
    return best


def measure(shape: tuple, rows: int, timer: Callable = time_linear) -> dict[str, float]:
    """Seconds per F.linear over `rows` rows, for each layout of a weight of `shape` (on the host)."""
    out, inp, dtype = shape
    nbytes = out * inp * torch.empty((), dtype=dtype).element_size()
    copies = max(1, min(32, -(-COLD_BYTES // nbytes)))
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(out, inp, generator=gen).to(dtype) for _ in range(copies)]
    return {lay: timer([as_layout(w, lay) for w in base], rows) for lay in ("row", "column")}


_MEASURED: dict = {}  # (shape, rows, timer) -> seconds per layout: timed once per process (sweeps, tests)
DECIDED = "_specpipe_auto_layout"  # on a Parameter: (layout, µs per layout) auto chose when it was frozen


def freeze_layouts(models: Iterable[Optional[nn.Module]]) -> None:
    """A forward of these models was compiled: later `auto` runs keep each weight's present layout (a forced
    `row` or `column` run leaves it, so the next `auto` run goes back to what the compiled graphs expect)."""
    for params in linear_weights(models).values():
        for p in params:
            setattr(p, DECIDED, ("column" if is_column_major(p.data) else "row",))


def lay_out_weights(models: Iterable[Optional[nn.Module]], mode: str, rows: Sequence[int] = (1,),
                    timer: Callable = time_linear) -> dict[str, dict]:
    """Apply `mode` ('auto' | 'row' | 'column') to every Linear weight of `models`; returns, per
    shape "OUTxIN dtype", the layout kept and (auto) the measured µs per call of each layout, or
    `kept: true` where a compiled forward froze it (`freeze_layouts`)."""
    if mode not in LAYOUTS:
        raise ValueError(f"weight layout {mode!r} is not one of {', '.join(LAYOUTS)}")
    report = {}
    rows = tuple(sorted(set(int(r) for r in rows)))
    for shape, params in linear_weights(models).items():
        key = f"{shape[0]}x{shape[1]} {str(shape[2]).replace('torch.', '')}"
        entry = {"layout": mode, "count": len(params)}
        decided = next((getattr(p, DECIDED) for p in params if hasattr(p, DECIDED)), None)
        if mode == "auto" and decided is not None:  # frozen by a compiled forward (this weight or its shape's)
            entry["layout"], entry["kept"] = decided[0], True
        elif mode == "auto":
            t = {"row": 0.0, "column": 0.0}
            for r in rows:  # summed over the decode loop's row counts
                memo = (shape, r, timer)
                if memo not in _MEASURED:
                    _MEASURED[memo] = measure(shape, r, timer)
                t = {k: v + _MEASURED[memo][k] for k, v in t.items()}
            entry["layout"] = "column" if t["column"] < (1 - MARGIN) * t["row"] else "row"
            entry["us"] = {k: round(v * 1e6, 1) for k, v in t.items()}
        with torch.no_grad():
            for p in params:
                p.data = as_layout(p.data, entry["layout"])
                if decided is not None and mode == "auto":
                    setattr(p, DECIDED, decided)  # a newly loaded weight of a frozen shape follows it
        report[key] = entry
    for model in (m for m in models if m is not None):  # fused projections: re-view their parts
        for mod in model.modules():
            if hasattr(mod, "fused_parts"):
                refresh_fused_views(mod)
    return report
