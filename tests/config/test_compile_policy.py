"""The policy language: valid forms, every parse error (caret under the bad token, valid words
listed), per-device checks at validation time, and the presets in conf/compile/."""
from pathlib import Path

import pytest

from helpers import compose
from specpipe.cli.precheck import precheck
from specpipe.config.compile_policy import DEVICE_SUPPORT, BranchPolicy, PolicyError, device_problem, parse_policy
from specpipe.errors import ConfigError
from specpipe.config.validate import validate

PRESETS = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "conf" / "compile").glob("*.yaml"))


@pytest.mark.parametrize("text, mode, options", [
    ("eager", "eager", {}),
    ("compile", "compile", {}),
    ("compile()", "compile", {}),
    ("graph", "graph", {}),
    ("auto", "auto", {}),
    ("  compile ( dynamic = False ) ", "compile", {"dynamic": False}),
    ("compile(dynamic=false, fullgraph=true, mode=max-autotune-no-cudagraphs)", "compile",
     {"dynamic": False, "fullgraph": True, "mode": "max-autotune-no-cudagraphs"}),
    ("compile(dynamic=none, backend=aot_eager)", "compile", {"dynamic": None, "backend": "aot_eager"}),
    ("compile(dynamic=null)", "compile", {"dynamic": None}),
    ("auto(dynamic=true)", "auto", {"dynamic": True}),
    ("compile(cpp_wrapper=true, dynamic=true)", "compile", {"cpp_wrapper": True, "dynamic": True}),
])
def test_valid_policies(text, mode, options):
    p = parse_policy(text)
    assert (p.mode, p.kwargs) == (mode, options)
    assert parse_policy(str(p)) == p  # str() writes the canonical form back


def test_policy_str_is_canonical():
    p = BranchPolicy("compile", (("dynamic", False), ("mode", "default")))
    assert str(p) == "compile(dynamic=false, mode=default)"
    assert str(parse_policy("compile(mode=max-autotune, dynamic=none)")) == "compile(dynamic=none, mode=max-autotune)"


@pytest.mark.parametrize("text, bad, words", [
    ("compil", "compil", ["unknown mode 'compil'", "valid: eager, compile, graph, auto", "did you mean 'compile'"]),
    ("Eager", "Eager", ["unknown mode 'Eager'"]),
    ("", " ", ["empty policy", "valid: eager"]),
    ("(dynamic=true)", "(", ["unknown mode '('"]),
    ("eager(dynamic=true)", "(dynamic=true)", ["'eager' takes no options", "only compile and auto"]),
    ("graph()", "()", ["'graph' takes no options"]),
    ("compile(dynamc=true)", "dynamc", ["unknown option 'dynamc'", "valid keys: dynamic, fullgraph, mode, backend",
                                        "did you mean 'dynamic'"]),
    ("compile(dynamic)", ")", ["expected '=' after 'dynamic'"]),
    ("compile(dynamic=)", ")", ["')' is not a valid value for dynamic", "valid: true, false, none"]),
    ("compile(dynamic=maybe)", "maybe", ["'maybe' is not a valid value for dynamic", "valid: true, false, none"]),
    ("compile(fullgraph=none)", "none", ["'none' is not a valid value for fullgraph", "valid: true, false"]),
    ("compile(mode=fast)", "fast", ["'fast' is not a valid value for mode", "max-autotune-no-cudagraphs"]),
    ("compile(backend=tvm)", "tvm", ["'tvm' is not a valid value for backend", "valid: inductor, aot_eager, eager"]),
    ("compile(dynamic=1)", "1", ["'1' is not a valid value for dynamic"]),
    ("compile(dynamic=true, dynamic=false)", "dynamic", ["option 'dynamic' is given twice"]),
    ("compile(dynamic=true fullgraph=true)", "fullgraph", ["expected ',' or ')' after dynamic=true"]),
    ("compile(dynamic=true", " ", ["found the end of the text"]),
    ("compile(,)", ",", ["unknown option ','"]),
    ("compile(dynamic=true))", ")", ["unexpected ')' after 'compile(dynamic=true)'"]),
    ("eager eager", "eager", ["unexpected 'eager' after 'eager'"]),
    ("compile;", ";", ["unexpected ';' after 'compile'"]),
    ("123", "123", ["unknown mode '123'"]),  # named whole, not by its first digit
    ("compile(dynamic=12)", "12", ["'12' is not a valid value for dynamic"]),
    ("compile(backend=aot_eager, mode=max-autotune)", "mode", ["mode=max-autotune is an inductor setting, which "
                                                               "backend=aot_eager ignores"]),  # torch only warned
    ("compile(backend=eager, cpp_wrapper=true)", "cpp_wrapper", ["cpp_wrapper=true is an inductor setting, which "
                                                                 "backend=eager ignores", "drop cpp_wrapper"]),
])
def test_parse_errors_point_at_the_bad_token(text, bad, words):
    with pytest.raises(PolicyError) as e:
        parse_policy(text)
    msg, err = str(e.value), e.value
    assert all(w in msg for w in words), msg
    shown, caret = msg.splitlines()[-2:]
    assert shown == "    " + err.text
    start = caret.index("^")
    assert (err.text + " ")[start - 4: start - 4 + len(bad)] == bad, msg  # carets sit under the bad token


