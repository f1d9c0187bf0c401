"""CUDA GPUs: `compile` through inductor, `graph` through CUDA graphs, Triton allocator kernels, model time from
CUDA events."""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Optional, Sequence

import torch

from specpipe.devices.base import Device
from specpipe.devices.graphs import GraphBranch
from specpipe.errors import DeviceUnavailableError

INSTALL = ("Install an NVIDIA driver and a CUDA build of torch "
           "(pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128), or run with device=cpu.")


def check_cuda(index: int) -> None:
    """Raise DeviceUnavailableError naming what is missing: a CUDA build, a GPU, or this index."""
    if not torch.cuda.is_available():
        build = torch.version.cuda
        why = (f"this torch build has no CUDA support (it is a CPU build, torch {torch.__version__})" if build is None
               else f"torch {torch.__version__} was built for CUDA {build} but no CUDA GPU or driver is visible "
                    "(check nvidia-smi and CUDA_VISIBLE_DEVICES)")
        raise DeviceUnavailableError(f"device=cuda cannot be used: {why}. {INSTALL}")
    count = torch.cuda.device_count()
    if not 0 <= index < count:
        raise DeviceUnavailableError(f"device=cuda cannot be used: device.index={index} but {count} CUDA GPU(s) are "
                                     f"visible (valid: 0..{count - 1})")


class EventClock:
    """Model time from CUDA events recorded around each timed forward: no host sync per forward, so the host queues
    the next stage while the GPU runs (a synchronize around every forward understated tokens/s). The events are
    read when the run's summary settles them (one sync), or, past `drain_at` pending pairs, as they complete.
    Nothing is recorded while a graph is being captured (an event there would be part of the graph)."""

    def __init__(self, api: Any = torch.cuda, drain_at: int = 512):
        self.api, self.drain_at = api, drain_at
        self.pending: list = []  # (stage, start event, end event), in stream order

    def begin(self) -> Any:
        if self.api.is_current_stream_capturing():
            return None
        ev = self.api.Event(enable_timing=True)
        ev.record()
        return ev

    def end(self, start: Any, key: str, totals: dict) -> None:
        if start is None or self.api.is_current_stream_capturing():
            return
        ev = self.api.Event(enable_timing=True)
        ev.record()
        self.pending.append((key, start, ev))
        if len(self.pending) >= self.drain_at:
            self._drain(totals, wait=False)

    def settle(self, totals: dict) -> None:
        """Add every pending pair's elapsed time to `totals` (seconds), waiting for the GPU once."""
        self._drain(totals, wait=True)

    def _drain(self, totals: dict, wait: bool) -> None:
        done = defaultdict(float)
        while self.pending:
            key, a, b = self.pending[0]
            if wait:
                b.synchronize()
            elif not b.query():
                break  # later events complete later (one stream)
            done[key] += a.elapsed_time(b) / 1000.0  # ms -> s
            self.pending.pop(0)
        for key, s in done.items():
            totals[key] += s


class CudaDevice(Device):
    name = "cuda"
    dist_backend = "nccl"
    capabilities = frozenset({"inductor", "graph_capture", "triton"})
    allocator_kernels = "triton"
    default_dtype = "bfloat16"

    def __init__(self, dtype: Optional[str] = None, index: int = 0, num_threads: Optional[int] = None,
                 weight_layout: str = "auto", graph_batch_sizes: Sequence[int] = (),
                 graph_context_buckets: Sequence[int] = ()):
        check_cuda(index)
        super().__init__(dtype, index, num_threads, weight_layout)
        self.graph_batch_sizes, self.graph_context_buckets = tuple(graph_batch_sizes), tuple(graph_context_buckets)
        # device.index's GPU for everything that takes the current device: Triton launches, graph capture streams,
        # tensors made with device="cuda", CUDA events
        torch.cuda.set_device(self.torch_device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.torch_device)

    def memory_stats(self) -> dict:
        """This GPU's memory now and at its peak since the run began (`reset_peak_memory`), bytes; `total_bytes`:
        the card's."""
        d = self.torch_device
        return {"allocated_bytes": torch.cuda.memory_allocated(d),
                "peak_allocated_bytes": torch.cuda.max_memory_allocated(d),
                "reserved_bytes": torch.cuda.memory_reserved(d),
                "peak_reserved_bytes": torch.cuda.max_memory_reserved(d),
                "total_bytes": torch.cuda.get_device_properties(d).total_memory}

    def reset_peak_memory(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.torch_device)

    def model_clock(self) -> EventClock:
        return EventClock(torch.cuda)

    def graph_fn(self, fn: Callable) -> Callable:
        """CUDA graphs over device.graph_batch_sizes / graph_context_buckets, padded up to the next listed size
        (not inductor's reduce-overhead: it would recompile per shape)."""
        return GraphBranch(fn, torch.cuda, "CUDAGraph", batch_sizes=self.graph_batch_sizes,
                           context_buckets=self.graph_context_buckets)
