"""Compiled branches equal eager ones on the CPU: draft_topk (first, later, fused) and build_tree.build.

aot_eager runs the same Dynamo/AOTAutograd tracing as inductor at a tenth of the compile cost, so
it covers the shapes; one inductor case checks the generated C++ too. Batch sizes 1, 3 and 4
(with topk 4) and topk 1 go through the same compiled function, as in a serving run.
"""
import dataclasses

import pytest
import torch
from torch.utils._pytree import tree_flatten

from draft_inputs import draft_round, tree_inputs
from specpipe.config.compile_policy import parse_policy
from specpipe.devices.cpu import CpuDevice
from specpipe.decode.metrics import recompile_count
from specpipe.stages.build_tree import BuildTree
from specpipe.stages.draft_topk import DraftTopK

AOT = "compile(dynamic=true, backend=aot_eager)"


def binder(policies: dict):
    dev = CpuDevice()
    return lambda stage, branch, fn: dev.compile(fn, parse_policy(policies.get(branch, "eager")))


def assert_same(want, got):
    w, g = tree_flatten(want)[0], tree_flatten(got)[0]
    assert len(w) == len(g)
    for a, b in zip(w, g):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("policies, fused", [
    ({"first": AOT, "later": AOT}, False),
    ({"later": AOT}, True),  # `whole`: the fused function runs under the `later` policy
])
def test_draft_topk_compiled_equals_eager(policies, fused):
    for K in (4, 1):
        stage = DraftTopK(K, fused)
        stage.bind(binder(policies))
        for B in (4, 1, 3):
            assert_same(draft_round(DraftTopK(K), B, K, 32, 4, seed=B), draft_round(stage, B, K, 32, 4, seed=B))


def test_draft_topk_later_inductor_equals_eager_with_one_graph():
    stage = DraftTopK(4)
    stage.bind(binder({"later": "compile(dynamic=false)"}))
    before = recompile_count()
    for B in (4, 1, 3):
        assert_same(draft_round(DraftTopK(4), B, 4, 64, 3, seed=B), draft_round(stage, B, 4, 64, 3, seed=B))
    assert recompile_count() - before == 1  # batch 4, 1 and 3 share one graph (the batch dim is generic)


def test_build_tree_compiled_equals_eager():
    K, S, N = 4, 3, 8
    eager, comp = BuildTree(K, S, N), BuildTree(K, S, N)
    comp.bind(binder({"build": AOT}))
    for B in (4, 1, 3):
        args = tree_inputs(draft_round(DraftTopK(K), B, K, 16, S, seed=B), B, seed=B)
        assert_same(dataclasses.astuple(eager(*args)), dataclasses.astuple(comp(*args)))
