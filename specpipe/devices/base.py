"""A Device describes one accelerator kind as data plus a few methods; nothing else asks which device runs."""
from __future__ import annotations

from typing import Callable

import torch

from specpipe.compile_policy import BranchPolicy

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Device:
    name = "base"
    supported_modes: frozenset = frozenset({"eager", "compile"})
    capabilities: frozenset = frozenset()
    allocator_kernels = "torch"  # which allocator kernels pay on this device

    def __init__(self, dtype: str = "float32", index: int = 0):
        self.dtype = DTYPES[dtype]
        self.index = index
        self.torch_device = torch.device(self.name)

    def synchronize(self) -> None:
        pass

    def memory_stats(self) -> dict:
        return {}

    def compile(self, fn: Callable, policy: BranchPolicy) -> Callable:
        """Wrap one branch according to its policy."""
        if policy.mode == "eager":
            return fn
        if policy.mode == "compile":
            return torch.compile(fn, **policy.kwargs)
        raise ValueError(f"device {self.name} cannot run policy {policy} (valid: {sorted(self.supported_modes)})")
