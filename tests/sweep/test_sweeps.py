"""Sweeps as users run them: in-process weight reuse, joblib, resume, Ctrl-C, ready sweeps, optional plugins."""
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import compose, default_sigint

from specpipe.sweep.report import main as report_main
from specpipe.sweep.job_files import finished_metrics
from specpipe.sweep.scoring import failed_objective, objective
from specpipe.sweep.search_space import tree_search_space
from specpipe.config.validate import to_container, validate

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["model=random_tiny", "workload.num_prompts=2", "workload.max_new_tokens=8"]
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def specpipe(*args):
    return subprocess.run([sys.executable, "-m", "specpipe", *args], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=300)


def has_plugin(name: str) -> bool:
    return importlib.util.find_spec(f"hydra_plugins.{name}") is not None


def need_plugin(name: str, extra: str) -> None:
    """Tests marked `extras` run in `make test-extras`, whose .venv-extras holds the plugins: a missing one fails."""
    assert has_plugin(name), f"{name} is not installed (make test-extras installs requirements-extras.txt; " \
                             f"or pip install 'specpipe[{extra}]')"


def compose_hydra(overrides: list[str]):
    """The job config plus the hydra node (sweeper params, launcher), as the command line would compose it."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from specpipe.config.schema import register_schemas

    register_schemas()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=overrides, return_hydra_config=True)


def metrics(sweep: Path, job: int) -> dict:
    return json.loads((sweep / str(job) / "metrics.json").read_text())


@pytest.mark.slow
def test_in_process_multirun_loads_weights_once_and_reports(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    p = specpipe("-m", "draft.topk=1,2", "allocator=token,paged", *SMALL, f"hydra.sweep.dir={sweep}")
    assert p.returncode == 0, p.stderr
    ms = [metrics(sweep, i) for i in range(4)]
    assert [m["model_loads_in_process"] for m in ms] == [1, 1, 1, 1]  # one load, reused by the next three jobs
    shapes = {(m["config"]["draft"]["topk"], m["config"]["allocator"]["page_size"]) for m in ms}
    assert shapes == {(1, 1), (1, 16), (2, 1), (2, 16)}
    for m in ms:  # each job's point is in its metrics.json (the report's source without a .hydra folder)
        point = {"draft.topk": m["config"]["draft"]["topk"], "allocator": m["config"]["allocator"]["page_size"]}
        assert f"draft.topk={point['draft.topk']}" in m["overrides"] and "model=random_tiny" in m["overrides"]
        assert ("allocator=paged" if point["allocator"] == 16 else "allocator=token") in m["overrides"]
    report_main([str(sweep)])
    lines = (sweep / "report.csv").read_text().splitlines()
    assert lines[0].startswith("job,draft.topk,allocator,tokens_per_s") and len(lines) == 5
    tps = [float(x.split(",")[3]) for x in lines[1:]]
    assert tps == sorted(tps, reverse=True) and (sweep / "report.png").stat().st_size > 5000


@pytest.mark.slow
def test_joblib_multirun_runs_two_jobs(tmp_path):
    sweep = tmp_path / "sweep"
    p = specpipe("-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "draft.topk=1,2", *SMALL,
                 f"hydra.sweep.dir={sweep}")
    assert p.returncode == 0, p.stderr
    assert "Joblib.Parallel(n_jobs=2" in p.stdout + p.stderr
    assert [metrics(sweep, i)["config"]["draft"]["topk"] for i in range(2)] == [1, 2]
    assert all(metrics(sweep, i)["generated_tokens"] == 16 for i in range(2))


@pytest.mark.slow
def test_joblib_jobs_that_would_share_a_folder_are_skipped_not_overwritten(tmp_path):
    """Worker processes do not share the in-process launcher's record of written folders: the second job moved
    the first one's results aside and the sweep exited 0. Each job now claims its folder with a file."""
    sweep = tmp_path / "sweep"
    p = specpipe("-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "draft.topk=1,2", *SMALL,
                 "hydra.sweep.subdir=same", f"hydra.sweep.dir={sweep}")
    assert p.returncode == 1 and "of this sweep already wrote; it was skipped" in p.stderr, p.stderr[-2000:]
    assert not list((sweep / "same").glob("*.prev"))  # the first job's results were not set aside
    assert json.loads((sweep / "same" / "metrics.json").read_text())["generated_tokens"] == 16


