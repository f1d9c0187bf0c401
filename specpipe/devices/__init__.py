"""Devices: base.py (the interface), cpu.py, cuda.py, npu.py (the only torch_npu/torchair importer).

This package file imports no torch, so `explain_backend_load_error` can word a failed
`import torch` itself: with torch-npu installed but Ascend CANN missing, torch's device-backend
autoload raises while torch is imported, long before NpuDevice exists.
"""
from __future__ import annotations

from typing import Optional

NPU_INSTALL = ("Install the Ascend CANN toolkit and driver and source CANN's set_env.sh, or, to run on another "
               "device, set TORCH_DEVICE_BACKEND_AUTOLOAD=0 (or `pip uninstall torch-npu`) and use device=cpu.")


def explain_backend_load_error(exc: BaseException) -> Optional[str]:
    """What went wrong and what to install, for torch's "Failed to load the backend extension: <name>"
    RuntimeError; None for any other error. Callers prefix it ("specpipe: ", "device=npu cannot be used: ").

    Call it where `import torch` (or `import torch_npu`) can raise, e.g.:
        try:
            from specpipe.run import run
        except RuntimeError as e:
            msg = explain_backend_load_error(e)
            ...  # print("specpipe: " + msg), exit 2
    """
    text = str(exc)
    marker = "Failed to load the backend extension:"
    if marker not in text:
        return None
    ext = text.split(marker, 1)[1].strip().split()[0].rstrip(".,") if text.split(marker, 1)[1].strip() else "?"
    cause = exc.__cause__ or exc.__context__
    why = f" ({type(cause).__name__}: {cause})" if cause is not None else ""
    if ext == "torch_npu":
        return ("torch's NPU backend extension torch_npu failed to load"
                f"{why}; torch-npu is installed but the Ascend CANN libraries or driver are missing or not on the "
                "library path. " + NPU_INSTALL)
    return (f"torch's backend extension {ext} failed to load{why}. "
            f"Fix or uninstall {ext}, or set TORCH_DEVICE_BACKEND_AUTOLOAD=0 to skip backend autoloading.")