def test_non_string_policy():
    with pytest.raises(PolicyError, match="is not a policy string"):
        parse_policy(3)


@pytest.mark.parametrize("device, text, ok", [
    ("cpu", "graph", False), ("cpu", "compile(mode=reduce-overhead)", False), ("cpu", "auto", True),
    ("cpu", "compile(mode=max-autotune)", True), ("cuda", "graph", True),
    ("cuda", "compile(mode=reduce-overhead)", True),
    ("npu", "graph", True), ("npu", "compile(backend=inductor)", False), ("npu", "compile(mode=max-autotune)", True),
])
def test_device_support_table(device, text, ok):
    assert (device_problem(parse_policy(text), device) is None) == ok
    assert set(DEVICE_SUPPORT) == {"cpu", "cuda", "npu"}


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("device", ["cpu", "cuda", "npu"])
def test_presets_validate_everywhere_but_graph_on_cpu(preset, device):
    cfg = compose(f"compile={preset}", f"device={device}")  # composing imports no backend
    if preset == "graph" and device == "cpu":
        with pytest.raises(ConfigError) as e:
            validate(cfg)
        msg = str(e.value)
        assert "device cpu cannot run 'graph'" in msg and "no graph capture" in msg and "device=cuda" in msg
        assert msg.count("cannot run") == 1 and "compile.draft_topk.later" in msg  # one error naming every branch
    else:
        validate(cfg)


def test_presets_exist():
    assert {"eager", "split", "whole", "auto", "graph", "rounds"} <= set(PRESETS)


def test_the_rounds_preset_runs_each_round_as_two_calls():
    """compile=rounds: with it a greedy EAGLE run's rounds take the one-call paths (drafting and verify), and its
    prefill and extend compile; nothing it sets goes unread for draft=eagle."""
    from specpipe.run import build_pipeline
    from specpipe.models.random_tiny import build_random_tiny

    cfg = compose("model=random_tiny", "compile=rounds")
    asked = {f"{st}.{b}" for st, branches in cfg.compile.items() for b, v in branches.items() if v == "compile"}
    assert {"verify.round", "draft_loop.steps", "prefill.target_forward", "draft_forward.extend"} <= asked
    from specpipe.allocators.token import TokenAllocator
    from specpipe.decode.metrics import Metrics
    from specpipe.devices.cpu import CpuDevice

    pipe = build_pipeline(cfg, CpuDevice(), build_random_tiny(), TokenAllocator(256), [], Metrics(cfg.draft.num_steps))
    assert pipe.fused_verify and pipe.proposer.one_call and not pipe.unapplied_policies
    assert {"steps"} <= pipe.proposer.loop.wrapped and {"target_forward"} <= pipe.prefill.wrapped


def test_bad_policy_fails_validation_with_the_key_and_caret():
    with pytest.raises(ConfigError) as e:
        validate(compose("compile.build_tree.build=compil"))
    assert "compile.build_tree.build='compil': unknown mode 'compil'" in str(e.value)
    assert str(e.value).rstrip().endswith("^^^^^^")


def test_unknown_branch_key_is_an_exit_2_error():
    msg = precheck(["compile.draft_topk.latr=eager"])
    assert msg.startswith("specpipe: invalid override") and "compile.draft_topk.latr" in msg
    assert "later" in msg and "first" in msg  # the valid keys there


def test_cli_policy_errors_and_graph_on_cpu_come_from_precheck():
    assert "unknown option 'dynamc'" in precheck(["compile.draft_topk.later='compile(dynamc=true)'"])
    assert "device cpu cannot run 'graph'" in precheck(["compile=graph"])
    assert precheck(["compile=graph", "device=cuda"]) is None


