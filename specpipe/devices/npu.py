"""Ascend NPU through torch_npu: the only module that imports torch_npu and torchair, lazily, in NpuDevice.

Policy translation (hiascend TorchAir guide: torch.compile's own `mode`/`options` are not used
with the torchair backend, and torch_npu must be imported before torchair):
- `compile` -> torch.compile(fn, backend=torchair.get_npu_backend(compiler_config=CompilerConfig()))
  with CompilerConfig.mode max-autotune (reduce-overhead when the policy says so). Without
  torchair it runs eager, with one logged notice: the documented translation.
- `graph` -> the same backend with CompilerConfig.mode = "reduce-overhead" (ACL graph capture,
  static shapes), else torch_npu's NPUGraph capture per input signature, else a ConfigError.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable, Optional, Sequence

import torch

from specpipe.devices import explain_backend_load_error
from specpipe.devices.base import Device
from specpipe.devices.graphs import GraphBranch
from specpipe.errors import ConfigError, DeviceUnavailableError

log = logging.getLogger(__name__)
INSTALL = ("Install the Ascend CANN toolkit and driver, source CANN's set_env.sh, then `pip install torch-npu==2.13.0` "
           "(matching torch 2.13.0) and optionally torchair for graph mode; or run with device=cpu.")


def import_torch_npu():
    """Import torch_npu or raise DeviceUnavailableError saying what failed and what to install."""
    autoload = (" (TORCH_DEVICE_BACKEND_AUTOLOAD=0 is set, so torch did not load it at `import torch`)"
                if os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD") == "0" else "")
    try:
        import torch_npu
    except ModuleNotFoundError as e:
        if e.name not in (None, "torch_npu"):  # torch_npu is there but one of its own imports is not
            raise DeviceUnavailableError(f"device=npu cannot be used: importing torch_npu failed because module "
                                         f"{e.name!r} is missing{autoload}. " + INSTALL) from None
        raise DeviceUnavailableError(f"device=npu cannot be used: the torch_npu package is not installed{autoload}. "
                                     + INSTALL) from None
    except Exception as e:  # torch's "Failed to load the backend extension: torch_npu", missing CANN libraries
        known = explain_backend_load_error(e)
        raise DeviceUnavailableError(f"device=npu cannot be used{autoload}: {known}" if known else (
            f"device=npu cannot be used: importing torch_npu failed ({type(e).__name__}: {e}){autoload}. "
            "This usually means the Ascend CANN libraries or driver are missing. " + INSTALL)) from None
    return torch_npu


def import_torchair() -> Optional[Any]:
    """torchair when installed (after torch_npu, as it requires), else None."""
    try:
        import torchair
    except ImportError:
        return None
    return torchair


class NpuDevice(Device):
    name = "npu"
    dist_backend = "hccl"
    capabilities = frozenset({"graph_capture"})
    allocator_kernels = "torch"
    default_dtype = "bfloat16"

    def __init__(self, dtype: Optional[str] = None, index: int = 0, num_threads: Optional[int] = None,
                 weight_layout: str = "auto", graph_batch_sizes: Sequence[int] = (),
                 graph_context_buckets: Sequence[int] = ()):
        import_torch_npu()
        npu = getattr(torch, "npu", None)
        if npu is None or not npu.is_available():
            raise DeviceUnavailableError("device=npu cannot be used: torch_npu imported but no Ascend NPU is visible "
                                         "(check `npu-smi info`, the driver and ASCEND_RT_VISIBLE_DEVICES). " + INSTALL)
        count = npu.device_count()
        if not 0 <= index < count:
            raise DeviceUnavailableError(f"device=npu cannot be used: device.index={index} but {count} NPU(s) are "
                                         f"visible (valid: 0..{count - 1})")
        super().__init__(dtype, index, num_threads, weight_layout)
        self.graph_batch_sizes, self.graph_context_buckets = tuple(graph_batch_sizes), tuple(graph_context_buckets)
        npu.set_device(self.torch_device)  # device.index's NPU for streams, graphs and tensors made with "npu"
        self.torchair = import_torchair()
        self.notices: list[str] = []  # translations made, each logged once

    def synchronize(self) -> None:
        torch.npu.synchronize()  # type: ignore[attr-defined]

    def memory_stats(self) -> dict:
        npu = torch.npu  # type: ignore[attr-defined]
        return {"allocated_bytes": npu.memory_allocated(self.torch_device),
                "peak_allocated_bytes": npu.max_memory_allocated(self.torch_device)}

    def notice(self, text: str) -> None:
        if text not in self.notices:
            self.notices.append(text)
            log.warning(text)

    def torchair_backend(self, graph_mode: str) -> Any:
        cfg = self.torchair.CompilerConfig()
        cfg.mode = graph_mode
        return self.torchair.get_npu_backend(compiler_config=cfg)

    def compile_fn(self, fn: Callable, options: dict) -> Callable:
        """torch.compile through torchair; batch dims are not marked unbacked (untested with torchair,
        and its ACL graphs need concrete sizes)."""
        opts = dict(options)
        mode, backend = opts.pop("mode", None), opts.pop("backend", None)
        if opts.pop("cpp_wrapper", None) is not None and backend is None:
            self.notice("device=npu: compile(cpp_wrapper=...) is an inductor setting; torchair builds its own graph, "
                        "so it is ignored")
        if backend is not None:  # aot_eager / eager: debugging backends, torch's own
            return torch.compile(fn, backend=backend, **opts)
        if self.torchair is None:
            self.notice("device=npu: torchair is not installed, so `compile` policies run eager "
                        "(pip install torchair to compile on the NPU)")
            return fn
        graph_mode = "reduce-overhead" if mode == "reduce-overhead" else "max-autotune"
        return torch.compile(fn, backend=self.torchair_backend(graph_mode), **opts)

    def graph_fn(self, fn: Callable) -> Callable:
        if self.torchair is not None:  # ACL graphs take static shapes: one capture per shape
            return torch.compile(fn, backend=self.torchair_backend("reduce-overhead"), dynamic=False)
        if hasattr(torch.npu, "NPUGraph") and hasattr(torch.npu, "graph"):  # type: ignore[attr-defined]
            return GraphBranch(fn, torch.npu, "NPUGraph", batch_sizes=self.graph_batch_sizes,  # type: ignore
                               context_buckets=self.graph_context_buckets)
        raise ConfigError("device=npu cannot run 'graph': neither torchair nor torch_npu's NPUGraph is available; "
                          "pip install torchair, upgrade torch-npu, or use compile/eager")

    def auto_candidates(self, fn: Callable, options: dict) -> dict[str, Callable]:
        cands = {"eager": fn}
        if self.torchair is not None or options.get("backend"):
            cands["compile"] = self.compile_fn(fn, options)
        try:
            cands["graph"] = self.graph_fn(fn)
        except ConfigError:
            pass
        return cands