@pytest.mark.slow
def test_resume_reruns_only_unfinished_jobs(tmp_path):
    sweep = tmp_path / "sweep"
    args = ["-m", "draft.num_steps=2,3,0", *SMALL, f"hydra.sweep.dir={sweep}"]  # job 2 is invalid
    p = specpipe(*args)
    assert p.returncode == 1, p.stderr  # one bad point does not end the sweep, but the sweep did not all succeed
    assert "draft.num_steps=0 must be" in json.loads((sweep / "2" / "error.json").read_text())["error"]
    assert not (sweep / "2" / "metrics.json").exists()  # ... and is recorded, not reported as a result
    assert "1 of 3 jobs failed" in p.stderr and str(sweep / "2" / "error.json") in p.stderr
    assert metrics(sweep, 1)["config"]["draft"]["num_steps"] == 3  # the jobs after it ran
    kept = (sweep / "0" / "metrics.json").stat().st_mtime_ns
    (sweep / "1" / "metrics.json").unlink()  # as if job 1 had been interrupted
    failed_at = (sweep / "2" / "error.json").stat().st_mtime_ns
    p = specpipe(*args, "resume=true")
    assert p.returncode == 1, p.stderr  # job 2 fails again
    assert p.stderr.count("skipped") == 1 and f"{sweep / '0'} already has metrics.json" in p.stderr
    assert (sweep / "0" / "metrics.json").stat().st_mtime_ns == kept  # finished job not run again
    assert metrics(sweep, 1)["config"]["draft"]["num_steps"] == 3  # the missing one ran
    assert (sweep / "2" / "error.json").stat().st_mtime_ns > failed_at  # a failed job is retried


def _interrupt_when(args, cwd, tmp_path, ready, limit: float = 180) -> tuple[int, str]:
    """Start `python -m specpipe *args` in cwd, send it SIGINT (as Ctrl-C does) half a second after ready() holds;
    (exit status, stderr)."""
    with open(tmp_path / "stderr.txt", "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "specpipe", *args], cwd=cwd, env=ENV,
                                stdout=subprocess.DEVNULL, stderr=err, preexec_fn=default_sigint)
        deadline = time.monotonic() + limit
        while not ready():
            assert proc.poll() is None and time.monotonic() < deadline, "the sweep ended before the point to stop it"
            time.sleep(0.05)
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    return proc.returncode, (tmp_path / "stderr.txt").read_text()


@pytest.mark.slow
def test_ctrl_c_keeps_finished_jobs(tmp_path):
    sweep = tmp_path / "sweep"
    args = ["-m", "workload.max_new_tokens=8,3000", "model=random_tiny", "model.max_position=4096",
            "workload.num_prompts=1", f"hydra.sweep.dir={sweep}"]
    # job 0 done, job 1 (~10 s) started
    returncode, err = _interrupt_when(args, ROOT, tmp_path,
                                      lambda: (sweep / "1" / ".hydra" / "overrides.yaml").exists())
    assert returncode == 130 and "Traceback" not in err, err[-2000:]  # one paragraph, as a single run's
    assert f"specpipe: sweep interrupted in job 1 ({sweep}/1)" in err and f"resume=true hydra.sweep.dir={sweep}" in err
    assert metrics(sweep, 0)["generated_tokens"] == 8 and (sweep / "0" / "completions.jsonl").is_file()
    assert not (sweep / "1" / "metrics.json").exists()  # the interrupted job does not look finished


SWEEPS = [pytest.param(p.stem, marks=pytest.mark.extras) if p.stem.startswith("optuna") else p.stem
          for p in sorted((ROOT / "conf" / "sweep").glob("*.yaml"))]


@pytest.mark.parametrize("name", SWEEPS)
def test_ready_sweeps_compose_and_validate_at_every_point(name):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if name.startswith("optuna"):
        need_plugin("hydra_optuna_sweeper", "optuna")
    cfg = compose_hydra([f"sweep={name}"])
    assert cfg.hydra.mode.name == "MULTIRUN"
    params = cfg.hydra.sweeper.params
    assert params, f"conf/sweep/{name}.yaml sweeps nothing"
    if name.startswith("optuna"):
        return  # a search space, not a grid: test_optuna_sweep runs it
    parsed = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()])
    points = [[]]
    for o in parsed:
        points = [p + [f"{o.get_key_element()}={v}"] for p in points for v in o.sweep_string_iterator()]
    assert len(points) > 1
    for point in points:
        validate(compose(f"sweep={name}", *point))


