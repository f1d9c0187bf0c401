"""A Device describes one accelerator kind as data plus a few methods; nothing else asks which device runs.

`Device.compile(fn, policy)` is the only place a branch gets compiled or graph-captured: it checks
the policy against `compile_policy.DEVICE_SUPPORT[name]` (the table validation reads) and
translates the device-independent words. Subclasses override `compile_fn` and `graph_fn`.
"""
from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from specpipe.config.compile_policy import DEVICE_SUPPORT, BranchPolicy, device_problem
from specpipe.errors import ConfigError
from specpipe.notes import logger

log = logger(__name__)

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}
# device types whose float64 arithmetic is missing or emulated (Ascend's AI cores have none): sampling keeps its
# cumulative sums and coins in float32 there
NO_FLOAT64 = frozenset({"npu", "mps"})


def wide_float(device: torch.device) -> torch.dtype:
    """The widest float a device computes natively, for sums over a whole vocabulary and for sampling coins."""
    return torch.float32 if torch.device(device).type in NO_FLOAT64 else torch.float64
REPO_ROOT = Path(__file__).resolve().parents[2]


def use_build_inductor_cache() -> str:
    """Keep Inductor's on-disk cache in <repo>/build/inductor-cache unless the user chose a folder.

    A warm cache turns a 7-9 s compile into ~2 s; the default (/tmp) is lost on reboot and shared.
    """
    return os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(REPO_ROOT / "build" / "inductor-cache"))


