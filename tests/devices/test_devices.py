"""Devices as data, policy translation per device, and the device-unavailable messages.

No CUDA GPU or Ascend NPU here: the CUDA and NPU paths run against stubs (objects named Stub*,
injected with monkeypatch into torch.cuda / torch.npu / sys.modules) that record what the
device asked for. Real-hardware runs are the `cuda` / `npu` marked suites.
"""
import logging
import os
import sys
import types

import pytest
import torch

from specpipe.devices.autotune import AutoBranch
from specpipe.config.compile_policy import parse_policy
from specpipe.devices import explain_backend_load_error
from specpipe.devices.base import REPO_ROOT, BatchGeneric, use_build_inductor_cache
from specpipe.devices.cpu import CpuDevice
from specpipe.devices.graphs import GraphBranch
from specpipe.errors import ConfigError, DeviceUnavailableError


def double(x):
    return x * 2


# ---- cpu -------------------------------------------------------------------------------------
def test_cpu_device_describes_itself():
    d = CpuDevice()
    assert (d.name, d.torch_device, d.dtype, d.dist_backend) == ("cpu", torch.device("cpu"), torch.float32, "gloo")
    assert d.allocator_kernels == "torch" and "inductor" in d.capabilities
    assert d.supported_modes == {"eager", "compile", "auto"}
    assert CpuDevice("bfloat16").dtype == torch.bfloat16
    d.synchronize()
    assert d.memory_stats()["peak_rss_bytes"] > 0


def test_cpu_translates_policies():
    d = CpuDevice()
    assert d.compile(double, parse_policy("eager")) is double
    assert isinstance(d.compile(double, parse_policy("compile(backend=eager)")), BatchGeneric)
    auto = d.compile(double, parse_policy("auto(backend=eager)"))
    assert isinstance(auto, AutoBranch) and list(auto.candidates) == ["eager", "compile"]
    with pytest.raises(ConfigError, match="no graph capture"):
        d.graph_fn(double)  # the device-side error, even when the policy check is bypassed


def test_cpp_wrapper_reaches_inductor_per_compiled_function(monkeypatch):
    """compile(cpp_wrapper=true) is inductor's per-function option (the kernels' wrapper in C++), not a global
    setting: a branch compiled without it keeps the Python wrapper. The compiled branch computes what eager does."""
    import torch._inductor.config as inductor_config

    seen = []
    real = torch.compile

    def spy(fn, **kwargs):
        seen.append(kwargs)
        return real(fn, **kwargs)

    monkeypatch.setattr(torch, "compile", spy)
    d = CpuDevice()
    f = d.compile(lambda x: (x * 2).sin() + 1, parse_policy("compile(cpp_wrapper=true)"))
    g = d.compile(double, parse_policy("compile(dynamic=false)"))
    assert seen == [{"options": {"cpp_wrapper": True}}, {"dynamic": False}]
    assert inductor_config.cpp_wrapper is False
    x = torch.randn(5)
    torch.testing.assert_close(f(x), (x * 2).sin() + 1)
    torch.testing.assert_close(g(x), x * 2)


@pytest.mark.parametrize("text, words", [
    ("graph", ["cpu cannot run 'graph'", "no graph capture", "device=cuda"]),
    ("compile(mode=reduce-overhead)", ["reduce-overhead", "CUDA graphs"]),
])
def test_cpu_refuses_what_it_cannot_run(text, words):
    with pytest.raises(ConfigError) as e:
        CpuDevice().compile(double, parse_policy(text))
    assert all(w in str(e.value) for w in words), str(e.value)


def test_inductor_cache_defaults_into_the_build_folder(monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert use_build_inductor_cache() == str(REPO_ROOT / "build" / "inductor-cache")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(REPO_ROOT / "build" / "inductor-cache")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/elsewhere")
    assert use_build_inductor_cache() == "/elsewhere"


# ---- cuda (stubbed) --------------------------------------------------------------------------
def test_cuda_unavailable_says_why_and_what_to_install(monkeypatch):
    from specpipe.devices.cuda import CudaDevice

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(DeviceUnavailableError, match="CPU build.*pip install torch==2.13.0"):
        CudaDevice()
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    with pytest.raises(DeviceUnavailableError, match="built for CUDA 12.8 but no CUDA GPU"):
        CudaDevice()


@pytest.fixture
def stub_cuda(monkeypatch):
    """STUB: torch.cuda reports one GPU; torch.compile records its arguments instead of compiling."""
    from specpipe.devices.cuda import CudaDevice

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: calls.append(kw) or fn)
    return CudaDevice, calls