def test_a_policy_for_a_branch_the_run_does_not_have_is_named(capsys):
    """draft=none has no tree to verify and draft=ngram no draft top-k: their policies compiled nothing without a
    word."""
    from helpers import compose
    from specpipe.run import run

    base = ["model=random_tiny", "workload.num_prompts=2", "workload.max_new_tokens=3"]
    m = run(compose(*base, "draft=none", "compile.verify.greedy=compile"), quiet=True)["metrics"]
    assert m["unapplied_compile_policies"] == ["compile.verify.greedy=compile"]
    err = capsys.readouterr().err
    assert "no branch of this run (draft=none) reads it, so it compiles nothing" in err
    assert "the run's branches: prefill.target_forward, verify.target_forward)" in err
    m = run(compose(*base, "draft=ngram", "compile.draft_topk.later=eager", "compile.build_tree.build=eager"),
            quiet=True)["metrics"]
    assert "unapplied_compile_policies" not in m and "compiles nothing" not in capsys.readouterr().err
    run(compose(*base, "draft=ngram", "sampling.temperature=1.0", "compile.draft_topk.later=compile"), quiet=True)
    listed = capsys.readouterr().err.split("the run's branches: ")[1]
    assert "verify.target_forward" in listed and "verify_sampling" not in listed  # (no compile.* key sets those)


def test_a_compiled_plain_baseline_compiles_its_forward_and_decodes_like_eager():
    """draft=none's forward ran eager whatever compile.verify.target_forward said (named as unapplied), so a
    "compiled" baseline compared compiled speculation with an eager target. Now it is the step's target forward."""
    from helpers import compose
    from specpipe.run import run
    from specpipe.decode.metrics import recompile_count

    base = ["model=random_tiny", "device.dtype=float64", "workload.num_prompts=3", "workload.max_new_tokens=6",
            "draft=none"]
    eager = run(compose(*base), quiet=True)
    before = recompile_count()
    compiled = run(compose(*base, "compile.verify.target_forward='compile(backend=aot_eager)'"), quiet=True)
    assert recompile_count() > before and compiled["metrics"].get("unapplied_compile_policies") is None
    assert [r.output_ids for r in compiled["requests"]] == [r.output_ids for r in eager["requests"]]


@pytest.mark.parametrize("draft", ["eagle", "standalone"])
def test_compile_whole_fuses_the_draft_topk_of_every_model_drafter(draft):
    """compile=whole (compile.draft_topk.fused=true) compiles the top-k as one function; the standalone drafter
    ignored it and ran split's branches with no word."""
    from specpipe.run import build_proposer
    from specpipe.models.random_tiny import build_random_tiny

    pair = build_random_tiny()
    if draft == "standalone":
        from specpipe.models.cache import first_layer_copy

        pair.standalone = first_layer_copy(pair.target)
    for preset, fused in (("whole", True), ("split", False)):
        cfg = compose("model=random_tiny", f"draft={draft}", f"compile={preset}")
        proposer = build_proposer(cfg, pair, 2, 64, type("D", (), {"torch_device": "cpu"})())
        stage = proposer.topk_stage if draft == "eagle" else proposer.sd.topk_stage
        assert stage.fused_mode is fused, (draft, preset)


@pytest.mark.parametrize("draft", ["ngram", "none"])
def test_a_draft_path_the_drafter_does_not_read_is_named(draft, tmp_path, capsys):
    """draft=ngram / draft=none load no draft model: a draft.path given with them was dropped without a word."""
    from helpers import compose
    from specpipe.run import run

    base = ["model=random_tiny", "workload.num_prompts=1", "workload.max_new_tokens=2", f"draft={draft}"]
    run(compose(*base, f"draft.path={tmp_path}"), quiet=True)
    assert f"draft.path={tmp_path} is not read: draft={draft} uses no draft model" in capsys.readouterr().err
    run(compose(*base), quiet=True)
    assert "is not read" not in capsys.readouterr().err


def test_the_rounds_cpp_preset_is_rounds_with_the_cpp_wrapper():
    rounds, cpp = compose("compile=rounds"), compose("compile=rounds_cpp")
    assert cpp.compile.keys() == rounds.compile.keys()
    for stage, branches in rounds.compile.items():
        for b, v in branches.items():
            want = "compile(cpp_wrapper=true)" if v == "compile" else v
            assert cpp.compile[stage][b] == want, f"compile.{stage}.{b}"
            if v == "compile":
                assert parse_policy(cpp.compile[stage][b]).kwargs == {"cpp_wrapper": True}