def test_resume_reuses_only_the_same_config(tmp_path):
    cfg = compose(*SMALL)
    assert finished_metrics(cfg, str(tmp_path)) is None
    (tmp_path / "metrics.json").write_text(json.dumps({"tokens_per_s": 5.0, "config": to_container(cfg)}))
    assert finished_metrics(cfg, str(tmp_path))["tokens_per_s"] == 5.0
    cfg.resume, cfg.latency_limit_ms = True, 3.0  # scoring and skipping knobs do not change the run
    assert finished_metrics(cfg, str(tmp_path)) is not None
    (tmp_path / "error.json").write_text('{"error": "every request failed (2 of 2; ...)"}')
    assert finished_metrics(cfg, str(tmp_path)) is None  # a failed job keeps metrics.json but runs again
    (tmp_path / "error.json").unlink()
    cfg.draft.topk = 1  # a different run in the same job dir (e.g. a re-used sweep dir) is run, not reused
    assert finished_metrics(cfg, str(tmp_path)) is None
    (tmp_path / "metrics.json").write_text("{trunc")
    assert finished_metrics(cfg, str(tmp_path)) is None


def test_resume_runs_a_finished_job_again_when_its_model_files_changed(tmp_path, capsys):
    """Weights retrained under the same model.path: the config is the same, the finished job is not."""
    from specpipe.outputs.resume import model_files_digest

    cfg, model = compose(*SMALL), tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"x" * 10)
    job = tmp_path / "job"
    job.mkdir()
    (job / "metrics.json").write_text(json.dumps({"tokens_per_s": 5.0, "config": to_container(cfg),
                                                  "model_folders": [str(model)],
                                                  "model_files_sha256": model_files_digest([model])}))
    assert finished_metrics(cfg, str(job))["tokens_per_s"] == 5.0
    (model / "model.safetensors").write_bytes(b"y" * 11)
    assert finished_metrics(cfg, str(job)) is None
    assert "the model files in" in capsys.readouterr().err


def test_resume_matches_a_job_finished_before_an_upgrade_added_a_setting(tmp_path):
    """A sweep started with an older specpipe stored configs without the settings added since (sampling.min_p):
    resume compares what both hold, so its finished jobs are skipped, not run again over their results."""
    cfg = compose(*SMALL)
    older = to_container(cfg)
    del older["sampling"]["min_p"]
    older["retired_setting"] = 3  # and one an upgrade dropped
    (tmp_path / "metrics.json").write_text(json.dumps({"tokens_per_s": 5.0, "config": older}))
    assert finished_metrics(cfg, str(tmp_path))["tokens_per_s"] == 5.0
    cfg.sampling.min_p = 0.1  # the added setting away from its default: not the run the older version made
    assert finished_metrics(cfg, str(tmp_path)) is None
    cfg.sampling.min_p, cfg.sampling.temperature = 0.0, 0.5  # a setting both hold still tells runs apart
    assert finished_metrics(cfg, str(tmp_path)) is None


