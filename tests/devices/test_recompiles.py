"""After warm-up, a compiled pipeline compiles nothing new while requests finish and join.

The causes this guards against (measurements.md): batch 1 getting its own graph (0/1
specialization), B == topk at the first call tying the two sizes (duck sizing), and the eager
draft forward's reshaped outputs being views whose base sizes Dynamo guards as well (the fixes:
devices/base.py BatchGeneric).
"""
import random

import pytest

from helpers import compose
from pipeline_spy import run_watched

LENGTHS = [3, 17, 5, 40, 9, 26, 2, 33, 12, 7]  # prompt lengths: prefill shapes differ per join
BUDGETS = [30, 75, 42, 90, 24, 60, 36, 84, 48, 27]  # max_new_tokens: requests finish at different steps
WARMUP_STEPS = 3
AOT = "'compile(dynamic=true, backend=aot_eager)'"  # same Dynamo guards as inductor, ~10x cheaper to compile
# model forwards: fullgraph, so a graph break (the metrics' timer hooks, unrelated unbacked batch sizes
# that attention cannot broadcast together) fails the run instead of silently splitting the model per layer
AOT_FULL = "'compile(dynamic=true, fullgraph=true, backend=aot_eager)'"


@pytest.mark.parametrize("overrides", [
    ["compile=split"],  # the preset itself, inductor
    ["compile=whole", f"compile.draft_topk.later={AOT}"],  # fused: one graph per step kind (0, 1, >= 2)
    ["compile=split", f"compile.draft_topk.later={AOT}", "draft.topk=1", "draft.num_draft_tokens=4"],  # K == 1
    [f"compile.verify.target_forward={AOT_FULL}", f"compile.draft_forward.decode={AOT_FULL}",
     f"compile.draft_forward.extend={AOT_FULL}"],  # model forwards (extend: packed prefills take the padded form)
    ["draft=standalone", "draft.topk=2", "draft.num_steps=3", "draft.num_draft_tokens=6",
     f"compile.standalone_draft.root_logits={AOT_FULL}", f"compile.standalone_draft.decode_logits={AOT_FULL}",
     f"compile.standalone_draft.extend={AOT_FULL}", f"compile.draft_topk.later={AOT}"],  # its own model forwards
    ["draft=none", f"compile.verify.target_forward={AOT_FULL}"],  # the plain baseline's one forward per step
    [f"compile.draft_loop.steps={AOT_FULL}", f"compile.draft_forward.extend={AOT_FULL}",
     f"compile.verify.round={AOT_FULL}"],  # an EAGLE round's draft steps and its verify, one graph each
    [f"compile.draft_loop.steps={AOT_FULL}", "allocator=paged", "allocator.page_size=4", "draft.topk=2",
     "draft.num_steps=3", "draft.num_draft_tokens=6"],  # ... in page-aligned regions (whose size varies per round)
], ids=["split", "whole-aot_eager", "split-topk1-aot_eager", "model-forwards-aot_eager", "standalone-aot_eager",
        "plain-aot_eager", "draft-loop-aot_eager", "draft-loop-paged-aot_eager"])
def test_compiled_topk_compiles_nothing_after_warmup(overrides, prompts_file, monkeypatch):
    rng = random.Random(0)
    path = prompts_file(["".join(rng.choice("abcdefgh ij=():\n") for _ in range(n)) for n in LENGTHS])
    cfg = compose("model=random_tiny", f"workload.prompts_file={path}", "workload.batch_size=4",
                  f"workload.max_new_tokens={max(BUDGETS)}", "speculation=static", *overrides)  # (cost: below)
    seen = run_watched(monkeypatch, cfg, BUDGETS)
    sizes, graphs = seen["sizes"], seen["graphs"]
    assert all(r.finish_reason == "length" for r in seen["requests"])
    assert graphs[WARMUP_STEPS - 1] > seen["graphs_before"], "the draft top-k branch is compiled during warm-up"
    after = sizes[WARMUP_STEPS:]
    assert len(after) >= 50
    assert {1, 2, 3, 4} <= set(after), f"batch composition did not vary enough: {sorted(set(after))}"
    new = graphs[-1] - graphs[WARMUP_STEPS - 1]
    assert new == 0, f"{new} graph(s) compiled after warm-up; batch sizes per step: {sizes}"


