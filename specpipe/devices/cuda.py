"""CUDA GPUs: compile through inductor, graph through CUDA graphs, Triton allocator kernels."""
from __future__ import annotations

import torch

from specpipe.devices.base import Device
from specpipe.errors import DeviceUnavailableError


class CudaDevice(Device):
    name = "cuda"
    supported_modes = frozenset({"eager", "compile", "graph"})
    allocator_kernels = "triton"

    def __init__(self, dtype: str = "bfloat16", index: int = 0):
        if not torch.cuda.is_available():
            build = torch.version.cuda
            why = ("this torch build has no CUDA support (it is a CPU build, torch "
                   f"{torch.__version__})" if build is None else
                   f"torch {torch.__version__} was built for CUDA {build} but no CUDA GPU or driver is visible")
            raise DeviceUnavailableError(
                f"device=cuda cannot be used: {why}. Install an NVIDIA driver and a CUDA build of torch "
                "(pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128), or run "
                "with device=cpu.")
        super().__init__(dtype, index)
        self.torch_device = torch.device("cuda", index)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.torch_device)

    def memory_stats(self) -> dict:
        return {"allocated_bytes": torch.cuda.memory_allocated(self.torch_device),
                "peak_allocated_bytes": torch.cuda.max_memory_allocated(self.torch_device)}