def test_resume_matches_a_run_whose_paths_were_made_absolute(tmp_path, monkeypatch):
    """A run stores its paths absolute (`~/p.jsonl`, or relative under hydra.job.chdir=true); the job's own
    config still says `~/p.jsonl`, and resume re-ran every finished job."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "p.jsonl").write_text('{"prompt": "def f():"}\n')
    cfg, ran = compose(*SMALL), compose(*SMALL)
    cfg.workload.prompts_file = ran.workload.prompts_file = "~/p.jsonl"  # as a user's own config file sets it
    validate(ran)
    assert ran.workload.prompts_file == str(tmp_path / "p.jsonl")
    (tmp_path / "metrics.json").write_text(json.dumps({"tokens_per_s": 5.0, "config": to_container(ran)}))
    assert finished_metrics(cfg, str(tmp_path))["tokens_per_s"] == 5.0
    assert cfg.workload.prompts_file == "~/p.jsonl"  # the job's config is left as it was


@pytest.mark.parametrize("contents", [b"[1, 2]", b"\xff\xfe{}", b"", b'{"tokens_per_s": 1',
                                      b'{"tokens_per_s": 1.0, "config": [1]}', b'{"tokens_per_s": "x", "config": {}}'])
def test_resume_runs_a_job_whose_metrics_json_is_damaged_again(tmp_path, capsys, contents):
    cfg = compose(*SMALL)
    (tmp_path / "metrics.json").write_bytes(contents)
    assert finished_metrics(cfg, str(tmp_path)) is None  # not finished: the job runs again (no traceback)
    err = capsys.readouterr().err
    assert err.startswith(f"resume: {tmp_path}: metrics.json") and err.endswith("so the job runs again\n")


def test_objective_ranks_every_run_within_the_latency_limit_first():
    fast_slow = {"tokens_per_s": 900.0, "step_latency_ms_p90": 30.0}
    slow_ok = {"tokens_per_s": 100.0, "step_latency_ms_p90": 10.0}
    assert objective(fast_slow, None) == 900.0
    assert objective(slow_ok, 20.0) == 100.0 and objective(fast_slow, 20.0) == -1.5
    assert objective({"tokens_per_s": 1.0, "step_latency_ms_p90": 60.0}, 20.0) < objective(fast_slow, 20.0)


def test_tree_search_space_keeps_num_draft_tokens_valid():
    class Trial:
        def __init__(self, k, s):
            self.params, self.asked = {"draft.topk": k, "draft.num_steps": s}, None

        def suggest_int(self, name, low, high):
            self.asked = (name, low, high)

    for (k, s), bounds in {(1, 2): (3, 3), (2, 2): (3, 7), (4, 2): (3, 16), (4, 6): (7, 16)}.items():
        t = Trial(k, s)
        tree_search_space(None, t)
        assert t.asked == ("draft.num_draft_tokens", *bounds)


def test_slurm_launcher_config_renders_an_sbatch_script(tmp_path, monkeypatch):
    if not has_plugin("hydra_submitit_launcher"):
        pytest.skip("hydra-submitit-launcher is not installed (pip install 'specpipe[slurm]')")
    import submitit
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    cfg = compose_hydra(["hydra/launcher=slurm", "hydra.launcher.partition=gpu", "hydra.sweep.dir=" + str(tmp_path)])
    launcher = instantiate(cfg.hydra.launcher)
    assert type(launcher).__name__ == "SlurmLauncher"
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "srun").write_text("#!/bin/sh\n")  # submitit only checks that srun exists
    (tmp_path / "bin" / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    params = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    params.pop("_target_")
    # the parameter hand-over of hydra_submitit_launcher's launch(): unknown keys raise here
    ex = submitit.AutoExecutor(cluster="slurm", folder=params.pop("submitit_folder"),
                               slurm_max_num_timeout=params.pop("max_num_timeout"))
    base = {"timeout_min", "cpus_per_task", "gpus_per_node", "tasks_per_node", "mem_gb", "nodes", "name",
            "stderr_to_stdout"}
    ex.update_parameters(**{k if k in base else f"slurm_{k}": v for k, v in params.items()})
    script = ex._executor._make_submission_file_text("python -m specpipe", "0")
    for line in ("--partition=gpu", "--gpus-per-node=1", "--cpus-per-task=8", "--time=60", "--mem=64GB"):
        assert f"#SBATCH {line}" in script


def optuna_search(tmp_path, *overrides):
    """(sweep dir, process) of `sweep=optuna_tree` with these overrides; fails without the plugin."""
    need_plugin("hydra_optuna_sweeper", "optuna")
    sweep = tmp_path / "sweep"
    return sweep, specpipe("sweep=optuna_tree", *overrides, *SMALL, f"hydra.sweep.dir={sweep}")


@pytest.mark.slow
@pytest.mark.extras
def test_optuna_sweep_maximizes_tokens_per_s(tmp_path):
    sweep, p = optuna_search(tmp_path, "hydra.sweeper.n_trials=3", "latency_limit_ms=1000")
    assert p.returncode == 0, p.stderr
    best = (sweep / "optimization_results.yaml").read_text()
    assert "best_params" in best and "draft.num_draft_tokens" in best
    assert len(list(sweep.glob("*/metrics.json"))) == 3


def test_a_failed_job_scores_nan_for_the_basic_sweeper():
    assert math.isnan(failed_objective(compose_hydra(["sweep=tree_shape"]).hydra))


@pytest.mark.extras
@pytest.mark.parametrize("direction, worst", [(None, -math.inf), ("minimize", math.inf)])
def test_a_failed_job_scores_the_worst_value_for_optuna(direction, worst):
    """Optuna's sweeper ends the whole search when a trial returns NaN: a failed job scores what ranks last
    for the study's direction (sweep=optuna_tree maximizes), and Optuna accepts it."""
    need_plugin("hydra_optuna_sweeper", "optuna")
    import optuna

    cfg = compose_hydra(["sweep=optuna_tree", *([f"hydra.sweeper.direction={direction}"] if direction else [])])
    value = failed_objective(cfg.hydra)
    assert value == worst
    study = optuna.create_study(direction=direction or "maximize")
    for v in (value, 3.0):  # as hydra-optuna-sweeper tells it: no exception, and the failed trial ranks last
        trial = study.ask()
        trial.suggest_int("draft.topk", 1, 4)
        study.tell(trial, v)
    assert study.best_value == 3.0


