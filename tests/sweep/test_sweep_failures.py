"""Sweeps with failing jobs: a crash or a config error is recorded in the job's error.json, the other jobs
still run, the sweep ends with a list of the failed jobs and exit status 1, and resume re-runs damaged jobs."""
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specpipe.sweep.report import failure_summary
from specpipe.sweep.report import main as report_main

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["model=random_tiny", "workload.num_prompts=2", "workload.max_new_tokens=8"]
ENV = dict(os.environ, OMP_NUM_THREADS="1")
ENV.pop("HYDRA_FULL_ERROR", None)

# `python -m specpipe ARGS` whose first decode raises an exception no config check could have foreseen
# (run_requests is what app.run calls to decode, after the weights are loaded)
CRASH_FIRST_DECODE = """
import runpy
import specpipe.run as app
real, calls = app.run_requests, []
def run_requests(*args, **kwargs):
    calls.append(1)
    if len(calls) == 1:
        raise RuntimeError("injected failure in the first decode")
    return real(*args, **kwargs)
app.run_requests = run_requests
runpy.run_module("specpipe", run_name="__main__", alter_sys=True)
"""


def sweep_cmd(*args, code=None):
    cmd = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "specpipe", *args]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)


def test_a_crash_and_a_config_error_are_recorded_and_the_sweep_exits_1(tmp_path):
    sweep = tmp_path / "sweep"
    p = sweep_cmd("-m", "draft.topk=2,0,1", *SMALL, f"hydra.sweep.dir={sweep}", code=CRASH_FIRST_DECODE)
    assert p.returncode == 1, p.stderr
    assert "Traceback" not in p.stderr
    crash = json.loads((sweep / "0" / "error.json").read_text())
    assert crash["crash"] is True and crash["exception"] == "RuntimeError"
    assert crash["error"] == "crashed: RuntimeError: injected failure in the first decode"
    assert crash["message"] == "injected failure in the first decode"
    assert "in run_requests" in crash["traceback"] and crash["traceback"].rstrip().endswith(crash["message"])
    config = json.loads((sweep / "1" / "error.json").read_text())
    assert config["crash"] is False and "draft.topk=0" in config["error"]
    # each error.json names its job's point, for a report without overrides.yaml (hydra.output_subdir=null)
    assert crash["overrides"] == ["draft.topk=2", *SMALL] and config["overrides"] == ["draft.topk=0", *SMALL]
    done = json.loads((sweep / "2" / "metrics.json").read_text())  # the sweep went on after both failures
    assert done["generated_tokens"] == 16 and done["model_loads_in_process"] == 1  # weights still reused
    summary = p.stderr[p.stderr.index("2 of 3 jobs failed"):]
    assert "job 0 (draft.topk=2): crashed: RuntimeError: injected failure in the first decode" in summary
    assert "job 1 (draft.topk=0): invalid configuration: draft.topk=0" in summary
    assert str(sweep / "0" / "error.json") in summary and str(sweep / "1" / "error.json") in summary
    assert "job 2" not in summary and "resume=true" in summary
    report_main([str(sweep)])
    with open(sweep / "report.csv") as f:
        errors = {r["job"]: r["error"] for r in csv.DictReader(f)}
    assert errors == {"2": "", "0": crash["error"], "1": config["error"]}


def test_resume_reruns_a_job_whose_metrics_json_is_damaged(tmp_path):
    sweep = tmp_path / "sweep"
    (sweep / "0").mkdir(parents=True)
    (sweep / "0" / "metrics.json").write_text("[1, 2]")  # valid JSON, not an object
    p = sweep_cmd("-m", "draft.topk=2", *SMALL, f"hydra.sweep.dir={sweep}", "resume=true")
    assert p.returncode == 0, p.stderr  # every job succeeded: no failure list, status 0
    assert "metrics.json is not a JSON object (it holds a JSON array), so the job runs again" in p.stderr
    assert "jobs failed" not in p.stderr
    assert json.loads((sweep / "0" / "metrics.json").read_text())["config"]["draft"]["topk"] == 2


