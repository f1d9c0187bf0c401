"""The CUDA path on a real GPU (marker `cuda`; skipped where torch sees none): CUDA graph capture and replay, the
compiled Triton allocator kernels, every compile preset with no recompiles after warm-up, greedy output equal to
eager, device.index, event model timing and GPU memory in metrics.json. `scripts/gpu_check.sh` runs these first.

Greedy comparisons run in float64: a different kernel choice (a graph's padded batch, a compiled GEMM) moves float32
logits by an ulp, which can flip an argmax tie in a random model and fork the outputs without anything being wrong.
"""
import random

import pytest
import torch

from helpers import compose
from pipeline_spy import run_watched

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none)")]

LENGTHS = [3, 17, 5, 40, 9, 26, 2, 33, 12, 7]  # prompt lengths: prefill shapes differ per join
BUDGETS = [30, 75, 42, 90, 24, 60, 36, 84, 48, 27]  # max_new_tokens: requests finish at different steps
WARMUP_STEPS = 3
PRESETS = ["eager", "split", "whole", "auto", "graph", "rounds", "rounds_cpp"]


def cuda_cfg(path, *overrides):
    return compose("device=cuda", "device.dtype=float64", "model=random_tiny", f"workload.prompts_file={path}",
                   "workload.batch_size=4", f"workload.max_new_tokens={max(BUDGETS)}", *overrides)


@pytest.fixture(scope="module")
def varied_prompts(tmp_path_factory):
    from helpers import write_prompts

    rng = random.Random(0)
    path = tmp_path_factory.mktemp("cuda") / "prompts.jsonl"
    return write_prompts(path, ["".join(rng.choice("abcdefgh ij=():\n") for _ in range(n)) for n in LENGTHS])


EAGER: dict = {}  # draft -> the eager run's outputs (one run per draft for every preset compared with it)


def test_graph_capture_padded_over_listed_sizes_equals_eager_on_the_gpu():
    """A target forward CUDA-graphed over batch sizes [1, 2, 4] and context buckets [16, 32], replayed for batches
    of 3 and 2 (padded to 4 and 2), equals the eager forward; the null slot stays zero."""
    from test_graph_capture import verify_inputs

    from specpipe.devices.graphs import GraphBranch
    from specpipe.models.random_tiny import build_random_tiny
    from specpipe.stages.verify import Verify

    dev = torch.device("cuda", torch.cuda.current_device())
    target = build_random_tiny(seed=0, dtype="float64", max_position=64).target.to(dev)
    target.setup_kv(96)
    fwd = Verify(target, 1).target_forward
    graphed = GraphBranch(fwd, torch.cuda, "CUDAGraph", batch_sizes=[1, 2, 4], context_buckets=[16, 32])
    with torch.no_grad():
        for B, seed in ((3, 0), (2, 1), (3, 2), (1, 3)):
            tokens, batch = verify_inputs(B, 2, seed)
            batch = type(batch)(*(t.to(dev) for t in (batch.positions, batch.out_slots, batch.kv_slots, batch.mask,
                                                      batch.kv_positions)))
            want = fwd(tokens.to(dev), batch)
            got = graphed(tokens.to(dev), batch)
            for w, o in zip(want, got):
                torch.testing.assert_close(o, w, rtol=1e-9, atol=1e-9)
    assert len(graphed.captures) == 3  # 1, 2 and 4, all on the first call
    assert all(not k[0].any() for k in target.kv.keys)


