"""Graph capture for one branch: capture per padded input signature, then copy inputs in and replay.

Works with any backend namespace that offers the CUDA-graph API (`torch.cuda`: CUDAGraph,
graph, Stream, stream, current_stream, graph_pool_handle; torch_npu's `torch.npu`: NPUGraph and
the same functions). A replay reruns the recorded kernels on fixed addresses, so:
- inputs are copied into static buffers captured with the graph (contiguous, one set per signature);
- the signature is the nesting of the arguments, every tensor's shape/dtype/device and every
  non-tensor value;
- outputs are cloned on return, because the next replay overwrites the static outputs and callers
  keep results across calls (the draft loop keeps every step's tree blocks).

Like sglang's cuda_graph_bs, a branch captures a fixed list of batch sizes (`device.graph_batch_sizes`) and pads
a request up to the next one, so a changing batch replays instead of capturing mid-run. Branch arguments are
request-major (dim 0 is m x the batch for every tensor, the stages' convention), so padding appends whole dummy
requests of zeros: their tokens sit at position 0, write the null KV slot 0 (zeroed after every write) and read
only it, and their output rows are cut off before return, so real rows compute what they compute unpadded. An
AttentionBatch's key columns are padded the same way to the next `device.graph_context_buckets` width (masked
columns read slot 0 with zero weight). Every listed size up to the first call's is captured on that first call
(the run's warm-up); a shape beyond the lists is captured at its own size, with a note, and never runs eager.
"""
from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from typing import Any, Callable, Optional, Sequence

import torch

from specpipe.notes import logger

log = logger(__name__)

# an AttentionBatch's fields whose last dim is the key columns (Lkv); `causal` holds (q_valid, k_valid [B, Lkv])
CONTEXT_FIELDS = ("kv_slots", "mask", "kv_positions", "swa_kv_slots")


class _Slot(int):
    """Marks where the i-th tensor sat in the argument nesting."""


def split_tensors(x: Any, out: list) -> Any:
    """A hashable template of `x` with its tensors replaced by _Slot indices (tensors appended to out)."""
    if isinstance(x, torch.Tensor):
        out.append(x)
        return _Slot(len(out) - 1)
    if isinstance(x, (tuple, list)):
        return (type(x), tuple(split_tensors(y, out) for y in x))
    if isinstance(x, dict):
        return (dict, tuple((k, split_tensors(v, out)) for k, v in x.items()))
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return (type(x), tuple((f.name, split_tensors(getattr(x, f.name), out)) for f in dataclasses.fields(x)))
    return x


def fill(template: Any, tensors: list) -> Any:
    """Inverse of split_tensors: rebuild the nesting around the given tensors."""
    if isinstance(template, _Slot):
        return tensors[template]
    if isinstance(template, tuple) and len(template) == 2 and isinstance(template[0], type):
        kind, items = template
        if kind is dict:
            return {k: fill(v, tensors) for k, v in items}
        if kind in (tuple, list):
            return kind(fill(v, tensors) for v in items)
        return kind(**{k: fill(v, tensors) for k, v in items})
    return template


def context_slots(template: Any, out: Optional[set] = None) -> set:
    """Indices of the tensors whose last dim is an AttentionBatch's key columns (see CONTEXT_FIELDS)."""
    out = set() if out is None else out
    if isinstance(template, tuple) and len(template) == 2 and isinstance(template[0], type):
        kind, items = template
        if dataclasses.is_dataclass(kind) and any(name == "kv_slots" for name, _ in items):
            for name, v in items:
                if name in CONTEXT_FIELDS and isinstance(v, _Slot):
                    out.add(int(v))
                elif name == "causal" and isinstance(v, tuple) and len(v[1]) == 2 and isinstance(v[1][1], _Slot):
                    out.add(int(v[1][1]))  # k_valid
        for item in items:
            context_slots(item[1] if kind is dict or dataclasses.is_dataclass(kind) else item, out)
    return out


def next_size(n: int, sizes: Sequence[int]) -> Optional[int]:
    """The smallest listed size >= n (None: n is beyond the list)."""
    return next((s for s in sizes if s >= n), None)


@dataclasses.dataclass(frozen=True)
class Shape:
    """A call's batch rows and key columns, and the padded sizes its capture runs at (None: not padded)."""
    rows: Optional[int]
    width: Optional[int]
    rows_to: Optional[int]
    width_to: Optional[int]


@dataclasses.dataclass
class _Capture:
    graph: Any
    static_in: list  # contiguous input buffers, in split_tensors order
    template_out: Any
    static_out: list


