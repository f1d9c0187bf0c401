"""GraphBranch (the `graph` policy on CUDA and NPU) against a stub graph API that replays like a real one.

StubGraphApi stands in for torch.cuda: during capture a dispatch mode records every aten op with
its argument and output tensors; replay reruns the ops and writes each result into the recorded
output tensor, so like a CUDA graph it only ever reads and writes the captured addresses. A
runner that forgot to copy inputs into its static buffers, or returned the static outputs
without cloning them, fails these tests the way it would fail on a GPU.
"""
import contextlib
import dataclasses

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from draft_inputs import draft_round, tree_inputs
from specpipe.devices.graphs import GraphBranch
from specpipe.stages.build_tree import BuildTree
from specpipe.stages.draft_topk import DraftTopK


class StubGraph:
    """STUB of torch.cuda.CUDAGraph: replays recorded aten ops into the captured output tensors."""

    def __init__(self):
        self.ops = []

    def replay(self):
        for func, args, kwargs, out in self.ops:
            new = func(*args, **kwargs)
            if func.is_view:
                continue  # a view of a captured buffer already sees the replayed data
            for o, n in zip(tree_flatten(out)[0], tree_flatten(new)[0]):
                if isinstance(o, torch.Tensor) and o is not n:
                    o.copy_(n)


class _Record(TorchDispatchMode):
    def __init__(self, graph):
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.graph.ops.append((func, args, kwargs or {}, out))
        return out


class StubGraphApi:
    """STUB of the torch.cuda graph API surface GraphBranch uses."""

    CUDAGraph = StubGraph
    captures = 0

    class Stream:
        def wait_stream(self, other):
            pass

    @staticmethod
    def stream(s):
        return contextlib.nullcontext()

    @staticmethod
    def current_stream():
        return StubGraphApi.Stream()

    @staticmethod
    def graph_pool_handle():
        return object()

    @staticmethod
    @contextlib.contextmanager
    def graph(g, pool=None):
        StubGraphApi.captures += 1
        with _Record(g):
            yield


def graphed(fn):
    return GraphBranch(fn, StubGraphApi, "CUDAGraph")


def test_replay_reads_new_inputs_and_returns_fresh_outputs():
    g = graphed(lambda x, y: (x * 2 + y, x.sum(-1)))
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    first = g(x, y)
    torch.testing.assert_close(first[0], x * 2 + y)
    x2 = torch.randn(3, 4)
    second = g(x2, y)  # same signature: replay, no new capture
    assert len(g.captures) == 1
    torch.testing.assert_close(second[0], x2 * 2 + y)
    torch.testing.assert_close(first[0], x * 2 + y)  # an earlier result survives the next replay
    g(torch.randn(5, 4), torch.randn(5, 4))
    assert len(g.captures) == 2  # a new shape gets its own capture


@dataclasses.dataclass
class Batch:
    slots: torch.Tensor  # [B, Q]
    scale: int


def test_dataclass_arguments_and_non_tensor_values_key_the_capture():
    g = graphed(lambda ids, batch: ids * batch.scale + batch.slots)
    ids, slots = torch.arange(6).view(2, 3), torch.ones(2, 3, dtype=torch.int64)
    assert torch.equal(g(ids, Batch(slots, 2)), ids * 2 + 1)
    assert torch.equal(g(ids + 1, Batch(slots, 2)), (ids + 1) * 2 + 1)
    assert torch.equal(g(ids, Batch(slots, 3)), ids * 3 + 1)
    assert len(g.captures) == 2


def test_draft_topk_and_build_tree_graphed_equal_eager():
    for B, K, S in ((1, 4, 3), (3, 4, 3), (2, 1, 3)):
        eager, cap = DraftTopK(K), DraftTopK(K)
        cap.bind(lambda stage, branch, fn: graphed(fn))
        want = draft_round(eager, B, K, 16, S, seed=B)
        got = draft_round(cap, B, K, 16, S, seed=B)
        for w, o in zip(tree_flatten(want)[0], tree_flatten(got)[0]):
            assert torch.equal(w, o)
        N = 1 + min(S if K == 1 else K + (S - 1) * K * K, 6)
        bt_eager, bt_cap = BuildTree(K, S, N), BuildTree(K, S, N)
        bt_cap.bind(lambda stage, branch, fn: graphed(fn))
        args = tree_inputs(want, B)
        for w, o in zip(dataclasses.astuple(bt_eager(*args)), dataclasses.astuple(bt_cap(*args))):
            assert torch.equal(w, o)


class CapturingApi(StubGraphApi):
    """StubGraphApi that knows when a capture is open (a real CUDA graph capture refuses synchronize)."""

    capturing = False

    @staticmethod
    @contextlib.contextmanager
    def graph(g, pool=None):
        CapturingApi.capturing = True
        try:
            with _Record(g):
                yield
        finally:
            CapturingApi.capturing = False


def test_graphed_model_branch_is_timed_without_synchronizing_inside_the_capture():
    from omegaconf import OmegaConf

    from specpipe.stages.compile_binding import make_wrap
    from specpipe.decode.metrics import Metrics
    from specpipe.stages.base import Stage, branch

    lin = torch.nn.Linear(4, 4)

    class Target(Stage):
        name = "verify"
        model_branches = frozenset({"target_forward"})

        @branch
        def target_forward(self, x):
            return lin(x)

    def synchronize():
        assert not CapturingApi.capturing, "synchronize() inside a graph capture (cudaErrorStreamCaptureUnsupported)"

    class GraphDevice:
        def compile(self, fn, policy, name=None):
            return GraphBranch(fn, CapturingApi, "CUDAGraph")

    metrics = Metrics(1)
    metrics.attach_model_timer([lin], synchronize)  # the module timer hooks run inside the branch
    stage = Target()
    stage.bind(make_wrap(OmegaConf.create({"compile": {"verify": {"target_forward": "graph"}}}),
                         GraphDevice(), metrics))
    x = torch.randn(2, 4)
    with torch.no_grad():
        with metrics.stage("verify"):
            for _ in range(3):  # warm-up + capture, then replays
                torch.testing.assert_close(stage.target_forward(x), lin(x))
    assert metrics.model_s["verify"] > 0  # timed as a whole, around the branch