def test_cuda_translates_policies(stub_cuda):
    CudaDevice, calls = stub_cuda
    d = CudaDevice()
    assert (d.torch_device, d.dtype, d.allocator_kernels, d.dist_backend) == (
        torch.device("cuda", 0), torch.bfloat16, "triton", "nccl")
    d.compile(double, parse_policy("compile(dynamic=false, fullgraph=true, mode=max-autotune-no-cudagraphs)"))
    assert calls[-1] == {"dynamic": False, "fullgraph": True, "mode": "max-autotune-no-cudagraphs"}
    d.compile(double, parse_policy("compile(mode=default)"))
    assert calls[-1] == {}  # torch's default mode is None
    assert d.compile(double, parse_policy("compile(mode=reduce-overhead)")) is double  # no batch marks: cudagraphs
    g = d.compile(double, parse_policy("graph"))
    assert isinstance(g, GraphBranch) and g.api is torch.cuda and g.graph_cls == "CUDAGraph"
    auto = d.compile(double, parse_policy("auto"))
    assert list(auto.candidates) == ["eager", "compile", "graph"]
    with pytest.raises(DeviceUnavailableError, match="device.index=3 but 1 CUDA GPU"):
        CudaDevice(index=3)


def test_cuda_selects_the_configured_gpu_and_graphs_over_the_configured_sizes(stub_cuda, monkeypatch):
    """device.index reaches torch's current device (Triton launches, capture streams and events use it): without
    it, cuda:1 ran kernels and captured graphs on GPU 0's streams with GPU 1's tensors."""
    CudaDevice, _ = stub_cuda
    chosen = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    d = CudaDevice(index=1, graph_batch_sizes=[1, 2, 4], graph_context_buckets=[256])
    assert d.torch_device == torch.device("cuda", 1) and chosen == [torch.device("cuda", 1)]
    g = d.graph_fn(double)
    assert (g.batch_sizes, g.context_buckets) == ([1, 2, 4], [256])


def test_graph_capture_runs_on_the_inputs_device():
    """The capture's side stream and graph are made under the inputs' device (api.device), not the current one."""
    import contextlib

    from test_graph_capture import StubGraphApi

    entered = []

    class Api(StubGraphApi):
        @staticmethod
        @contextlib.contextmanager
        def device(d):
            entered.append(d)
            yield

    g = GraphBranch(double, Api, "CUDAGraph")
    assert g(torch.empty(3, 2, device="meta")).shape == (3, 2)
    assert entered == [torch.device("meta")]


class StubEvent:
    """STUB of torch.cuda.Event: `clock` is the GPU's; elapsed_time in ms as CUDA gives it."""
    clock = [0.0]

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.t = None

    def record(self):
        StubEvent.clock[0] += 1.0
        self.t = StubEvent.clock[0]

    def query(self):
        return True

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return 1000.0 * (end.t - self.t)


def test_cuda_model_time_comes_from_events_without_a_sync_per_forward(stub_cuda, monkeypatch):
    """model_timing synchronized the GPU around every forward, so tokens/s on CUDA measured a serialized loop;
    the CUDA clock records events and reads them once, when the summary is made."""
    from specpipe.decode.metrics import Metrics
    from specpipe.devices.base import HostClock
    from specpipe.devices.cuda import EventClock

    CudaDevice, _ = stub_cuda
    syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: syncs.append(1))
    monkeypatch.setattr(torch.cuda, "Event", StubEvent)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    clock = CudaDevice().model_clock()
    assert isinstance(clock, EventClock) and isinstance(CpuDevice().model_clock(), HostClock)
    lin = torch.nn.Linear(2, 2)
    m = Metrics(1)
    m.attach_model_timer([lin], clock)
    try:
        with m.stage("verify"):
            for _ in range(5):
                lin(torch.randn(1, 2))
    finally:
        m.detach()
    assert not syncs and len(clock.pending) == 5
    summary = m.summary(1.0, 0)
    assert summary["stage_model_ms"]["verify"] == pytest.approx(5 * 1.0 * 1000)  # 1 s per forward, as recorded
    assert not clock.pending