class GraphBranch:
    """Replay a captured graph of `fn` per padded input signature (see the module docstring).

    `batch_sizes`, `context_buckets`: ascending sizes to pad up to (empty: capture every exact shape)."""

    def __init__(self, fn: Callable, api: Any, graph_cls: str, warmup: int = 2, batch_sizes: Sequence[int] = (),
                 context_buckets: Sequence[int] = ()):
        self.fn, self.api, self.graph_cls = fn, api, graph_cls
        self.warmup = warmup
        self.batch_sizes, self.context_buckets = sorted(set(batch_sizes)), sorted(set(context_buckets))
        self.captures: dict = {}
        self.pool = None
        self.__name__ = getattr(fn, "__name__", "branch")
        self.__self__ = getattr(fn, "__self__", None)
        self.notes: list[str] = []  # shapes captured outside the lists, said once each
        self.warmed = False

    def shape(self, template: Any, tensors: list) -> Shape:
        """Batch rows (dim 0 shared by every tensor as m x rows) and key columns, and what they pad up to."""
        dims = [t.shape[0] for t in tensors if t.dim() > 0]
        rows = min(dims) if dims else 0
        if not rows or any(d % rows for d in dims):
            rows = None  # not request-major: nothing to pad
        ctx = context_slots(template)
        width = tensors[min(ctx)].shape[-1] if ctx else None
        rows_to = next_size(rows, self.batch_sizes) if rows and self.batch_sizes else None
        width_to = next_size(width, self.context_buckets) if width and self.context_buckets else None
        return Shape(rows, width, rows_to, width_to)

    def __call__(self, *args, **kwargs):
        tensors: list = []
        template = split_tensors((args, kwargs), tensors)
        shape = self.shape(template, tensors)
        ctx = context_slots(template)
        if not self.warmed:
            self.warmed = True
            self._capture_listed(template, tensors, shape, ctx)
        padded = self._padded_shapes(tensors, shape, ctx)
        key = (template, tuple((s, t.dtype, t.device) for s, t in zip(padded, tensors)))
        cap = self.captures.get(key)
        if cap is None:
            self._note(shape)
            cap = self.captures[key] = self._capture(template, tensors, padded)
        for s, t, p in zip(cap.static_in, tensors, padded):
            if p == t.shape:
                s.copy_(t)
            else:  # dummy rows and columns are zeros, never a previous call's real data
                s.zero_()
                s[tuple(slice(0, n) for n in t.shape)].copy_(t)
        cap.graph.replay()
        return fill(cap.template_out, self._cut(cap.static_out, shape))

    def _padded_shapes(self, tensors: list, shape: Shape, ctx: set, rows_to: Optional[int] = None) -> list:
        """Each tensor's shape padded to `rows_to` (default shape.rows_to) rows and to shape.width_to columns."""
        rows_to = rows_to or shape.rows_to
        out = []
        for i, t in enumerate(tensors):
            s = list(t.shape)
            if rows_to and t.dim() > 0:
                s[0] = s[0] // shape.rows * rows_to
            if shape.width_to and i in ctx:
                s[-1] = shape.width_to
            out.append(torch.Size(s))
        return out

    def _cut(self, static_out: list, shape: Shape) -> list:
        """Fresh copies of the outputs, without the dummy rows (an output with m x rows_to rows keeps m x rows)."""
        if not shape.rows_to or shape.rows_to == shape.rows:
            return [t.clone() for t in static_out]
        return [t[:t.shape[0] // shape.rows_to * shape.rows].clone() if t.dim() > 0 and t.shape[0] % shape.rows_to
                == 0 else t.clone() for t in static_out]

    def _capture_listed(self, template: Any, tensors: list, shape: Shape, ctx: set) -> None:
        """The first call (the run's warm-up): capture every listed batch size up to this call's, at its width,
        on its own inputs cut to fewer rows (a smaller batch later replays instead of capturing mid-run)."""
        for size in self.batch_sizes if shape.rows_to else ():
            if size >= shape.rows_to:
                break
            padded = self._padded_shapes(tensors, shape, ctx, size)
            key = (template, tuple((s, t.dtype, t.device) for s, t in zip(padded, tensors)))
            if key not in self.captures:
                self.captures[key] = self._capture(template, tensors, padded)

    def _note(self, shape: Shape) -> None:
        """Say (once per shape) that a shape lies beyond the configured lists and is captured mid-run."""
        why = []
        if self.batch_sizes and shape.rows and shape.rows_to is None:
            why.append(f"batch {shape.rows} is above device.graph_batch_sizes (largest {self.batch_sizes[-1]})")
        if self.context_buckets and shape.width and shape.width_to is None:
            why.append(f"{shape.width} key columns are above device.graph_context_buckets (largest "
                       f"{self.context_buckets[-1]})")
        if why:
            note = f"specpipe: note: graph {self.__name__}: {' and '.join(why)}: captured at its own size mid-run"
            if note not in self.notes:
                self.notes.append(note)
                log.info(note)

    def _capture(self, template: Any, tensors: list, padded: list) -> _Capture:
        """Warm up on a side stream (lazy inits, allocator), then record one call into a graph. Inputs are
        `tensors` zero-padded (or cut) to the `padded` shapes."""
        api = self.api
        static_in = [torch.zeros(p, dtype=t.dtype, device=t.device) for p, t in zip(padded, tensors)]
        for s, t in zip(static_in, tensors):
            n = tuple(slice(0, min(a, b)) for a, b in zip(s.shape, t.shape))
            s[n].copy_(t[n])
        args, kwargs = fill(template, static_in)
        dev = next((t.device for t in tensors if t.device.type != "cpu"), None)
        with api.device(dev) if dev is not None and hasattr(api, "device") else nullcontext():  # device.index's GPU
            side = api.Stream()
            side.wait_stream(api.current_stream())
            with torch.no_grad():
                with api.stream(side):
                    for _ in range(self.warmup):
                        self.fn(*args, **kwargs)
                api.current_stream().wait_stream(side)
                if self.pool is None:
                    self.pool = api.graph_pool_handle()
                graph = getattr(api, self.graph_cls)()
                with api.graph(graph, pool=self.pool):
                    out = self.fn(*args, **kwargs)
        static_out: list = []
        template_out = split_tensors(out, static_out)
        return _Capture(graph, static_in, template_out, static_out)