@pytest.mark.parametrize("ps", [1, 16])
def test_compiled_triton_kernels_equal_the_reference_with_one_compilation(ps):
    """Compiled (not interpreted) Triton allocation kernels against the pure-Python reference, over batch sizes
    1..300: each kernel compiles once per page size, not once per batch bucket."""
    from specpipe.allocators import kernels_triton
    from specpipe.allocators.reference import count_new_pages, ref_alloc_decode, ref_alloc_extend

    def t(xs):
        return torch.tensor(list(xs), dtype=torch.int64, device="cuda")

    rng = random.Random(ps)
    for bs in (1, 2, 3, 7, 8, 33, 130, 300):
        pre = [rng.randrange(4 * ps) for _ in range(bs)]
        seq = [p + rng.randrange(1, 3 * ps + 2) for p in pre]
        last = [-1 if p == 0 else (100_000 + i) * ps + (p - 1) % ps for i, p in enumerate(pre)]
        n = count_new_pages(pre, seq, ps)
        free = rng.sample(range(1, 100_000), n + 2)
        exp, _ = ref_alloc_extend(pre, seq, last, free, ps)
        assert kernels_triton.alloc_extend(t(pre), t(seq), t(last), t(free), ps, n, len(exp)).tolist() == exp
        lens = [s + 1 for s in seq]
        dlast = [(100_000 + i) * ps + (s - 1) % ps for i, s in enumerate(seq)]
        m = sum((s - 1) % ps == 0 for s in lens)
        exp, _ = ref_alloc_decode(lens, dlast, free[:m + 1], ps)
        assert kernels_triton.alloc_decode(t(lens), t(dlast), t(free[:m + 1]), ps, m).tolist() == exp
    for kernel in kernels_triton._kernels():
        caches = getattr(kernel, "device_caches", None)
        if caches is None:
            pytest.skip("this Triton keeps no device_caches to count compilations in")
        compiled = sum(len(c[0]) for c in caches.values())
        assert compiled <= 2 * len({1, 16}), f"{compiled} compilations"  # (free_ptr alignment is not specialized)


@pytest.mark.parametrize("preset", PRESETS)
def test_every_compile_preset_compiles_nothing_after_warmup(preset, varied_prompts, monkeypatch):
    seen = run_watched(monkeypatch, cuda_cfg(varied_prompts, f"compile={preset}"), BUDGETS)
    sizes, graphs = seen["sizes"], seen["graphs"]
    assert all(r.finish_reason == "length" for r in seen["requests"])
    assert {1, 2, 3, 4} <= set(sizes[WARMUP_STEPS:])
    new = graphs[-1] - graphs[WARMUP_STEPS - 1]
    assert new == 0, f"compile={preset}: {new} graph(s) compiled after warm-up; batch sizes per step: {sizes}"
    assert seen["metrics"]["recompile_limit_hits"] == 0


@pytest.mark.parametrize("preset", ["graph", "auto", "rounds", "rounds_cpp"])
@pytest.mark.parametrize("draft", ["eagle", "none"])
def test_greedy_output_equals_eager(preset, draft, varied_prompts):
    from specpipe.run import run

    def outputs(*o):
        return [r.output_ids for r in run(cuda_cfg(varied_prompts, f"draft={draft}", *o), quiet=True)["requests"]]

    if draft not in EAGER:
        EAGER[draft] = outputs("compile=eager")
    assert outputs(f"compile={preset}") == EAGER[draft]


def test_device_index_selects_the_gpu():
    from specpipe.run import run

    if torch.cuda.device_count() < 2:
        pytest.skip("one GPU: device.index=1 needs two")
    before = torch.cuda.current_device()
    try:
        out = run(compose("device=cuda", "device.index=1", "model=random_tiny", "compile=graph",
                          "allocator=paged", "workload.max_new_tokens=8"), quiet=True)
        assert torch.cuda.current_device() == 1 and out["metrics"]["device_memory"]["peak_allocated_bytes"] > 0
    finally:
        torch.cuda.set_device(before)


def test_model_timing_does_not_synchronize_per_forward_and_memory_is_reported(varied_prompts, monkeypatch):
    from specpipe.run import run

    syncs = []
    real = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: syncs.append(1) or real(*a))
    m = run(cuda_cfg(varied_prompts), quiet=True)["metrics"]
    assert m["num_verify_steps"] > 20 and len(syncs) < m["num_verify_steps"]  # not one (or two) per forward
    assert m["stage_model_ms"] and sum(m["stage_model_ms"].values()) > 0  # the events were read
    mem = m["device_memory"]
    assert 0 < mem["peak_allocated_bytes"] <= mem["total_bytes"] and mem["reserved_bytes"] >= mem["allocated_bytes"]