def test_no_event_is_recorded_inside_a_graph_capture(monkeypatch):
    from specpipe.devices.cuda import EventClock

    monkeypatch.setattr(torch.cuda, "Event", StubEvent)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    clock, totals = EventClock(), {}
    clock.end(clock.begin(), "verify", totals)
    assert not clock.pending and not totals


def test_gpu_memory_goes_into_metrics_json(stub_cuda, monkeypatch):
    """metrics.json's device_memory: what the device reports at the run's end, its peak reset at the run's start."""
    CudaDevice, _ = stub_cuda
    reset = []
    for name, value in (("memory_allocated", 5), ("max_memory_allocated", 9), ("memory_reserved", 16),
                        ("max_memory_reserved", 20)):
        monkeypatch.setattr(torch.cuda, name, lambda d=None, v=value: v)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(total_memory=80))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset.append)
    d = CudaDevice()
    d.reset_peak_memory()
    assert reset == [torch.device("cuda", 0)]
    assert d.memory_stats() == {"allocated_bytes": 5, "peak_allocated_bytes": 9, "reserved_bytes": 16,
                                "peak_reserved_bytes": 20, "total_bytes": 80}


def test_a_run_writes_its_device_memory(tmp_path):
    import json

    from helpers import compose

    from specpipe.run import run

    run(compose("model=random_tiny", "draft=none", "workload.max_new_tokens=2", "workload.num_prompts=1"),
        out_dir=str(tmp_path), quiet=True)
    assert json.loads((tmp_path / "metrics.json").read_text())["device_memory"]["peak_rss_bytes"] > 0


# ---- npu (stubbed) ---------------------------------------------------------------------------
def test_npu_without_torch_npu(monkeypatch):
    from specpipe.devices.npu import NpuDevice

    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import torch_npu -> ModuleNotFoundError
    with pytest.raises(DeviceUnavailableError, match="torch_npu package is not installed.*pip install torch-npu"):
        NpuDevice()
    monkeypatch.setenv("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    with pytest.raises(DeviceUnavailableError, match="TORCH_DEVICE_BACKEND_AUTOLOAD=0 is set"):
        NpuDevice()


def test_npu_when_torch_cannot_load_the_extension(monkeypatch, tmp_path):
    """STUB torch_npu package whose import fails the way torch's backend autoload does without CANN."""
    from specpipe.devices.npu import NpuDevice

    pkg = tmp_path / "torch_npu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "try:\n    raise OSError('libhccl.so: cannot open shared object file')\n"
        "except OSError as e:\n    raise RuntimeError('Failed to load the backend extension: torch_npu. You can "
        "disable extension auto-loading with TORCH_DEVICE_BACKEND_AUTOLOAD=0.') from e\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    with pytest.raises(DeviceUnavailableError) as e:
        NpuDevice()
    msg = str(e.value)
    assert "torch_npu failed to load" in msg and "libhccl.so" in msg and "CANN" in msg, msg
    assert "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in msg


def test_backend_load_error_wording():
    err = RuntimeError("Failed to load the backend extension: torch_npu. You can disable ...")
    assert "Ascend CANN" in explain_backend_load_error(err)
    assert "foo_ext failed to load" in explain_backend_load_error(
        RuntimeError("Failed to load the backend extension: foo_ext. x"))
    assert explain_backend_load_error(RuntimeError("something else")) is None


class StubTorchair(types.ModuleType):
    """STUB of torchair: get_npu_backend returns a tag naming the CompilerConfig.mode it was given."""

    class CompilerConfig:
        mode = "max-autotune"

    def __init__(self):
        super().__init__("torchair")

    @staticmethod
    def get_npu_backend(compiler_config):
        return f"torchair[{compiler_config.mode}]"


@pytest.fixture
def stub_npu(monkeypatch):
    """STUB torch_npu + torch.npu (one visible NPU, device objects on the CPU) and a recording torch.compile."""
    from specpipe.devices.npu import NpuDevice

    npu = types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 1, synchronize=lambda: None,
                                set_device=lambda d: None)
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    monkeypatch.setattr(NpuDevice, "make_torch_device", lambda self, index: torch.device("cpu"))
    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: calls.append(kw) or ("compiled", fn))
    return NpuDevice, npu, calls