def test_failure_summary_counts_only_the_jobs_of_this_sweep(tmp_path):
    def job(name, overrides, error=None, metrics=None, age_s=0.0):
        d = tmp_path / name
        (d / ".hydra").mkdir(parents=True)
        (d / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
        if error:
            (d / "error.json").write_text(json.dumps({"error": error, "crash": False}))
        if metrics:
            (d / "metrics.json").write_text(json.dumps(metrics))
        for f in d.rglob("*.*"):
            os.utime(f, (time.time() - age_s,) * 2)

    started = time.time() - 1.0
    job("0", ["draft.topk=1"], metrics={"tokens_per_s": 5.0})
    job("1", ["draft.topk=0"], error="specpipe: invalid configuration:\n  draft.topk=0 must be >= 1")
    job("2", ["draft.topk=2"])  # killed: neither file
    job("3", ["draft.topk=9"], error="specpipe: an earlier, longer sweep", age_s=3600)  # not this sweep's
    assert failure_summary(tmp_path, since=started + 3600) is None  # nothing written since then
    text = failure_summary(tmp_path, since=started)
    assert text.startswith("specpipe: 2 of 3 jobs failed:\n")
    assert "job 1 (draft.topk=0): invalid configuration: draft.topk=0 must be >= 1\n" in text  # one line each
    assert f"    {tmp_path / '1' / 'error.json'}\n" in text
    assert "job 2 (draft.topk=2): unfinished: no metrics.json" in text
    assert "job 0" not in text and "job 3" not in text and "earlier, longer" not in text


def test_a_job_whose_every_request_failed_is_a_failed_point(tmp_path):
    """As a single run with every request failed exits 1, such a sweep job is listed among the failures (the
    sweep exits 1) and returns NaN to the sweeper, not a 0.0 tokens/s success."""
    sweep = tmp_path / "sweep"
    p = sweep_cmd("-m", "allocator.num_slots=50,null", "workload.max_new_tokens=24", "model=random_tiny",
                  "workload.num_prompts=2", f"hydra.sweep.dir={sweep}")
    assert p.returncode == 1, p.stderr
    err = json.loads((sweep / "0" / "error.json").read_text())
    assert err["crash"] is False and err["error"].startswith("every request failed (2 of 2; the first: the KV pool")
    assert err["overrides"][0] == "allocator.num_slots=50"
    assert json.loads((sweep / "1" / "metrics.json").read_text())["num_errors"] == 0
    summary = p.stderr[p.stderr.index("1 of 2 jobs failed"):]
    assert "job 0 (allocator.num_slots=50): every request failed" in summary and "job 1" not in summary


def test_a_new_sweep_into_a_used_folder_leaves_no_earlier_results_beside_a_failed_job(tmp_path, capsys):
    """Job 0's folder holds an earlier sweep's finished run; the new sweep's job 0 is invalid. It writes its
    error.json and sets the earlier metrics.json and completions.jsonl aside (*.prev), which would otherwise be
    reported (and resumed) as this job's results."""
    sweep = tmp_path / "sweep"
    (sweep / "0").mkdir(parents=True)
    earlier = {"tokens_per_s": 900.0, "step_latency_ms_p90": 1.0, "config": {"draft": {"num_steps": 2}}}
    (sweep / "0" / "metrics.json").write_text(json.dumps(earlier))
    (sweep / "0" / "completions.jsonl").write_text('{"index": 0}\n')
    (sweep / "0" / "completions.partial.jsonl").write_text('{"index": 0}\n')
    p = sweep_cmd("-m", "draft.num_steps=0", *SMALL, f"hydra.sweep.dir={sweep}")
    assert p.returncode == 1 and "1 of 1 jobs failed" in p.stderr, p.stderr
    left = {f.name for f in (sweep / "0").iterdir()}
    assert "error.json" in left and not left & {"metrics.json", "completions.jsonl", "completions.partial.jsonl"}
    assert json.loads((sweep / "0" / "metrics.json.prev").read_text()) == earlier  # set aside, never deleted
    assert (sweep / "0" / "completions.jsonl.prev").read_text() == '{"index": 0}\n'
    # an interrupted earlier run's finished requests are set aside too (a resumed job deleted them)
    assert (sweep / "0" / "completions.partial.jsonl.prev").read_text() == '{"index": 0}\n'
    assert json.loads((sweep / "0" / "error.json").read_text())["overrides"] == ["draft.num_steps=0", *SMALL]
    with pytest.raises(SystemExit) as e:  # no job finished: nothing to report, not the earlier run's 900 tokens/s
        report_main([str(sweep)])
    assert e.value.code == 2 and "nothing to report" in capsys.readouterr().err


@pytest.mark.parametrize("preset, plugin", [("tree_shape", None), pytest.param(
    "optuna_tree", "hydra_optuna_sweeper", marks=pytest.mark.extras)])  # extras: run by make test-extras
def test_a_crashed_job_scores_what_its_sweeper_accepts(tmp_path, preset, plugin):
    """The callback turns a job's exception into a failed point: NaN for the basic sweeper, the worst score for
    Optuna's (which ends the whole search on NaN), and an error.json that names the job's point."""
    import importlib.util
    import math

    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.utils import JobReturn, JobStatus
    from omegaconf import OmegaConf, open_dict

    from specpipe.config.schema import register_schemas
    from specpipe.sweep.callback import SweepSummary

    assert not plugin or importlib.util.find_spec(f"hydra_plugins.{plugin}"), \
        f"{plugin} is not installed (make test-extras installs it; or pip install 'specpipe[optuna]')"
    register_schemas()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"sweep={preset}", "draft.topk=2"], return_hydra_config=True)
    with open_dict(cfg):
        OmegaConf.update(cfg, "hydra.runtime.output_dir", str(tmp_path))
        OmegaConf.update(cfg, "hydra.job.num", 3)
        OmegaConf.update(cfg, "hydra.overrides.task", ["draft.topk=2", "draft.num_steps=3"])
    ret = JobReturn(status=JobStatus.FAILED, _return_value=RuntimeError("boom"))
    SweepSummary().on_job_end(cfg, ret)
    assert ret.status == JobStatus.COMPLETED
    assert math.isnan(ret.return_value) if plugin is None else ret.return_value == -math.inf
    err = json.loads((tmp_path / "error.json").read_text())
    assert err["error"] == "crashed: RuntimeError: boom" and err["overrides"] == ["draft.topk=2", "draft.num_steps=3"]


