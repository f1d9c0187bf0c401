"""The command line as users type it: runs write both output files; mistakes exit 2 without a traceback."""
import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import default_sigint

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["model=random_tiny", "workload.num_prompts=3", "workload.max_new_tokens=12"]
NEEDS_NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="device=cuda is refused only without a GPU")


def specpipe(*args, cwd):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "specpipe", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("extra", [["draft.topk=1"], ["draft=none"], ["compile=split"]])
def test_run_writes_metrics_and_completions(tmp_path, extra):
    out = tmp_path / "run"
    p = specpipe(*SMALL, *extra, f"hydra.run.dir={out}", cwd=ROOT)
    assert p.returncode == 0, p.stderr
    m = json.loads((out / "metrics.json").read_text())
    for key in ("generated_tokens", "wall_s", "tokens_per_s", "accept_length_mean", "acceptance_rate_per_position",
                "num_verify_steps", "stage_host_ms", "recompiles", "config"):
        assert key in m
    assert len(m["acceptance_rate_per_position"]) == m["config"]["draft"]["num_steps"] or extra == ["draft=none"]
    lines = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
    assert [x["index"] for x in lines] == [0, 1, 2]
    assert all(len(x["output_ids"]) == 12 and x["finish_reason"] == "length" for x in lines)
    assert "tokens/s" in p.stdout


@pytest.mark.parametrize("args,fragment", [
    (["allocator=foo"], "has no option 'foo'"),
    (["draft.topk=abc"], "draft.topk"),
    (["draft.topk=2", "draft.num_steps=2", "draft.num_draft_tokens=30", "workload.batch_size=0"], "2 problems"),
    (["allocator._target_=os.system"], "refused"),
    pytest.param(["device=cuda"], "device=cuda cannot be used", marks=NEEDS_NO_CUDA),
    (["device=npu"], "device=npu cannot be used"),
    (["-sc"], "--shell-completion needs one of install=SHELL"),  # Hydra: ValueError traceback
    (["--shell-completion", "instal=bash"], "--shell-completion needs one of install=SHELL"),
])
def test_user_mistakes_exit_2_without_traceback(tmp_path, args, fragment):
    p = specpipe(*SMALL, *args, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert fragment in p.stderr
    assert "Traceback" not in p.stderr + p.stdout


def test_help_lists_every_group_option_and_no_schema_entries(tmp_path):
    p = specpipe("--help", cwd=tmp_path)
    assert p.returncode == 0 and "Traceback" not in p.stderr
    conf = ROOT / "conf"
    for group in (d for d in conf.iterdir() if d.is_dir() and d.name != "hydra"):
        line = next(x for x in p.stdout.splitlines() if x.strip().startswith(group.name + " "))
        assert sorted(o.strip().replace(" (default)", "") for o in line.split(None, 1)[1].split(",")
                      if "none by default" not in o) == sorted(f.stem for f in group.glob("*.yaml"))
    assert "base_" not in p.stdout and "eagle (default)" in p.stdout and "--cfg job" in p.stdout


def test_help_lists_the_groups_of_a_config_dir(tmp_path):
    (tmp_path / "mine" / "experiment").mkdir(parents=True)
    (tmp_path / "mine" / "experiment" / "fast.yaml").write_text("# @package _global_\nseed: 1\n")
    (tmp_path / "mine" / "draft").mkdir()
    (tmp_path / "mine" / "draft" / "wide.yaml").write_text("defaults:\n  - eagle\ntopk: 8\n")
    p = specpipe("-cd", str(tmp_path / "mine"), "--help", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    lines = {x.split()[0]: x for x in p.stdout.splitlines() if x.startswith("  ") and x.split()}
    assert "fast" in lines["experiment"] and "wide" in lines["draft"] and "ngram" in lines["draft"]


def stop_mid_run(out: Path, sig: int, preexec) -> tuple[subprocess.Popen, str]:
    """Starts a long run into `out`, waits for its first finished request in the partial file, sends `sig`; the
    process and its stderr."""
    import time

    partial = out / "completions.partial.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.Popen([sys.executable, "-m", "specpipe", "model=random_tiny", "workload.prompt_set=code_prefixes",
                          "workload.max_new_tokens=300", "workload.batch_size=1", "draft=none",
                          f"hydra.run.dir={out}"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, preexec_fn=preexec)
    deadline = time.time() + 120
    while time.time() < deadline and (not partial.exists() or not partial.read_text().strip()):
        assert p.poll() is None, p.communicate()
        time.sleep(0.2)
    p.send_signal(sig)
    return p, p.communicate(timeout=60)[1]


def kept_requests(out: Path) -> list:
    """The finished requests a stopped run kept: some, not all, and no metrics.json."""
    recs = [json.loads(x) for x in (out / "completions.partial.jsonl").read_text().splitlines()]
    assert recs and recs[0]["index"] == 0 and len(recs) < 12 and not (out / "metrics.json").exists()
    return recs


def test_ctrl_c_exits_130_and_keeps_the_finished_requests(tmp_path):
    out = tmp_path / "run"
    out.mkdir()  # a folder a finished run used: its results must not pass for the stopped run's (resume skipped it)
    (out / "metrics.json").write_text('{"tokens_per_s": 1.0}')
    (out / "completions.jsonl").write_text('{"index": 0}\n')
    p, stderr = stop_mid_run(out, signal.SIGINT, default_sigint)
    assert p.returncode == 130, stderr[-2000:]
    assert "interrupted; the requests that had finished are in" in stderr and "Traceback" not in stderr
    kept_requests(out)
    assert (out / "metrics.json.prev").read_text() == '{"tokens_per_s": 1.0}'  # set aside, not deleted
    assert (out / "completions.jsonl.prev").read_text() == '{"index": 0}\n'


def default_sigterm() -> None:
    """preexec_fn for a child that the test stops with SIGTERM (a runner may have left it ignored)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def test_sigterm_keeps_the_finished_requests_and_says_how_to_resume_as_ctrl_c_does(tmp_path):
    """issue #46: SIGTERM (`kill`, `timeout`, a scheduler's stop) left the partial file but printed nothing (the
    process died by the signal); it now ends the run as Ctrl-C does, with exit status 143."""
    out = tmp_path / "run"
    p, stderr = stop_mid_run(out, signal.SIGTERM, default_sigterm)
    assert p.returncode == 143, (p.returncode, stderr[-2000:])
    assert "specpipe: stopped by SIGTERM; the requests that had finished are in" in stderr, stderr[-2000:]
    assert f"resume=true hydra.run.dir={out}" in stderr and "Traceback" not in stderr
    kept_requests(out)


def test_a_run_refused_by_a_check_against_the_model_leaves_the_folders_earlier_results_in_place(tmp_path):
    """Checks that need the loaded model (allocator=swa on a model without sliding-window layers) run after Hydra
    made the run folder; a refused run writes nothing, so it must not set the earlier results aside either."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.json").write_text('{"tokens_per_s": 1.0}')
    (out / "completions.jsonl").write_text('{"index": 0}\n')
    p = specpipe(*SMALL, "allocator=swa", "device.num_threads=1", f"hydra.run.dir={out}", cwd=ROOT)
    assert p.returncode == 2 and "has no sliding-window layers" in p.stderr, p.stderr[-2000:]
    assert (out / "metrics.json").read_text() == '{"tokens_per_s": 1.0}'
    assert (out / "completions.jsonl").read_text() == '{"index": 0}\n'
    assert not (out / "metrics.json.prev").exists()