def test_npu_unavailable_without_a_visible_npu(stub_npu):
    NpuDevice, npu, _ = stub_npu
    npu.is_available = lambda: False
    with pytest.raises(DeviceUnavailableError, match="no Ascend NPU is visible"):
        NpuDevice()


def test_npu_compile_without_torchair_runs_eager_with_one_notice(stub_npu, monkeypatch, caplog):
    NpuDevice, npu, calls = stub_npu
    monkeypatch.setitem(sys.modules, "torchair", None)
    d = NpuDevice()
    assert (d.dtype, d.dist_backend, d.allocator_kernels) == (torch.bfloat16, "hccl", "torch")
    with caplog.at_level(logging.WARNING, logger="specpipe.devices.npu"):
        assert d.compile(double, parse_policy("compile")) is double
        assert d.compile(double, parse_policy("compile(dynamic=false)")) is double
    assert len([r for r in caplog.records if "torchair is not installed" in r.message]) == 1
    assert calls == []
    with pytest.raises(ConfigError, match="neither torchair nor torch_npu's NPUGraph"):
        d.compile(double, parse_policy("graph"))
    npu.NPUGraph, npu.graph = object, object  # torch_npu with graph capture
    g = d.compile(double, parse_policy("graph"))
    assert isinstance(g, GraphBranch) and g.api is npu and g.graph_cls == "NPUGraph"
    assert list(d.compile(double, parse_policy("auto")).candidates) == ["eager", "graph"]


def test_npu_compile_and_graph_use_torchair(stub_npu, monkeypatch):
    NpuDevice, _, calls = stub_npu
    monkeypatch.setitem(sys.modules, "torchair", StubTorchair())
    d = NpuDevice()
    d.compile(double, parse_policy("compile(dynamic=true)"))
    assert calls[-1] == {"backend": "torchair[max-autotune]", "dynamic": True}
    d.compile(double, parse_policy("compile(cpp_wrapper=true)"))  # inductor's: dropped, with a notice
    assert calls[-1] == {"backend": "torchair[max-autotune]"}
    assert any("cpp_wrapper" in n for n in d.notices)
    d.compile(double, parse_policy("compile(mode=reduce-overhead, fullgraph=true)"))
    assert calls[-1] == {"backend": "torchair[reduce-overhead]", "fullgraph": True}
    d.compile(double, parse_policy("compile(backend=aot_eager)"))
    assert calls[-1] == {"backend": "aot_eager"}  # a debugging backend bypasses torchair
    d.compile(double, parse_policy("graph"))
    assert calls[-1] == {"backend": "torchair[reduce-overhead]", "dynamic": False}
    with pytest.raises(ConfigError, match="torchair, not inductor"):
        d.compile(double, parse_policy("compile(backend=inductor)"))


def test_cpu_device_sets_torch_threads_when_asked(monkeypatch):
    """null gives back the count from before a device set one: an in-process sweep's job with
    device.num_threads=null must not inherit the previous job's 1 thread."""
    import torch

    from specpipe.devices import base
    from specpipe.devices.cpu import CpuDevice

    monkeypatch.setattr(base, "_THREADS_BEFORE", [])
    before = torch.get_num_threads()
    try:
        CpuDevice("float32", num_threads=before + 1)
        assert torch.get_num_threads() == before + 1
        CpuDevice("float32", num_threads=before + 2)
        CpuDevice("float32")
        assert torch.get_num_threads() == before
        CpuDevice("float32")
        assert torch.get_num_threads() == before
        CpuDevice("float32", num_threads=before + 1)
        torch.set_num_threads(before + 3)  # the user's own choice, made after the device's
        CpuDevice("float32")
        assert torch.get_num_threads() == before + 3
    finally:
        torch.set_num_threads(before)


def test_more_threads_than_cores_is_noted_once(capsys, monkeypatch):
    """device.num_threads=1000 ran ~50x slower without a word: torch's threads wait on one another."""
    import os

    import torch

    from specpipe.devices import base

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    before = torch.get_num_threads()
    try:
        base.set_threads(3)
        base.set_threads(3)  # (a sweep's next job with the same setting)
        base.set_threads(2)
    finally:
        base.set_threads(None)
        torch.set_num_threads(before)
    err = capsys.readouterr().err
    assert err.count("device.num_threads=3 is more than the 2 CPU core(s)") == 1 and "num_threads=2" not in err
