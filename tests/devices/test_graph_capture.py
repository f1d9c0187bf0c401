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


def check_draft_stages(shapes, bind_topk, bind_tree) -> None:
    """draft_topk and build_tree bound by `bind_*` (a compile binding) equal eager for each (B, K, S)."""
    for B, K, S in shapes:
        eager, cap = DraftTopK(K), DraftTopK(K)
        cap.bind(bind_topk)
        want = draft_round(eager, B, K, 16, S, seed=B)
        got = draft_round(cap, B, K, 16, S, seed=B)
        for w, o in zip(tree_flatten(want)[0], tree_flatten(got)[0]):
            assert torch.equal(w, o)
        N = 1 + min(S if K == 1 else K + (S - 1) * K * K, 6)
        bt_eager, bt_cap = BuildTree(K, S, N), BuildTree(K, S, N)
        bt_cap.bind(bind_tree)
        args = tree_inputs(want, B)
        for w, o in zip(dataclasses.astuple(bt_eager(*args)), dataclasses.astuple(bt_cap(*args))):
            assert torch.equal(w, o)


def test_draft_topk_and_build_tree_graphed_equal_eager():
    check_draft_stages(((1, 4, 3), (3, 4, 3), (2, 1, 3)), lambda stage, branch, fn: graphed(fn),
                       lambda stage, branch, fn: graphed(fn))

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


# ---- a fixed list of batch sizes and context buckets, padded up to (sglang's cuda_graph_bs) -------------------------
def counted(fn, **lists):
    """`fn` graphed over the lists, and how many times fn itself ran (only ever while capturing)."""
    calls = []

    def run(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)
    run.__name__ = "branch"
    return GraphBranch(run, StubGraphApi, "CUDAGraph", **lists), calls


def test_listed_batch_sizes_are_captured_on_the_first_call_and_padded_up_to():
    g, calls = counted(lambda x, ids: (x * 2, ids.repeat_interleave(2, 0) + 1), batch_sizes=[1, 2, 4, 8])
    x, ids = torch.randn(3, 5), torch.arange(6).view(3, 2)
    out = g(x, ids)  # warm-up: 1, 2 (cut from these rows) and 4 (padded) captured now
    assert torch.equal(out[0], x * 2) and torch.equal(out[1], ids.repeat_interleave(2, 0) + 1)
    assert sorted(c.static_in[0].shape[0] for c in g.captures.values()) == [1, 2, 4]
    ran = len(calls)
    for B in (1, 2, 3, 4, 2):  # shrinking and regrowing batches replay, none captures
        x, ids = torch.randn(B, 5), torch.randint(0, 9, (B, 2))
        out = g(x, ids)
        assert out[0].shape[0] == B and torch.equal(out[0], x * 2)
        assert torch.equal(out[1], ids.repeat_interleave(2, 0) + 1)  # [2B] rows: m x the batch, cut to m x B
    assert len(calls) == ran and len(g.captures) == 3
    g(torch.randn(6, 5), torch.randint(0, 9, (6, 2)))  # a larger listed size: captured once, padded from 6
    assert len(g.captures) == 4 and not g.notes


def test_a_batch_beyond_the_list_is_captured_with_a_note_never_run_eager(caplog):
    g, calls = counted(lambda x: x + 1, batch_sizes=[1, 2])
    g(torch.zeros(2, 3))
    with caplog.at_level("INFO", logger="specpipe"):
        x = torch.randn(5, 3)
        assert torch.equal(g(x), x + 1)
        assert torch.equal(g(x * 2), x * 2 + 1)  # replayed: its own capture
    assert len(g.notes) == 1 and "batch 5 is above device.graph_batch_sizes (largest 2)" in g.notes[0]
    assert "captured at its own size" in caplog.text and len(g.captures) == 3
    for _ in range(300):  # no cap on the number of graphs after which a branch would silently run eager
        g(torch.randn(1, 3))
    assert len(calls) == 3 * 3  # (2 warm-ups + 1 recording) per capture, never an eager call


