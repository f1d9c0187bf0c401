"""CPU: the embedded default. torch.compile uses inductor (needs a C++ compiler); no graph capture."""
from __future__ import annotations

import torch

from specpipe.devices.base import Device


class CpuDevice(Device):
    name = "cpu"
    supported_modes = frozenset({"eager", "compile"})

    def __init__(self, dtype: str = "float32", index: int = 0):
        super().__init__(dtype, index)
        self.torch_device = torch.device("cpu")