@pytest.mark.parametrize("draft", [["draft=ngram"], ["draft.topk=2", "draft.num_steps=3", "draft.num_draft_tokens=6"]],
                         ids=["ngram", "eagle"])
def test_a_compiled_verify_under_cost_compiles_every_width_during_warmup(draft, prompts_file, monkeypatch):
    """speculation=cost (the default) widens the verify as drafts start to pay, so a compiled verify first met a
    width mid-run: a graph compiled then, and that step's compile time, learned as the width's cost, kept the width
    from ever being chosen again. The first steps now visit each bucket width, and a compiling step teaches the
    cost curve nothing."""
    import torch._dynamo

    rng = random.Random(0)
    path = prompts_file(["".join(rng.choice("abcdefgh ij=():\n") for _ in range(n)) for n in LENGTHS])
    base = ["model=random_tiny", f"workload.prompts_file={path}", "workload.batch_size=4",
            f"workload.max_new_tokens={max(BUDGETS)}", "speculation=cost", *draft]
    torch._dynamo.reset()  # (graphs another test compiled for this forward would serve its first widths)
    eager = run_watched(monkeypatch, compose(*base), BUDGETS)
    seen = run_watched(monkeypatch, compose(*base, f"compile.verify.target_forward={AOT_FULL}"), BUDGETS)
    assert [r.output_ids for r in seen["requests"]] == [r.output_ids for r in eager["requests"]]
    policy = seen["pipe"].policy
    warmup = len(policy.buckets)
    assert set(policy.widths) == set(policy.buckets)
    graphs = seen["graphs"]
    assert graphs[warmup - 1] > seen["graphs_before"] and graphs[-1] == graphs[warmup - 1], graphs
    costs = [ms for row in policy.cost_curve().values() for ms in row.values()]
    assert max(costs) < 20 * min(costs), policy.cost_curve()  # no compile time (~1 s) among the ~ms steps


def test_compiled_draft_extend_decodes_like_eager(prompts_file):
    """A compiled draft extend over a join of prompts of different lengths (which eager runs packed, as one row
    of segments with one newest position per prompt: inputs of two batch sizes, which crashed Dynamo's shared
    batch symbol) gives the eager run's tokens."""
    from specpipe.run import run

    rng = random.Random(1)
    path = prompts_file(["".join(rng.choice("abcdefgh ij=():\n") for _ in range(n)) for n in LENGTHS[:6]])
    base = ["model=random_tiny", "device.dtype=float64", f"workload.prompts_file={path}", "workload.batch_size=3",
            "workload.max_new_tokens=12"]
    eager = run(compose(*base), quiet=True)["requests"]
    compiled = run(compose(*base, f"compile.draft_forward.extend={AOT_FULL}"), quiet=True)["requests"]
    assert [r.output_ids for r in compiled] == [r.output_ids for r in eager]
    assert all(r.finish_reason == "length" for r in compiled)
    # the plain word, inductor: automatic dynamic shapes made its codegen fail ("name 's27' is not defined")
    inductor = run(compose(*base, "compile.draft_forward.extend=compile"), quiet=True)["requests"]
    assert [r.output_ids for r in inductor] == [r.output_ids for r in eager]


def test_a_compiled_standalone_draft_decodes_like_eager_and_names_no_unapplied_policy(prompts_file, capsys):
    """draft=standalone's own model forwards had no policy keys: compile.standalone_draft.* was a config error."""
    from specpipe.run import run

    rng = random.Random(2)
    path = prompts_file(["".join(rng.choice("abcdefgh ij=():\n") for _ in range(n)) for n in LENGTHS[:5]])
    base = ["model=random_tiny", "device.dtype=float64", f"workload.prompts_file={path}", "workload.batch_size=3",
            "workload.max_new_tokens=10", "draft=standalone", "draft.topk=2", "draft.num_steps=3",
            "draft.num_draft_tokens=5"]
    eager = run(compose(*base), quiet=True)["requests"]
    out = run(compose(*base, *(f"compile.standalone_draft.{b}={AOT_FULL}"
                               for b in ("root_logits", "decode_logits", "extend"))), quiet=True)
    assert [r.output_ids for r in out["requests"]] == [r.output_ids for r in eager]
    assert out["metrics"]["recompiles"] >= 3 and "unapplied_compile_policies" not in out["metrics"]
    assert "compiles nothing" not in capsys.readouterr().err