def test_results_set_aside_twice_keep_every_earlier_run(tmp_path):
    """Two interrupted runs in a row: the second set-aside replaced the first's completions.partial.jsonl.prev,
    losing the requests the first run had finished."""
    from specpipe.outputs.run_files import clear_outputs

    partial = tmp_path / "completions.partial.jsonl"
    for text in ("first\n", "second\n", "third\n"):
        partial.write_text(text)
        clear_outputs(str(tmp_path))
    assert not partial.exists()
    assert (tmp_path / "completions.partial.jsonl.prev").read_text() == "third\n"  # the newest
    assert (tmp_path / "completions.partial.jsonl.prev.2").read_text() == "first\n"  # then in the order set aside
    assert (tmp_path / "completions.partial.jsonl.prev.3").read_text() == "second\n"


@pytest.mark.parametrize("sweeper", ["basic", "optuna"])
def test_a_job_that_decoded_nothing_is_a_failed_point_also_when_a_later_resume_skips_it(sweeper):
    """Every request of a resumed job had finished before the stop, so it measured no speed: its 0 tokens/s made it
    the worst point to Optuna (which then steered away from a setting that was never timed). The job's own run
    returned that, and so did every later resume=true that skipped it on its metrics.json."""
    import math
    from types import SimpleNamespace

    from specpipe.sweep.scoring import OPTUNA_SWEEPER, job_score

    hydra_cfg = SimpleNamespace(sweeper=SimpleNamespace(
        _target_=OPTUNA_SWEEPER + ".OptunaSweeper" if sweeper == "optuna" else "hydra._internal.core_plugins."
        "basic_sweeper.BasicSweeper", direction="maximize"))
    carried = {"tokens_per_s": 0.0, "generated_tokens": 0, "resumed_requests": 12, "step_latency_ms_p90": None}
    score = job_score(carried, None, hydra_cfg)
    assert (math.isnan(score) if sweeper == "basic" else score == -math.inf), score
    decoded = {**carried, "tokens_per_s": 80.0, "generated_tokens": 40, "resumed_requests": 3}
    assert job_score(decoded, None, hydra_cfg) == 80.0  # a resumed job that decoded some: its speed counts
    assert job_score({**decoded, "resumed_requests": 0}, None, hydra_cfg) == 80.0
    assert job_score({**decoded, "step_latency_ms_p90": 30.0}, 15.0, hydra_cfg) == -2.0  # over the latency limit
