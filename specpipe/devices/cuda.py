"""CUDA GPUs: `compile` through inductor, `graph` through CUDA graphs, Triton allocator kernels."""
from __future__ import annotations

from typing import Callable, Optional

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


class CudaDevice(Device):
    name = "cuda"
    dist_backend = "nccl"
    capabilities = frozenset({"inductor", "graph_capture", "triton"})
    allocator_kernels = "triton"
    default_dtype = "bfloat16"

    def __init__(self, dtype: Optional[str] = None, index: int = 0, num_threads: Optional[int] = None,
                 weight_layout: str = "auto"):
        check_cuda(index)
        super().__init__(dtype, index, num_threads, weight_layout)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.torch_device)

    def memory_stats(self) -> dict:
        d = self.torch_device
        return {"allocated_bytes": torch.cuda.memory_allocated(d),
                "peak_allocated_bytes": torch.cuda.max_memory_allocated(d),
                "reserved_bytes": torch.cuda.memory_reserved(d)}

    def graph_fn(self, fn: Callable) -> Callable:
        """A CUDA graph per input signature (not inductor's reduce-overhead: it would recompile per shape)."""
        return GraphBranch(fn, torch.cuda, "CUDAGraph")
