"""CPU: the embedded default. `compile` runs inductor (needs the machine's C++ compiler); no graph capture."""
from __future__ import annotations

import resource
import sys
from typing import Callable

import torch

from specpipe.devices.base import Device
from specpipe.errors import ConfigError


class CpuDevice(Device):
    name = "cpu"
    dist_backend = "gloo"
    capabilities = frozenset({"inductor"})
    allocator_kernels = "torch"
    default_dtype = "float32"
    host_memory = True  # the n-gram drafter matches in numpy on the token history itself (drafters/ngram_host.py)
    times_weight_layout = True  # MKL's speed depends on the weight layout, by shape (devices/weight_layout.py)

    @property
    def packs_weights(self) -> bool:
        """oneDNN's packed linear is in this torch build (weight_layout=packed; devices/weight_layout.py)."""
        from specpipe.devices.weight_layout import packing_available

        return packing_available()

    def bf16_autocast_problem(self) -> str:
        """oneDNN runs bf16 GEMMs natively only with AVX512-BF16 or AMX. Elsewhere autocast emulates them: on a 2-core
        AVX2 EPYC a 2048x256x704 linear took 106 ms in bf16 against 12 ms in float32."""
        try:
            native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):
            native = False
        return "" if native else ("this CPU has no native bf16 matrix multiply (AVX512-BF16 or AMX), so bf16 "
                                  "autocast would emulate it, several times slower than float32")

    def make_torch_device(self, index: int) -> torch.device:
        return torch.device("cpu")  # one CPU device; `index` only matters on accelerators

    def synchronize(self) -> None:
        pass  # CPU ops finish before they return

    def memory_stats(self) -> dict:
        """Peak resident set size of this process (Linux reports KiB, macOS bytes)."""
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return {"peak_rss_bytes": int(peak if sys.platform == "darwin" else peak * 1024)}

    def graph_fn(self, fn: Callable) -> Callable:
        raise ConfigError("device cpu cannot run 'graph': a CPU has no graph capture (that needs CUDA or NPU "
                          "graphs); use compile or eager here, or run with device=cuda or device=npu")