def test_a_compiled_model_forward_is_reused_by_later_api_calls():
    """The model timer's hooks were registered afresh for every run, and a compiled branch that calls the model
    guards on its hook dicts: every generate() call (and in-process sweep job) recompiled each compiled model
    forward, and after Dynamo's recompile limit of 8 the branch quietly ran eager."""
    import torch._dynamo

    from specpipe import SpecPipe

    torch._dynamo.reset()  # graphs another test compiled for these forwards would serve the first call too
    sp = SpecPipe("model=random_tiny", "device.num_threads=1",  # weight_layout=auto: decided once per loaded model
                  f"compile.verify.target_forward={AOT}", f"compile.draft_forward.decode={AOT}")
    first = sp.generate(["def f(x):", "abc"], max_new_tokens=6, seed=0)
    assert sp.metrics["recompiles"] >= 1
    for _ in range(3):
        again = sp.generate(["def f(x):", "abc"], max_new_tokens=6, seed=0)
        assert sp.metrics["recompiles"] == 0 and [c.output_ids for c in again] == [c.output_ids for c in first]


def test_a_compiled_forward_keeps_its_weight_layout_when_a_later_call_favours_the_other(monkeypatch):
    """weight_layout=auto chose per run from the row counts: a later call with another verify width flipped
    weights to the other layout under the compiled forward, which recompiled it (in every sweep job that flipped)."""
    from specpipe import SpecPipe
    from specpipe.devices import weight_layout

    def measure(shape, rows, timer=None, layouts=("row", "column")):  # column for verifies of 2 requests, row for
        fast = "column" if rows <= 2 * 8 else "row"  # wider ones: a flip (oneDNN-packed never wins here)
        return {lay: 1.0 if lay == fast else 2.0 for lay in layouts}
    monkeypatch.setattr(weight_layout, "measure", measure)
    monkeypatch.setattr(weight_layout, "_MEASURED", {})
    sp = SpecPipe("model=random_tiny", "device.num_threads=1", "model.seed=21",  # models no other test laid out
                  f"compile.verify.target_forward={AOT}")
    sp.generate(["def f(x):", "abc"], max_new_tokens=4, seed=0)  # 2 x 8 verify rows: column
    assert all(e["layout"] == "column" for e in sp.metrics["weight_layout"].values())
    sp.generate(["def f(x):", "abc", "xyz", "a = 1"], max_new_tokens=4, seed=0)  # 4 x 8 would favour row
    assert all(e["layout"] == "column" and e["kept"] for e in sp.metrics["weight_layout"].values())
    assert sp.metrics["recompiles"] == 0


def test_a_plain_compile_of_a_model_forward_serves_other_lengths_without_recompiling():
    """`compile` without options on a model forward: automatic dynamic shapes specialized its prompt lengths, mask
    widths and KV pool size, so later calls with other prompts recompiled (and inductor failed outright on the
    draft extend). Model forwards default to dynamic=True."""
    from specpipe import SpecPipe

    rng = random.Random(0)
    text = lambda n: "".join(rng.choice("abcdefgh ij=():\n") for _ in range(n))  # noqa: E731
    plain = "'compile(backend=aot_eager)'"
    calls = [([text(n) for n in (5, 9, 30, 12, 7, 3)], 24), ([text(n) for n in (120, 4, 60)], 40),
             ([text(n) for n in (2, 3, 90, 45, 17, 33, 8)], 30)]
    # weight_layout=auto (the default) decides once per loaded model: the later calls' other verify row counts
    # must not flip a weight's strides under the compiled forward
    base = ("model=random_tiny", "device.num_threads=1", "workload.batch_size=4")
    eager = SpecPipe(*base)  # (the same model)
    want = [[c.output_ids for c in eager.generate(p, max_new_tokens=n, seed=0)] for p, n in calls]
    sp = SpecPipe(*base,
                  f"compile.verify.target_forward={plain}", f"compile.draft_forward.decode={plain}")
    for i, (prompts, new) in enumerate(calls):
        assert [c.output_ids for c in sp.generate(prompts, max_new_tokens=new, seed=0)] == want[i]
        if i:
            assert sp.metrics["recompiles"] == 0, (i, sp.metrics["recompiles"])