@contextlib.contextmanager
def second_ctrl_c_kills():
    """Asserts that a handled Ctrl-C leaves SIGINT at its default, so that a second press ends the process at once:
    raised as KeyboardInterrupt during the interpreter's exit instead, two presses 1-10 ms apart printed
    "Exception ignored in atexit callback ... KeyboardInterrupt" tracebacks."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
        assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGINT, before)


def test_ctrl_c_while_the_configs_are_checked_exits_130_without_a_traceback(monkeypatch, capsys):
    """The precheck composes every job's config before Hydra starts (seconds for a large sweep): Ctrl-C there gave
    a Python traceback and death by SIGINT."""
    import specpipe.__main__ as entry
    import specpipe.cli.precheck as cli_precheck

    def precheck(argv):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli_precheck, "precheck", precheck)
    monkeypatch.setattr(sys, "argv", ["specpipe", "model=random_tiny"])
    with second_ctrl_c_kills():
        with pytest.raises(SystemExit) as e:
            entry.main()
    assert e.value.code == 130 and capsys.readouterr().err.strip() == "specpipe: interrupted"


@pytest.mark.parametrize("decoding", [False, True])
def test_ctrl_c_names_the_partial_file_only_when_there_is_one(tmp_path, monkeypatch, capsys, decoding):
    """Ctrl-C while the model loads said the finished requests were in a completions.partial.jsonl that did not
    exist."""
    import specpipe.__main__ as entry
    import specpipe.run as app

    def stopped(cfg, out_dir=None, **kw):
        if decoding:  # the run had begun writing its partial file
            (Path(out_dir) / "completions.partial.jsonl").write_text("")
        raise KeyboardInterrupt
    monkeypatch.setattr(app, "run", stopped)
    monkeypatch.setattr(sys, "argv", ["specpipe", "model=random_tiny", f"hydra.run.dir={tmp_path / 'my run'}"])
    with second_ctrl_c_kills():
        with pytest.raises(SystemExit) as e:
            entry.main()
    err = capsys.readouterr().err
    assert e.value.code == 130 and ("completions.partial.jsonl" in err) == decoding, err
    # (and how to decode only the requests that had not finished)
    # (quoted for the shell: the folder's name has a space)
    assert (f"run the same command with resume=true 'hydra.run.dir={tmp_path / 'my run'}'" in err) == decoding, err
