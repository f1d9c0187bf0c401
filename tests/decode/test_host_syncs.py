"""The decode hot path reads back from the device once per step (the committed tokens), nothing else.

Explicit device->host reads are counted by wrapping Tensor.item/tolist/cpu/numpy/__bool__ while
steady-state steps run; the allocator gets page counts from host integers (num_new_pages), so it
never needs to read a device tensor either. Implicit reads are caught at the dispatcher: an op whose
output size depends on the data (a boolean-mask index, nonzero, unique, repeat_interleave without
output_size) must read the device back to size its result, on an accelerator a sync per call.
"""
from collections import Counter
from contextlib import nullcontext

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import compose
from specpipe.run import run
from specpipe.decode.scheduler import run_requests

READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
aten = torch.ops.aten
SIZED_BY_DATA = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
                 aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default}
BOOL_INDEXED = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}


class DataSizedOps(TorchDispatchMode):
    """Counts ops whose output size (or a Python scalar) comes from tensor values, by op name."""

    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        hit = func in SIZED_BY_DATA
        if func in BOOL_INDEXED:
            hit = any(i is not None and i.dtype == torch.bool for i in args[1])
        elif func is aten.repeat_interleave.Tensor:
            hit = kwargs.get("output_size") is None
        if hit:
            self.counts[str(func)] += 1
        return func(*args, **kwargs)


def run_steady(monkeypatch, in_step: list, *overrides, mode=None) -> int:
    """Decode a small workload with `in_step[0]` True (and `mode` entered) inside each decode step after two
    warm-up steps; the number of steps run."""
    steps = [0]

    def spy(run_requests_fn):
        def inner(pipe, reqs, batch_size, show_progress=None, **kw):
            cls = type(pipe)
            real = cls.step

            def counted(self):
                steps[0] += 1
                in_step[0] = steps[0] > 2  # after warm-up
                try:
                    with mode if in_step[0] and mode is not None else nullcontext():
                        return real(self)
                finally:
                    in_step[0] = False
            monkeypatch.setattr(cls, "step", counted)
            return run_requests_fn(pipe, reqs, batch_size, show_progress, **kw)
        return inner

    monkeypatch.setattr("specpipe.run.run_requests", spy(run_requests))
    run(compose("model=random_tiny", "workload.num_prompts=2", "workload.batch_size=2", "workload.max_new_tokens=40",
                "speculation=static", *overrides), quiet=True)  # (static reads no tree back: see the cost case)
    return steps[0]


def count_reads(monkeypatch) -> tuple[Counter, list, DataSizedOps]:
    """(explicit device->host reads by method name, counted while in_step[0] is True; in_step; the dispatcher
    mode that counts ops sized by the data)."""
    counts, in_step = Counter(), [False]
    for name in READS:
        orig = getattr(torch.Tensor, name)

        def wrapped(self, *a, _orig=orig, _name=name, **k):
            if in_step[0]:
                counts[_name] += 1
            return _orig(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, wrapped)
    return counts, in_step, DataSizedOps()


@pytest.mark.parametrize("overrides", [
    ["draft.topk=4", "draft.num_steps=3"],
    ["draft.topk=1", "draft.num_steps=4", "allocator=paged", "allocator.page_size=16"],
    ["draft=ngram"],
    ["draft=suffix", "workload.num_prompts=4"],  # the second pair drafts from the first pair's outputs too
    ["draft=none"],
    ["draft.topk=4", "draft.num_steps=3", "workload.logprobs=true"],  # log-probabilities ride along
    ["draft=none", "workload.logprobs=true"],
    ["draft=standalone", "draft.num_steps=3"],  # the draft model's extend took its length from the device
    ["draft=standalone", "draft.num_steps=3", "allocator=paged", "allocator.page_size=4"],
    ["sampling.temperature=0.8", "draft.topk=4", "draft.num_steps=3"],  # F.one_hot checked its ids on the host
    ["sampling.temperature=0.8", "sampling.top_p=0.9", "sampling.repetition_penalty=1.2", "draft=ngram"],
    # the window pool frees the pages that left the window every round, and released rows free both pools
    ["allocator=swa", "allocator.window=8", "model.sliding_window=8", "workload.num_prompts=3"],
    ["allocator=swa", "allocator.window=16", "model.sliding_window=16", "allocator.page_size=4", "draft=ngram",
     "workload.num_prompts=3"],
])
def test_one_host_read_per_step(monkeypatch, overrides):
    counts, in_step, sized = count_reads(monkeypatch)
    steps = run_steady(monkeypatch, in_step, *overrides, mode=sized)
    measured = steps - 2
    assert measured > 5
    assert counts["tolist"] == measured, counts  # the commit's single read per step
    assert sum(v for k, v in counts.items() if k != "tolist") == 0, counts
    assert not sized.counts, sized.counts


@pytest.mark.parametrize("draft", ["ngram", "eagle"])
def test_a_shaping_policy_adds_only_the_trees_host_view(monkeypatch, draft):
    """speculation=cost (the default) reads each drafted tree's shape to choose what to verify, in one read (on an
    accelerator, one more sync on a step that drafts). Still one commit read per step, and no op sized by the
    data."""
    counts, in_step, sized = count_reads(monkeypatch)
    steps = run_steady(monkeypatch, in_step, f"draft={draft}", "speculation=cost",
                       "speculation.cost_ms={2: {1: 1, 8: 1}}", mode=sized)  # verifying is free: every tree drafted
    measured = steps - 2
    assert measured > 5
    assert counts["tolist"] == measured, counts
    assert 0 < counts["numpy"] <= measured, counts  # parent, depth, mask and tokens of a drafted tree: one read
    assert not sized.counts, sized.counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_logprobs_ride_along_with_the_tokens_bit_for_bit(dtype):
    from specpipe.decode.pipeline import Pipeline

    ints = torch.tensor([[5, -1, 2**40], [0, 7, -3]])
    floats = torch.tensor([[-0.0, -1e-30, float("-inf")], [-123.456, -3.4e38, 1.5]], dtype=dtype)
    rows, values = Pipeline.read_back(ints, floats)
    assert rows == ints.tolist()
    assert torch.equal(torch.tensor(values, dtype=dtype).view(torch.int64 if dtype == torch.float64 else torch.int32),
                       floats.view(torch.int64 if dtype == torch.float64 else torch.int32))
    assert Pipeline.read_back(ints) == (ints.tolist(), None)


@pytest.mark.parametrize("page_size", [4, 16])
def test_paged_commit_frees_pages_without_unique(monkeypatch, page_size):
    """torch.unique's output size depends on the data: on an accelerator it reads the device back. A verify
    round's commit frees the rejected tree's whole pages, which the host already knows are distinct."""
    import specpipe.allocators.paged as paged

    calls, in_step = [0], [False]
    real_unique = torch.unique

    def unique(*a, **k):
        calls[0] += in_step[0]
        return real_unique(*a, **k)
    monkeypatch.setattr(paged.torch, "unique", unique)
    steps = run_steady(monkeypatch, in_step, "draft.topk=4", "draft.num_steps=3", "allocator=paged",
                       f"allocator.page_size={page_size}")
    assert steps > 7 and calls[0] == 0