def test_a_compiled_draft_extend_with_sliding_window_layers_does_not_recompile_per_prompt_length(prompts_file):
    """A head with sliding-window layers prefills with banded attention, which loops over the prompt's length: a
    compiled extend specialized it and recompiled for each new length (then ran eager past Dynamo's limit). The
    prompt's prefill runs eagerly; the compiled extend serves the decode rounds."""
    from specpipe.run import run

    rng = random.Random(2)
    path = prompts_file(["".join(rng.choice("abcdefgh ij=():\n") for _ in range(n)) for n in LENGTHS])
    base = ["model=random_tiny", "model.sliding_window=8", "allocator=swa", "allocator.window=8",
            f"workload.prompts_file={path}", "workload.batch_size=3", "workload.max_new_tokens=10",
            "model_timing=false"]
    eager = run(compose(*base), quiet=True)["requests"]
    out = run(compose(*base, f"compile.draft_forward.extend={AOT}"), quiet=True)
    assert [r.output_ids for r in out["requests"]] == [r.output_ids for r in eager]
    assert out["metrics"]["recompiles"] <= 2, out["metrics"]["recompiles"]


@pytest.mark.parametrize("window", [None, 8])
def test_a_sliding_window_heads_draft_decode_compiles(prompts_file, window):
    """Inductor's code for a sliding-window head's draft decode failed at its first call (NameError: name 's27'
    is not defined), so such a head decoded eagerly: the attention now tells the compiler that its output slots and
    queries have one length, and the windowed decode compiles as the dense one does."""
    from specpipe.run import run

    path = prompts_file(["def f(x):", "class A:\n    pass"])
    base = ["model=random_tiny", *([f"model.sliding_window={window}"] if window else []), "compile=eager",
            f"workload.prompts_file={path}", "workload.max_new_tokens=8", "model_timing=false"]
    eager = run(compose(*base), quiet=True)["requests"]
    out = run(compose(*base, f"compile.draft_forward.decode={AOT}"), quiet=True)
    assert [r.output_ids for r in out["requests"]] == [r.output_ids for r in eager]
    assert 0 < out["metrics"]["recompiles"] <= 2, out["metrics"]["recompiles"]


def test_a_branch_past_dynamos_recompile_limit_is_reported(prompts_file):
    """Past its recompile limit Dynamo runs a branch eager and compiles nothing more, so `recompiles` alone read as
    if all were well; recompile_limit_hits counts it (the fused top-k needs a graph per step kind, 3 > 1 here)."""
    import torch._dynamo

    from specpipe.run import run

    torch._dynamo.reset()
    path = prompts_file(["abc de=()\n" * 2, "x = (a"])
    base = ["model=random_tiny", f"workload.prompts_file={path}", "workload.max_new_tokens=8"]
    with torch._dynamo.config.patch(recompile_limit=1):  # (pytest's monkeypatch deletes a config key on undo)
        m = run(compose(*base, "compile=whole", f"compile.draft_topk.later={AOT}"), quiet=True)["metrics"]
    assert m["recompile_limit_hits"] >= 1
    assert run(compose(*base), quiet=True)["metrics"]["recompile_limit_hits"] == 0
    torch._dynamo.reset()


