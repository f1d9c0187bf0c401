"""Ascend NPU through torch_npu: the only module that imports torch_npu (lazily, in __init__)."""
from __future__ import annotations

import os

import torch

from specpipe.devices.base import Device
from specpipe.errors import DeviceUnavailableError

INSTALL = ("Install the Ascend CANN toolkit and driver, then `pip install torch-npu==2.13.0` matching "
           "torch 2.13.0, and source CANN's set_env.sh; or run with device=cpu.")


def import_torch_npu():
    """Import torch_npu or raise DeviceUnavailableError saying what failed and what to install."""
    if os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD") == "0":
        autoload = " (TORCH_DEVICE_BACKEND_AUTOLOAD=0 is set, so torch did not load it automatically)"
    else:
        autoload = ""
    try:
        import torch_npu  # noqa: F401
    except ModuleNotFoundError:
        raise DeviceUnavailableError(f"device=npu cannot be used: the torch_npu package is not installed{autoload}. "
                                     + INSTALL) from None
    except Exception as e:  # torch's "Failed to load the backend extension: torch_npu" and CANN errors
        raise DeviceUnavailableError(f"device=npu cannot be used: importing torch_npu failed ({e}){autoload}. "
                                     "This usually means the Ascend CANN libraries or drivers are missing. "
                                     + INSTALL) from None
    return torch_npu


class NpuDevice(Device):
    name = "npu"
    supported_modes = frozenset({"eager", "compile", "graph"})

    def __init__(self, dtype: str = "bfloat16", index: int = 0):
        import_torch_npu()
        if not torch.npu.is_available():  # type: ignore[attr-defined]
            raise DeviceUnavailableError("device=npu cannot be used: torch_npu is installed but no Ascend NPU "
                                         "is visible (check npu-smi info and the driver). " + INSTALL)
        super().__init__(dtype, index)
        self.torch_device = torch.device("npu", index)

    def synchronize(self) -> None:
        torch.npu.synchronize()  # type: ignore[attr-defined]