@pytest.mark.slow
@pytest.mark.extras
def test_optuna_search_goes_on_past_failed_trials(tmp_path):
    # every trial fails: the pool is too small for any request
    sweep, p = optuna_search(tmp_path, "hydra.sweeper.n_trials=2", "allocator.num_slots=50")
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert "2 of 2 jobs failed" in p.stderr
    assert "best_value: -.inf" in (sweep / "optimization_results.yaml").read_text()


@pytest.mark.slow
@pytest.mark.extras
def test_ray_local_launcher_runs_two_jobs(tmp_path):
    need_plugin("hydra_ray_launcher", "ray")
    sweep = tmp_path / "sweep"
    # Ray 2.60 swaps ray.init(_node_ip_address="127.0.0.1") for this host's routable address and then listens on
    # every interface; RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (no multi-node Ray) keeps every Ray server on 127.0.0.1
    p = subprocess.run([sys.executable, "-m", "specpipe", "-m", "hydra/launcher=ray_local", "draft.topk=1,2", *SMALL,
                        f"hydra.sweep.dir={sweep}"], cwd=ROOT, env=dict(ENV, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0"),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert [metrics(sweep, i)["config"]["draft"]["topk"] for i in range(2)] == [1, 2]


def test_jobs_that_would_share_a_folder_are_skipped_not_overwritten(tmp_path):
    """hydra.sweep.subdir=${draft.topk} while the allocator is swept too: the second job of each folder would
    overwrite the first one's results; it is skipped, named at the end, and the sweep exits 1."""
    p = specpipe("-m", *SMALL, "draft.topk=1,2", "allocator=token,paged", "hydra.sweep.subdir=${draft.topk}",
                 f"hydra.sweep.dir={tmp_path}")
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert p.stderr.count("which job 0 of this sweep already wrote") == 2  # when it happens and at the end
    assert "job 3 (" in p.stderr and "which job 2 of this sweep already wrote" in p.stderr
    for folder in ("1", "2"):  # the first job's results stay
        config = json.loads((tmp_path / folder / "metrics.json").read_text())["config"]
        assert config["allocator"]["_target_"].endswith("TokenAllocator")


def test_resume_runs_a_job_again_when_its_prompts_file_was_rewritten(tmp_path, capsys):
    """The config names the prompts file, not what it holds: a file rewritten under the same name was skipped
    as finished, leaving the old prompts' completions."""
    from specpipe.run import run

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def f():"}\n')
    cfg = compose(*SMALL, f"workload.prompts_file={prompts}")
    out = tmp_path / "run"
    run(cfg, out_dir=str(out), quiet=True)
    assert finished_metrics(cfg, str(out)) is not None  # the same file: finished
    prompts.write_text('{"prompt": "class A:"}\n{"prompt": "import os"}\n')
    capsys.readouterr()
    assert finished_metrics(cfg, str(out)) is None
    assert "the prompts differ from the earlier run's" in capsys.readouterr().err
    stored = json.loads((out / "metrics.json").read_text())
    del stored["prompts_sha256"]  # a run of an older specpipe: only its config can be compared
    (out / "metrics.json").write_text(json.dumps(stored))
    assert finished_metrics(cfg, str(out)) is not None
    cfg.workload.prompts_file = "-"
    stored["prompts_sha256"] = "0" * 64
    (out / "metrics.json").write_text(json.dumps(stored))
    assert finished_metrics(cfg, str(out)) is None  # standard input cannot be compared: the job runs again


def test_ctrl_c_under_joblib_names_the_sweep_folder(tmp_path):
    """With hydra/launcher=joblib the jobs run in worker processes, so the process the user stops never knew the
    folder (its default name is a timestamp): the message said "set hydra.sweep.dir to this sweep's folder"
    without naming it."""
    args = ["-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "workload.max_new_tokens=3000,2999",
            "model=random_tiny", "model.max_position=4096", "workload.num_prompts=1"]  # (n_jobs=1 runs in process)
    returncode, err = _interrupt_when(  # both workers' jobs started
        args, tmp_path, tmp_path, lambda: len(list(tmp_path.glob("multirun/*/*/*/.hydra/overrides.yaml"))) >= 2)
    sweep = next(tmp_path.glob("multirun/*/*/1")).parent.relative_to(tmp_path)
    assert returncode == 130 and "Traceback" not in err, err[-2000:]
    assert f"specpipe: sweep interrupted ({sweep})" in err and f"resume=true hydra.sweep.dir={sweep}" in err, err
