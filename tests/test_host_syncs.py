"""The decode hot path reads back from the device once per step (the committed tokens), nothing else.

Explicit device->host reads are counted by wrapping Tensor.item/tolist/cpu/numpy/__bool__ while
steady-state steps run; the allocator gets page counts from host integers (num_new_pages), so it
never needs to read a device tensor either.
"""
from collections import Counter

import pytest
import torch

from helpers import compose
from specpipe.app import run
from specpipe.runner import run_requests

READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


def run_steady(monkeypatch, in_step: list, *overrides) -> int:
    """Decode a small workload with `in_step[0]` True inside each decode step after two warm-up steps;
    the number of steps run."""
    steps = [0]

    def spy(run_requests_fn):
        def inner(pipe, reqs, batch_size, show_progress=None, **kw):
            cls = type(pipe)
            real = cls.step

            def counted(self):
                steps[0] += 1
                in_step[0] = steps[0] > 2  # after warm-up
                try:
                    return real(self)
                finally:
                    in_step[0] = False
            monkeypatch.setattr(cls, "step", counted)
            return run_requests_fn(pipe, reqs, batch_size, show_progress, **kw)
        return inner

    monkeypatch.setattr("specpipe.app.run_requests", spy(run_requests))
    run(compose("model=random_tiny", "workload.num_prompts=2", "workload.batch_size=2", "workload.max_new_tokens=40",
                *overrides), quiet=True)
    return steps[0]


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
])
def test_one_host_read_per_step(monkeypatch, overrides):
    counts, in_step = Counter(), [False]
    for name in READS:
        orig = getattr(torch.Tensor, name)

        def wrapped(self, *a, _orig=orig, _name=name, **k):
            if in_step[0]:
                counts[_name] += 1
            return _orig(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, wrapped)
    steps = run_steady(monkeypatch, in_step, *overrides)
    measured = steps - 2
    assert measured > 5
    assert counts["tolist"] == measured, counts  # the commit's single read per step
    assert sum(v for k, v in counts.items() if k != "tolist") == 0, counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_logprobs_ride_along_with_the_tokens_bit_for_bit(dtype):
    from specpipe.pipeline import Pipeline

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