def test_a_compiled_draft_extend_at_batch_1_does_not_recompile_when_the_context_outgrows_head_dim(prompts_file,
                                                                                                 monkeypatch):
    """random_tiny's head_dim is 16, as was the mask width of the first decode round: duck sizing gave both one
    symbol, index_copy_ into the head_dim pinned it, and the extend recompiled once the context passed 16 tokens
    (a mask 32 wide). Real models meet it when a width bucket equals their head_dim (64, 128)."""
    path = prompts_file(["def f(x):", "import os\nimport sys\n\nclass Foo:\n    def __init__(self, a, b):\n",
                         "x = 1", "for i in range(10):\n    print(i)\n", "# a longer comment line\nreturn"])
    cfg = compose("model=random_tiny", f"workload.prompts_file={path}", "workload.batch_size=1",
                  "workload.max_new_tokens=24", f"compile.draft_forward.extend={AOT_FULL}")
    import torch._dynamo

    torch._dynamo.reset()  # the extend's graphs other tests of this worker compiled count toward the recompile limit
    seen = run_watched(monkeypatch, cfg)
    graphs = seen["graphs"]
    assert graphs[WARMUP_STEPS - 1] > seen["graphs_before"]
    assert graphs[-1] == graphs[WARMUP_STEPS - 1], f"graph count per step: {graphs}"


@pytest.mark.parametrize("allocator", ["token", "swa"])
def test_a_compiled_target_forward_serves_sliding_window_layers(prompts_file, allocator):
    """With inductor, a compiled target forward of a model with sliding-window layers failed at its first verify
    (NameError: name 's59' is not defined: a guard on the batch's out_slots length, a symbol inductor never bound)."""
    from specpipe.run import run

    path = prompts_file(["def f(x):\n    return x", "class A:"])
    base = ["model=random_tiny", "model.sliding_window=8", f"allocator={allocator}", "compile=eager",
            f"workload.prompts_file={path}", "workload.max_new_tokens=10", "model_timing=false"]
    eager = run(compose(*base), quiet=True)["requests"]
    out = run(compose(*base, "compile.verify.target_forward=compile"), quiet=True)
    assert [r.output_ids for r in out["requests"]] == [r.output_ids for r in eager]
    assert out["metrics"]["recompiles"] >= 1 and out["metrics"]["num_errors"] == 0


@pytest.mark.parametrize("overrides", [
    ["draft=none", f"compile.verify.target_forward={AOT_FULL}", f"compile.prefill.target_forward={AOT_FULL}"],
    ["draft=eagle", "draft.topk=1", "draft.num_steps=2", f"compile.draft_loop.steps={AOT_FULL}",
     f"compile.verify.round={AOT_FULL}", f"compile.prefill.target_forward={AOT_FULL}"],
], ids=["plain", "eagle-round"])
def test_a_compiled_model_forward_takes_the_models_floats_as_constants(overrides, prompts_file, monkeypatch):
    """RMSNorm eps and the RoPE scale are fixed per model. Left unspecialized, Dynamo passed each float as a fresh
    0-d tensor on every call and re-checked some in Python guards: ~65 µs per call of the shipped 10-layer target
    (scripts/bench_compile_overhead.py). As constants they are checked by value in Dynamo's C++ guards."""
    import torch
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from specpipe.devices.base import BatchGeneric

    torch._dynamo.reset()
    path = prompts_file(["tell me a story about x = (1, 2)"])  # one prompt: a packed prefill of several runs eager
    cfg = compose("model=random_tiny", f"workload.prompts_file={path}", "workload.max_new_tokens=12", *overrides)
    seen = run_watched(monkeypatch, cfg)
    assert all(len(r.output_ids) == 12 for r in seen["requests"])
    branches = [(f"{st.name}.{b}", getattr(st, b)) for st in seen["pipe"].stages for b in st.branch_names()]
    branches = [(name, getattr(fn, "__wrapped__", fn)) for name, fn in branches]  # under the metrics' timer
    compiled = [(name, fn.fn) for name, fn in branches if isinstance(fn, BatchGeneric)]
    entries = {name: _debug_get_cache_entry_list(fn.__func__.__code__) for name, fn in compiled}
    assert sum(map(bool, entries.values())) >= 2, f"compiled branches that ran: {entries}"
    parts = [p for es in entries.values() for e in es for p in e.guard_manager.code_parts]
    floats = [p for p in parts if p.startswith("___check_type_id(") and "type=<class 'float'>" in p]  # an input
    assert floats == [], f"{len(floats)} float(s) left unspecialized, e.g. {floats[0]}"
    assert any(".eps == " in p for p in parts), "RMSNorm eps is a constant of the graph, checked by value"
