"""Graph capture for one branch: capture once per input signature, then copy inputs in and replay.

Works with any backend namespace that offers the CUDA-graph API (`torch.cuda`: CUDAGraph,
graph, Stream, stream, current_stream, graph_pool_handle; torch_npu's `torch.npu`: NPUGraph and
the same functions). A replay reruns the recorded kernels on fixed addresses, so:
- inputs are copied into static buffers captured with the graph (contiguous, one set per signature);
- the signature is the nesting of the arguments, every tensor's shape/dtype/device and every
  non-tensor value, so a new batch size or padded length gets its own capture;
- outputs are cloned on return, because the next replay overwrites the static outputs and callers
  keep results across calls (the draft loop keeps every step's tree blocks).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import torch

log = logging.getLogger(__name__)


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


@dataclasses.dataclass
class _Capture:
    graph: Any
    static_in: list  # contiguous input buffers, in split_tensors order
    template_out: Any
    static_out: list


class GraphBranch:
    """Replay a captured graph of `fn` per input signature (see the module docstring)."""

    def __init__(self, fn: Callable, api: Any, graph_cls: str, warmup: int = 2, max_graphs: int = 256):
        self.fn, self.api, self.graph_cls = fn, api, graph_cls
        self.warmup, self.max_graphs = warmup, max_graphs
        self.captures: dict = {}
        self.pool = None
        self.__name__ = getattr(fn, "__name__", "branch")
        self.__self__ = getattr(fn, "__self__", None)
        self._warned = False

    def __call__(self, *args, **kwargs):
        tensors: list = []
        template = split_tensors((args, kwargs), tensors)
        key = (template, tuple((t.shape, t.dtype, t.device) for t in tensors))
        cap = self.captures.get(key)
        if cap is None:
            if len(self.captures) >= self.max_graphs:
                if not self._warned:
                    log.warning("%s: %d graphs captured; new shapes now run eager", self.__name__, self.max_graphs)
                    self._warned = True
                return self.fn(*args, **kwargs)
            cap = self.captures[key] = self._capture(template, tensors)
        for s, t in zip(cap.static_in, tensors):
            s.copy_(t)
        cap.graph.replay()
        return fill(cap.template_out, [t.clone() for t in cap.static_out])

    def _capture(self, template: Any, tensors: list) -> _Capture:
        """Warm up on a side stream (lazy inits, allocator), then record one call into a graph."""
        api = self.api
        static_in = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
        for s, t in zip(static_in, tensors):
            s.copy_(t)
        args, kwargs = fill(template, static_in)
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