def test_dummy_rows_write_the_null_slot_never_a_previous_calls_slots():
    """A padded replay must not reuse the rows a larger batch left in the static buffers: a stale out_slots row
    would write another request's KV slot."""
    pool = torch.zeros(16)

    def write(slots, vals):  # [B] slots, [B] values: a forward's K/V write, with the null slot zeroed after it
        pool.index_copy_(0, slots, vals)
        pool.index_fill_(0, torch.zeros(1, dtype=torch.int64), 0)
        return vals * 2

    g = GraphBranch(write, StubGraphApi, "CUDAGraph", batch_sizes=[4])
    g(torch.tensor([1, 2, 3, 4]), torch.tensor([1., 2., 3., 4.]))
    pool.zero_()
    out = g(torch.tensor([5, 6, 7]), torch.tensor([5., 6., 7.]))  # padded to 4 over the previous call's rows
    assert out.tolist() == [10., 12., 14.]
    assert pool.nonzero().view(-1).tolist() == [5, 6, 7]  # slot 4 (the stale fourth row's) untouched


def test_graphed_draft_stages_padded_to_listed_sizes_equal_eager():
    """draft_topk (inputs of B and B*K rows) and build_tree padded from B = 3 to 4 and from 5 to 8."""
    check_draft_stages(
        ((3, 4, 3), (5, 2, 3), (3, 1, 3)),
        lambda stage, branch, fn: GraphBranch(fn, StubGraphApi, "CUDAGraph", batch_sizes=[1, 2, 4, 8]),
        lambda stage, branch, fn: GraphBranch(fn, StubGraphApi, "CUDAGraph", batch_sizes=[2, 4, 8]))

def verify_inputs(B, Q, seed):
    """B requests with contexts of different lengths, Q new tokens each: tokens [B, Q] and their AttentionBatch."""
    from specpipe.models.attention_batch import AttentionBatch

    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 9, (B,), generator=g).tolist()
    Lkv = max(lens) + Q
    table = torch.zeros(B, Lkv, dtype=torch.int64)
    mask = torch.zeros(B, Q, Lkv, dtype=torch.bool)
    start = 1
    for b, L in enumerate(lens):
        table[b, :L + Q] = torch.arange(start, start + L + Q)
        start += L + Q
        for q in range(Q):
            mask[b, q, :L + q + 1] = True
    positions = torch.tensor([[L + q for q in range(Q)] for L in lens])
    out_slots = torch.stack([table[b, L:L + Q] for b, L in enumerate(lens)])
    kv_pos = torch.arange(Lkv).expand(B, Lkv).contiguous()
    tokens = torch.randint(1, 200, (B, Q), generator=g)
    return tokens, AttentionBatch(positions, out_slots, table, mask, kv_pos)


def test_a_model_forward_padded_in_batch_and_key_columns_equals_eager():
    """The target's forward graphed over batch sizes [1, 2, 4] and context buckets [16, 32]: a batch of 3 runs
    as 4 (a dummy request at position 0 writing slot 0) and its 10-14 key columns as 16 (masked columns at slot 0).
    Logits, features and the KV pool equal eager; the null slot stays zero."""
    from specpipe.models.random_tiny import build_random_tiny
    from specpipe.stages.verify import Verify

    target = build_random_tiny(seed=0, dtype="float64", max_position=64).target
    target.setup_kv(96)
    g = torch.Generator().manual_seed(1)
    for i in range(len(target.kv.keys)):
        for t in target.kv.layer(i):
            t.copy_(torch.randn(t.shape, generator=g, dtype=t.dtype))
            t[0] = 0
    start = [t.clone() for i in range(len(target.kv.keys)) for t in target.kv.layer(i)]

    def pool():
        return [t for i in range(len(target.kv.keys)) for t in target.kv.layer(i)]

    fwd = Verify(target, 1).target_forward
    graphed = GraphBranch(fwd, StubGraphApi, "CUDAGraph", batch_sizes=[1, 2, 4], context_buckets=[16, 32])
    with torch.no_grad():
        for B, seed in ((3, 0), (2, 1), (3, 2)):
            tokens, batch = verify_inputs(B, 2, seed)
            for t, s in zip(pool(), start):
                t.copy_(s)
            want = fwd(tokens, batch)
            want_pool = [t.clone() for t in pool()]
            for t, s in zip(pool(), start):
                t.copy_(s)
            got = graphed(tokens, batch)
            for w, o in zip(tree_flatten(want)[0], tree_flatten(got)[0]):
                assert w.shape == o.shape
                torch.testing.assert_close(o, w, rtol=1e-12, atol=1e-12)
            for w, o in zip(want_pool, pool()):
                assert (w - o).abs().max() < 1e-12 and not o[0].any(), ((w - o).abs().max(), (w != o).nonzero()[:5])
    widths = {c.static_in[3].shape for c in graphed.captures.values()}  # kv_slots: [rows, Lkv padded to 16]
    assert widths == {torch.Size([1, 16]), torch.Size([2, 16]), torch.Size([4, 16])}