def tensor_leaves(x: Any) -> Iterator[torch.Tensor]:
    """Tensors inside nested tuples, lists, dicts and dataclasses (e.g. an AttentionBatch)."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for y in x:
            yield from tensor_leaves(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from tensor_leaves(y)
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):
        for f in dataclasses.fields(x):
            yield from tensor_leaves(getattr(x, f.name))


def deview(x: Any) -> Any:
    """`x` with every view tensor replaced by a detached alias (same storage and strides, no `_base`).

    Dynamo guards a view input's base too, so a branch compiled on a view recompiles when it later
    gets a plain tensor (the eager draft's reshaped outputs vs. a tensor gathered after a join).
    A graph compiled on plain tensors also accepts views of the same strides.
    """
    if isinstance(x, torch.Tensor):
        return x.detach() if x._base is not None else x
    if isinstance(x, (tuple, list)):
        return type(x)(deview(y) for y in x)
    if isinstance(x, dict):
        return {k: deview(v) for k, v in x.items()}
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.replace(x, **{f.name: deview(getattr(x, f.name)) for f in dataclasses.fields(x) if f.init})
    return x


def mark_batch_dims(args: Any, shape_id: Optional[str] = None) -> None:
    """Compile dim 0 of every input tensor as a size that is never specialized (an unbacked size).

    The running batch shrinks and grows every few steps. Left to Dynamo, a batch of 1 gets its own
    graph (0/1 specialization) and B == topk at the first call ties the two sizes (duck sizing);
    an unbacked size avoids both, so one graph serves every batch size. Other dims follow the
    policy's `dynamic` option. Dim 0 is the batch by the stages' convention: every branch argument
    is request-major ([B, ...] or [B*K, ...]); weights are reached through `self`, not passed.

    With `shape_id`, every dim 0 is one symbol (a model forward's tokens, hidden states and attention
    batch all have B rows): independent unbacked sizes could not be broadcast together (attention's
    mask against its queries), and each such guard would break the graph.
    """
    from torch._dynamo.decorators import mark_unbacked

    for t in tensor_leaves(args):
        if t.dim() > 0:
            mark_unbacked(t, 0, shape_id=shape_id)


class BatchGeneric:
    """A torch.compile'd branch whose first calls get plain, batch-generic inputs (see deview, mark_batch_dims).

    Both matter only while Dynamo traces, and cost ~1 µs per tensor, so they stop after
    `mark_calls` calls: by then every graph a branch needs (e.g. the fused draft top-k's step
    kinds 0, 1 and >= 2) has been traced.
    """

    def __init__(self, fn: Callable, compiled: Callable, mark_calls: int = 8):
        self.fn, self.compiled, self.marks_left = fn, compiled, mark_calls
        self.__name__ = getattr(fn, "__name__", "branch")
        self.__self__ = getattr(fn, "__self__", None)
        # a model forward's inputs share one batch size (Stage.model_branches); other branches mix B and B*K
        model = self.__name__ in getattr(self.__self__, "model_branches", ())
        self.shape_id = "batch" if model else None

    def __call__(self, *args, **kwargs):
        if self.marks_left:
            self.marks_left -= 1
            args, kwargs = deview(args), deview(kwargs)
            mark_batch_dims((args, kwargs), self.shape_id)
        return self.compiled(*args, **kwargs)


SPECIALIZE_FLOATS = True  # compile_fn: a model's floats as graph constants (False: Dynamo's default, for benchmarks)

_THREADS_BEFORE: list[int] = []  # [torch's thread count before specpipe first changed it, the count it set last]


def set_threads(num_threads: Optional[int]) -> None:
    """Host threads for torch's CPU ops (1 is fastest on a shared machine). None gives back the count that was
    there before a device set one, so an earlier job of an in-process sweep (or SpecPipe) does not leak into it;
    a count the user set since then is theirs and stays."""
    if num_threads is not None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        if num_threads > cores and _THREADS_BEFORE[1:] != [num_threads]:  # (said once, not per sweep job)

            log.info(f"specpipe: note: device.num_threads={num_threads} is more than the {cores} CPU core(s) this "
                     f"process may use; torch's threads then wait on one another (a run can be many times slower): "
                     f"use at most {cores}")
        if not _THREADS_BEFORE:
            _THREADS_BEFORE[:] = [torch.get_num_threads(), num_threads]
        _THREADS_BEFORE[1] = num_threads
        torch.set_num_threads(num_threads)
    elif _THREADS_BEFORE and torch.get_num_threads() == _THREADS_BEFORE[1]:
        torch.set_num_threads(_THREADS_BEFORE[0])


class HostClock:
    """Model time on the host's clock, the device synchronized around each timed call (free on CPU, whose ops
    finish before they return). `Device.model_clock()` gives a device's clock (CUDA's reads events instead)."""

    def __init__(self, synchronize):
        self.synchronize = synchronize

    def begin(self) -> float:
        self.synchronize()
        return time.perf_counter()

    def end(self, start: float, key: str, totals: dict) -> None:
        self.synchronize()
        totals[key] += time.perf_counter() - start

    def settle(self, totals: dict) -> None:
        pass  # added as measured


class Device:
    """One accelerator kind: data (name, dtype, dist backend, capabilities, allocator kernels) plus
    synchronize, memory_stats and compile. Subclasses set the data and override what differs."""

    name = "base"
    dist_backend = "gloo"
    capabilities: frozenset = frozenset()  # what the hardware offers, asked instead of the device's name
    allocator_kernels = "torch"  # which allocator kernels pay on this device
    default_dtype = "float32"
    times_weight_layout = False  # weight_layout=auto times both layouts (CPU GEMMs); else it keeps HF's (row)
    packs_weights = False  # it runs oneDNN-packed Linear weights (weight_layout=packed; else that keeps row)
    host_memory = False  # its tensors are host memory: host code (numpy) reads them in place, with no copy or sync

    def __init__(self, dtype: Optional[str] = None, index: int = 0, num_threads: Optional[int] = None,
                 weight_layout: str = "auto"):
        self.dtype = DTYPES[dtype or self.default_dtype]
        self.index = index
        self.weight_layout = weight_layout
        set_threads(num_threads)
        self.torch_device = self.make_torch_device(index)

    def make_torch_device(self, index: int) -> torch.device:
        return torch.device(self.name, index)

    @property
    def supported_modes(self) -> frozenset:
        return DEVICE_SUPPORT[self.name].modes

    def synchronize(self) -> None:
        """Wait for queued work (timing needs it); `torch.<name>.synchronize` by the namespace trick."""
        getattr(torch, self.name).synchronize()

    def memory_stats(self) -> dict:
        """Memory figures for metrics.json's `device_memory` (bytes)."""
        return {}

    def reset_peak_memory(self) -> None:
        """A run begins: its peak figures start from here (sweep jobs share a process)."""

    def bf16_autocast_problem(self) -> str:
        """Why bf16 autocast would slow this device down ('' when its bf16 math is native)."""
        return ""

    def model_clock(self) -> Any:
        """What times the model forwards (`decode.metrics.Metrics.attach_model_timer`): a host clock with the
        device synchronized around each forward; CUDA times them with events instead."""
        return HostClock(self.synchronize)

    def lay_out_weights(self, models, rows) -> dict:
        """Store each Linear weight in the layout its GEMM runs fastest with (devices/weight_layout.py);
        `rows`: the row counts the decode loop's forwards use. Returns the choices, per weight shape."""
        from specpipe.devices.weight_layout import lay_out_weights

        mode, note = self.weight_layout, None
        if mode == "auto" and not self.times_weight_layout:
            mode = "row"
        if mode == "packed" and not self.packs_weights:
            mode, note = "row", (f"device.weight_layout=packed: device {self.name} has no oneDNN packed linear (a CPU "
                                 f"kernel), so the weights stay row-major")
            log.info(f"specpipe: note: {note}")
        self.layout_report = lay_out_weights(models, mode, rows, packs=self.packs_weights)
        for entry in self.layout_report.values() if note else ():
            entry["note"] = note
        return self.layout_report

    def freeze_weight_layouts(self, models) -> None:
        """A model forward was compiled on these weights: later runs keep their layout, and packed weights are
        unpacked first, as no compiled forward runs them (devices/weight_layout.py); the run's report says so."""
        from specpipe.devices.weight_layout import COMPILED_NOTE, freeze_layouts

        unpacked = freeze_layouts(models)
        report = getattr(self, "layout_report", None) or {}
        for key, layout in unpacked.items():
            if key in report:
                report[key].update(layout=layout, compiled=True)
        if unpacked and self.weight_layout == "packed":  # (auto records it in the report only)
            log.info(f"specpipe: note: device.weight_layout=packed: {COMPILED_NOTE} "
                     f"({', '.join(f'{k}: {v}' for k, v in unpacked.items())})")

    # ---- compile policies ----------------------------------------------------------------
    def compile(self, fn: Callable, policy: BranchPolicy, name: Optional[str] = None) -> Callable:
        """Wrap one branch according to its policy; ConfigError when this device cannot run it."""
        if policy.mode == "eager":
            return fn
        problem = device_problem(policy, self.name)
        if problem:
            raise ConfigError(f"compile policy {str(policy)!r} for {name or branch_name(fn)}: {problem}")
        use_build_inductor_cache()
        if policy.mode == "compile":
            return self.compile_fn(fn, policy.kwargs)
        if policy.mode == "graph":
            return self.graph_fn(fn)
        from specpipe.devices.autotune import AutoBranch

        return AutoBranch(name or branch_name(fn), self.auto_candidates(fn, policy.kwargs), self.synchronize)

    def compile_fn(self, fn: Callable, options: dict) -> Callable:
        """torch.compile with the policy's options (`mode=default` is torch's None), batch dim generic; a model
        forward without a `dynamic` option gets dynamic=True.

        Not with mode=reduce-overhead: its CUDA graphs are recorded per concrete size anyway.
        """
        kwargs = {k: v for k, v in options.items() if not (k == "mode" and v == "default")}
        if "cpp_wrapper" in kwargs:  # an inductor config, passed per compiled function
            kwargs["options"] = {"cpp_wrapper": kwargs.pop("cpp_wrapper")}
        if "dynamic" not in kwargs and getattr(fn, "__name__", "") in getattr(getattr(fn, "__self__", None),
                                                                            "model_branches", ()):
            # a model forward's other sizes (prompt length, mask width, the KV pool of each run) change from call
            # to call: left to automatic dynamic shapes they recompiled mid-run and in later runs, and inductor
            # failed to generate code for the draft extend ("name 's27' is not defined")
            kwargs["dynamic"] = True
        # no duck sizing: two sizes equal when traced (a mask width of 16 and a head_dim of 16) share a symbol, so a
        # guard that pins one (index_copy_ into the head_dim) pinned the mask width too, which recompiled mid-run
        # once the context passed it
        import torch.fx.experimental._config as fx_config

        fx_config.use_duck_shape = False
        # floats read in a forward (RMSNorm eps, RoPE scale) as constants, as they are fixed per model and config:
        # left unspecialized, Dynamo passed each as a fresh 0-d tensor and re-checked it with a Python guard on every
        # call (shipped pair's compiled rounds: cache lookup 111 -> 96 µs, pre-graph bytecode 76 -> 27 µs per call;
        # scripts/bench_compile_overhead.py)
        torch._dynamo.config.specialize_float = SPECIALIZE_FLOATS
        compiled = torch.compile(fn, **kwargs)
        return compiled if kwargs.get("mode") == "reduce-overhead" else BatchGeneric(fn, compiled)

    def graph_fn(self, fn: Callable) -> Callable:
        raise ConfigError(f"device {self.name} has no graph capture for {branch_name(fn)}")

    def auto_candidates(self, fn: Callable, options: dict) -> dict[str, Callable]:
        """What `auto` times: eager first (the reference), then every mode this device runs natively."""
        cands = {"eager": fn, "compile": self.compile_fn(fn, options)}
        if "graph" in self.supported_modes:
            cands["graph"] = self.graph_fn(fn)
        return cands


def branch_name(fn: Callable) -> str:
    """`stage.branch` for a bound branch method (e.g. draft_topk.later), else the function's name."""
    owner = getattr(fn, "__self__", None)
    base = getattr(fn, "__name__", type(fn).__name__)
    return f"{owner.name}.{base}" if owner is not None and hasattr(owner, "name") else base
