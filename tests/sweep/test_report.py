"""python -m specpipe.report on a hand-made sweep dir: CSV rows, markdown sorted by tokens/s, a real PNG."""
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from specpipe.sweep.jobs import UNFINISHED
from specpipe.sweep.report import main

JOBS = {  # job -> (overrides, metrics or None, error or None)
    "0": (["draft.topk=1", "draft.num_steps=3", "model=random_tiny"], dict(tps=310.0, acc=2.1, p90=9.5), None),
    "1": (["draft.topk=2", "draft.num_steps=3", "model=random_tiny"], dict(tps=455.5, acc=2.9, p90=11.0), None),
    "2": (["draft.topk=4", "draft.num_steps=3", "model=random_tiny"], dict(tps=402.25, acc=3.3, p90=14.0), None),
    "3": (["draft.topk=1", "draft.num_steps=5", "model=random_tiny"], None, "specpipe: invalid configuration: x|y"),
    "10": (["draft.topk=2", "draft.num_steps=5", "model=random_tiny"], None, None),  # interrupted
}


def make_sweep(root, latency_limit_ms=None, extra=()):
    root.mkdir(parents=True, exist_ok=True)
    (root / "multirun.yaml").write_text("hydra: {}\n")
    for name, (overrides, m, err) in JOBS.items():
        d = root / name
        (d / ".hydra").mkdir(parents=True)
        (d / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in [*overrides, *extra]))
        if m:
            (d / "metrics.json").write_text(json.dumps({
                "tokens_per_s": m["tps"], "accept_length_mean": m["acc"], "step_latency_ms_p90": m["p90"],
                "num_verify_steps": 7, "recompiles": 0, "wall_s": 0.5,
                "config": {"latency_limit_ms": latency_limit_ms}}))
        if err:
            (d / "error.json").write_text(json.dumps({"error": err}))
    return root


@pytest.mark.parametrize("extra", [(), ("resume=true",)], ids=["first-run", "resumed"])
def test_report_writes_csv_markdown_and_png(tmp_path, capsys, extra):
    """A resumed sweep (every job's overrides then hold resume=true) reads as the same sweep."""
    sweep = make_sweep(tmp_path / "sweep", extra=extra)
    out = tmp_path / "out"
    main([str(sweep), "--out", str(out)])
    with open(out / "report.csv") as f:
        table = list(csv.DictReader(f))
    # one row per job, fastest first, failed and unfinished last in job order; fixed keys are not columns
    assert [r["job"] for r in table] == ["1", "2", "0", "3", "10"]
    assert list(table[0])[:3] == ["job", "draft.topk", "draft.num_steps"] and "model" not in table[0]
    assert float(table[0]["tokens_per_s"]) == 455.5 and table[0]["draft.topk"] == "2"
    assert table[3]["error"].startswith("specpipe: invalid configuration") and table[3]["tokens_per_s"] == ""
    assert table[4]["error"] == UNFINISHED
    md = (out / "report.md").read_text()
    assert "Best: job 1 (draft.topk=2 draft.num_steps=3), 455.5 tokens/s" in md
    assert "Fixed in every job: `model=random_tiny`\n" in md and "within_latency_limit" not in md
    body = [line for line in md.splitlines() if line.startswith("| ") and "job" not in line]
    assert [line.split("|")[1].strip() for line in body] == ["1", "2", "0", "3", "10"]
    assert "455.5" in body[0] and "402.2" in body[1] and "x\\|y" in body[3]  # pipes in errors are escaped
    png = (out / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert "report.csv" in capsys.readouterr().out


DAMAGED = {  # job -> (file, contents, what the report must say about it)
    "4": ("metrics.json", b"[1, 2]", "metrics.json is not a JSON object"),
    "5": ("metrics.json", b"\xff\xfe{", "metrics.json is not valid UTF-8 JSON"),
    "6": ("metrics.json", b'{"tokens_per_s": 1', "metrics.json is unreadable (truncated JSON"),
    "7": ("metrics.json", b"", "metrics.json is empty"),
    "8": ("metrics.json", b'{"tokens_per_s": "fast"}', "tokens_per_s=\"fast\", not a finite number"),
    "9": ("error.json", b"garbage{", "failed: error.json is unreadable (invalid JSON"),
    "11": ("metrics.json", b'{"tokens_per_s": 1' + b"0" * 400 + b"}",
           "tokens_per_s=1000000000000000000000000000000000000000"
           ", not a finite number"),  # an integer no float holds: it crashed the report with an OverflowError
    "12": ("metrics.json", b'{"tokens_per_s": 1.0, "config": {"mod', "metrics.json is unreadable (truncated JSON: "
           "Unterminated string starting at line 1 column 34)"),
    "13": ("metrics.json", b'{"tokens_per_s": 1.0, "accept_length_mean": 1' + b"0" * 400 + b"}",
           "accept_length_mean=1" + "0" * 39 + ", not a finite number"),  # math.isnan raised on it
}


def test_damaged_job_files_are_reported_with_what_is_wrong(tmp_path, capsys):
    sweep = make_sweep(tmp_path / "sweep")
    for name, (file, contents, _) in DAMAGED.items():
        (sweep / name / ".hydra").mkdir(parents=True)
        (sweep / name / ".hydra" / "overrides.yaml").write_text(f"- draft.topk={name}\n- model=random_tiny\n")
        (sweep / name / file).write_bytes(contents)
    main([str(sweep)])  # no traceback: the good jobs still get their table
    with open(sweep / "report.csv") as f:
        table = {r["job"]: r for r in csv.DictReader(f)}
    assert [j for j, r in table.items() if r["tokens_per_s"]] == ["1", "2", "0"]
    for name, (_, _, says) in DAMAGED.items():
        assert says in table[name]["error"], table[name]["error"]
        assert table[name]["error"] != UNFINISHED
    assert "Best: job 1" in (sweep / "report.md").read_text()
    assert "14 jobs (11 without metrics)" in capsys.readouterr().out


@pytest.mark.parametrize("where", ["file", "under_a_file"])
def test_out_that_cannot_be_a_folder_is_a_clear_error(tmp_path, capsys, where):
    sweep = make_sweep(tmp_path / "sweep")
    (tmp_path / "taken").write_text("not a folder")
    out = tmp_path / "taken" / ("sub" if where == "under_a_file" else "")
    with pytest.raises(SystemExit) as e:
        main([str(sweep), "--out", str(out)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("specpipe.report:") and err.count("\n") == 1 and str(out) in err
    assert ("is an existing file, not a folder" if where == "file" else "(Not a directory)") in err
    assert not (sweep / "report.csv").exists()


def test_report_defaults_to_the_sweep_dir(tmp_path):
    sweep = make_sweep(tmp_path)
    main([str(sweep)])
    assert all((sweep / f"report.{ext}").is_file() for ext in ("csv", "md", "png"))


@pytest.mark.parametrize("setup", ["empty", "only_failed", "missing"])
def test_no_metrics_is_a_clear_error(tmp_path, capsys, setup):
    target = tmp_path / "sweep"
    if setup != "missing":
        target.mkdir()
    if setup == "only_failed":
        (target / "0").mkdir()
        (target / "0" / "error.json").write_text(json.dumps({"error": "specpipe: bad\n  topk"}))
    with pytest.raises(SystemExit) as e:
        main([str(target)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("specpipe.report:") and err.count("\n") == 1  # one paragraph
    assert ("no metrics.json" in err) != (setup == "missing")
    if setup == "only_failed":
        assert "says: specpipe: bad topk. Give the folder" in err  # one line, two sentences


def test_latency_limited_sweep_picks_the_fastest_job_within_the_limit(tmp_path):
    sweep = make_sweep(tmp_path, latency_limit_ms=10.0)
    main([str(sweep)])
    with open(sweep / "report.csv") as f:
        table = list(csv.DictReader(f))
    assert [r["job"] for r in table] == ["1", "2", "0", "3", "10"]  # still sorted by tokens/s
    assert [r["within_latency_limit"] for r in table] == ["no", "no", "yes", "", ""]
    assert "Best: job 0 (draft.topk=1 draft.num_steps=3), 310.0 tokens/s\n" in (sweep / "report.md").read_text()


def test_best_says_so_when_no_job_kept_the_latency_limit(tmp_path):
    sweep = make_sweep(tmp_path, latency_limit_ms=5.0)  # every p90 is above 5 ms
    main([str(sweep)])
    assert ("Best: job 0 (draft.topk=1 draft.num_steps=3), 310.0 tokens/s (no job kept its p90 step latency within "
            "latency_limit_ms=5; this one came closest)") in (sweep / "report.md").read_text()


def test_a_job_that_lost_requests_says_so_and_is_not_best(tmp_path):
    """A job whose requests failed did less work, so its tokens/s flatters it: the error cell says how many of
    them failed and why, and Best goes to the fastest job that lost none."""
    sweep = make_sweep(tmp_path / "sweep")
    m = json.loads((sweep / "1" / "metrics.json").read_text())  # the fastest job
    m.update(num_requests=4, num_errors=3, request_errors=[{"index": 1, "error": "the KV pool (50 slots) is small"}])
    (sweep / "1" / "metrics.json").write_text(json.dumps(m))
    main([str(sweep), "--out", str(tmp_path / "out")])
    with open(tmp_path / "out" / "report.csv") as f:
        table = {r["job"]: r for r in csv.DictReader(f)}
    assert table["1"]["error"] == "3 of 4 requests failed: the KV pool (50 slots) is small"
    assert table["2"]["error"] == ""
    assert ("Best: job 2 (draft.topk=4 draft.num_steps=3), 402.2 tokens/s"
            in (tmp_path / "out" / "report.md").read_text())


def test_a_resumed_job_says_so_and_one_that_decoded_nothing_is_not_best(tmp_path):
    """A resumed job's numbers cover only the requests it decoded; one whose requests had all finished before the
    stop decoded nothing (tokens/s 0), which is no measurement of its settings."""
    sweep = make_sweep(tmp_path / "sweep")
    for job, resumed, generated in (("2", 3, 10), ("1", 4, 0)):  # job 1: the fastest on paper
        m = json.loads((sweep / job / "metrics.json").read_text())
        m.update(num_requests=4, resumed_requests=resumed, generated_tokens=generated)
        (sweep / job / "metrics.json").write_text(json.dumps(m))
    main([str(sweep), "--out", str(tmp_path / "out")])
    with open(tmp_path / "out" / "report.csv") as f:
        table = {r["job"]: r for r in csv.DictReader(f)}
    assert table["2"]["error"] == "resumed: 3 of 4 requests came from the stopped run; its numbers cover the others"
    assert table["1"]["error"].endswith("none decoded here, so no speed was measured")
    assert table["0"]["error"] == ""
    assert "Best: job 2 " in (tmp_path / "out" / "report.md").read_text()


def test_a_job_that_left_a_swept_key_at_its_default_shows_that_value(tmp_path):
    """Jobs with different override lists (a resumed sweep, hand-made dirs): a job without the override shows
    the value it ran with (the group choice from hydra.yaml, a setting from config.yaml), not an empty cell."""
    sweep = tmp_path / "sweep"
    for name, overrides, tps in (("0", ["draft.topk=2"], 5.0), ("1", ["draft.topk=4", "allocator=paged",
                                                                      "draft.num_steps=7"], 6.0)):
        d = sweep / name / ".hydra"
        d.mkdir(parents=True)
        (d / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
        (d / "hydra.yaml").write_text("hydra:\n  runtime:\n    choices:\n      allocator: token\n      draft: eagle\n")
        (d / "config.yaml").write_text("draft:\n  topk: 2\n  num_steps: 3\nallocator:\n  page_size: 1\n")
        (sweep / name / "metrics.json").write_text(json.dumps({
            "tokens_per_s": tps, "accept_length_mean": 2.0, "step_latency_ms_p90": 1.0, "num_verify_steps": 3,
            "recompiles": 0, "wall_s": 0.1}))
    main([str(sweep)])
    with open(sweep / "report.csv") as f:
        table = {r["job"]: r for r in csv.DictReader(f)}
    assert table["0"]["allocator"] == "token" and table["0"]["draft.num_steps"] == "3"
    assert table["1"]["allocator"] == "paged" and table["1"]["draft.num_steps"] == "7"


def test_a_new_sweep_into_the_same_folder_reports_only_its_jobs(tmp_path, capsys):
    """A shorter sweep into the folder of a longer one leaves the older jobs in place (multirun.yaml records only
    the newest sweep, here 2 jobs): jobs numbered 2 and up are left out by default, and said to be, and --all
    reports them. File times play no part: this folder's were scrambled, as a copy or a git clone leaves them."""
    sweep = make_sweep(tmp_path / "sweep")
    (sweep / "multirun.yaml").write_text(yaml.safe_dump({"hydra": {
        "sweeper": {"_target_": "hydra._internal.core_plugins.basic_sweeper.BasicSweeper", "params": None},
        "overrides": {"task": ["draft.topk=2,1", "draft.num_steps=3", "model=random_tiny"]}}}))
    now = time.time()
    for i, f in enumerate(sorted(sweep.rglob("*.*"))):
        os.utime(f, (now - 100 * (i % 7),) * 2)
    main([str(sweep)])
    with open(sweep / "report.csv") as f:
        assert [r["job"] for r in csv.DictReader(f)] == ["1", "0"]
    md = (sweep / "report.md").read_text()
    assert "Best: job 1 (draft.topk=2)" in md and "3 older job dir(s)" in md and "--all" in md
    assert "3 older job dir(s)" in capsys.readouterr().out
    main([str(sweep), "--all"])
    with open(sweep / "report.csv") as f:
        assert [r["job"] for r in csv.DictReader(f)] == ["1", "2", "0", "3", "10"]
    assert "older" not in (sweep / "report.md").read_text()


@pytest.mark.parametrize("hydra, size", [
    ({"overrides": {"task": ["++draft.topk=1,2"]}, "sweeper": {"params": {"draft.topk": "1,2,4",
                                                                          "draft.num_steps": "2,3"}}}, 12),
    ({"overrides": {"task": ["draft.topk=1,2"]}, "sweeper": {"params": {"draft.topk": "1,2,4"}}}, 2),
    ({"overrides": {"task": ["draft.topk=range(1,4)", "x=choice(a,b)"]}}, 6),
    ({"overrides": {"task": ["draft.topk=1,2"]}, "sweep": {"subdir": "${draft.topk}"}}, None),  # not numbered
])
def test_the_newest_sweeps_size_is_counted_as_the_basic_sweeper_combines(tmp_path, hydra, size):
    """++k and k are two sweeps to the sweeper; the command line replaces a preset's key; job folders named
    otherwise than by number are never left out."""
    from specpipe.sweep.points import newest_sweep_size

    sweeper = {"_target_": "hydra._internal.core_plugins.basic_sweeper.BasicSweeper", **hydra.pop("sweeper", {})}
    (tmp_path / "multirun.yaml").write_text(yaml.safe_dump({"hydra": {"sweeper": sweeper, **hydra}}))
    assert newest_sweep_size(tmp_path) == size


def finished(tps: float, config: dict) -> str:
    return json.dumps({"tokens_per_s": tps, "accept_length_mean": 2.0, "step_latency_ms_p90": 1.0,
                       "num_verify_steps": 3, "recompiles": 0, "wall_s": 0.1, "config": config})


def test_a_default_that_config_yaml_holds_as_an_interpolation_shows_its_resolved_value(tmp_path):
    """config.yaml holds ${...} unresolved; metrics.json's config holds what the job ran with."""
    sweep = tmp_path / "sweep"
    jobs = {"0": (["draft.num_draft_tokens=6"], 6), "1": (["draft.topk=2"], 4), "2": (["draft.topk=3"], None)}
    for name, (overrides, tokens) in jobs.items():
        (sweep / name / ".hydra").mkdir(parents=True)
        (sweep / name / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
        (sweep / name / ".hydra" / "hydra.yaml").write_text("hydra:\n  runtime:\n    choices:\n      draft: eagle\n")
        (sweep / name / ".hydra" / "config.yaml").write_text(
            "draft:\n  topk: 1\n  num_steps: 3\n  num_draft_tokens: ${specpipe.draft_tokens:${.topk},${.num_steps}}\n")
        if tokens:
            config = {"draft": {"topk": 2 if name == "1" else 1, "num_draft_tokens": tokens}}  # as the job ran
            (sweep / name / "metrics.json").write_text(finished(5.0, config))
        else:
            (sweep / name / "error.json").write_text(json.dumps({"error": "specpipe: failed"}))
    main([str(sweep)])
    with open(sweep / "report.csv") as f:
        table = {r["job"]: r for r in csv.DictReader(f)}
    assert [table[j]["draft.num_draft_tokens"] for j in "012"] == ["6", "4", ""]
    assert "${" not in (sweep / "report.md").read_text()


@pytest.mark.parametrize("output_subdir", ["null", "meta"])
def test_jobs_without_a_hydra_folder_are_told_apart_by_their_config(tmp_path, output_subdir):
    """hydra.output_subdir=null saves no overrides.yaml: the columns are the settings of metrics.json's config
    that differ between jobs (not resume, which differs in a resumed sweep). Another name is found as well."""
    sweep = tmp_path / "sweep"
    for name, topk, tps, resume in (("0", 1, 5.0, False), ("1", 2, 6.0, True)):
        (sweep / name).mkdir(parents=True)
        (sweep / name / "metrics.json").write_text(finished(tps, {
            "draft": {"topk": topk, "num_steps": 3}, "stop": ["a"], "seed": 0, "resume": resume}))
        if output_subdir != "null":
            (sweep / name / output_subdir).mkdir()
            for f, text in (("overrides.yaml", f"- draft.topk={topk}\n- seed=0\n"), ("config.yaml", "{}\n"),
                            ("hydra.yaml", "{}\n")):
                (sweep / name / output_subdir / f).write_text(text)
    main([str(sweep)])
    with open(sweep / "report.csv") as f:
        table = list(csv.DictReader(f))
    assert [(r["job"], r["draft.topk"]) for r in table] == [("1", "2"), ("0", "1")]
    assert list(table[0])[:3] == ["job", "draft.topk", "tokens_per_s"]
    md = (sweep / "report.md").read_text()
    assert "Best: job 1 (draft.topk=2)" in md
    assert ("Fixed in every job: `seed=0`" in md) == (output_subdir != "null")


def test_a_newline_in_a_swept_value_shows_escaped_in_markdown_and_exact_in_csv(tmp_path):
    sweep = tmp_path / "sweep"
    for name, value, tps in (("0", "a\nb", 5.0), ("1", "a b", 6.0)):
        (sweep / name / ".hydra").mkdir(parents=True)
        (sweep / name / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"+tag={value}"]))
        (sweep / name / "metrics.json").write_text(finished(tps, {}))
    main([str(sweep)])
    with open(sweep / "report.csv", newline="") as f:
        assert [r["tag"] for r in csv.DictReader(f)] == ["a b", "a\nb"]
    md = (sweep / "report.md").read_text()
    assert "| 0 | a\\nb |" in md and "| 1 | a b |" in md


def test_a_reader_that_stops_early_gets_no_traceback(tmp_path):
    """`python -m specpipe.report DIR | head -1`: the files are written; the closed pipe ends it quietly."""
    sweep = make_sweep(tmp_path / "sweep")
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.Popen([sys.executable, "-m", "specpipe.report", str(sweep)], cwd=root, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p.stdout.close()  # the reader is gone before the report prints anything
    err = p.stderr.read()
    assert p.wait(timeout=120) == 0 and err == "", err
    assert (sweep / "report.md").is_file()


def test_a_job_with_an_error_json_is_failed_even_beside_a_metrics_json(tmp_path, capsys):
    """A job in which every request failed writes metrics.json (0.0 tokens/s) and error.json; so, in folders of
    older versions, does a failed re-run into an earlier sweep's folder. error.json wins: the job is listed with
    the failures, is never Best, and resume=true re-runs it."""
    from specpipe.sweep.report import failure_summary

    sweep = make_sweep(tmp_path / "sweep")
    (sweep / "1" / "error.json").write_text(json.dumps({"error": "every request failed (2 of 2; the first: x)"}))
    main([str(sweep)])
    with open(sweep / "report.csv") as f:
        table = {r["job"]: r for r in csv.DictReader(f)}
    assert table["1"]["tokens_per_s"] == "" and table["1"]["error"] == "every request failed (2 of 2; the first: x)"
    assert "Best: job 2 (draft.topk=4 draft.num_steps=3)" in (sweep / "report.md").read_text()
    assert "5 jobs (3 without metrics)" in capsys.readouterr().out
    summary = failure_summary(sweep, since=float("-inf"))
    assert "job 1 (draft.topk=2 draft.num_steps=3): every request failed" in summary


def test_a_sweep_whose_every_job_failed_has_nothing_to_report(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    for name, slots in (("0", 50), ("1", 60)):
        (sweep / name / ".hydra").mkdir(parents=True)
        (sweep / name / ".hydra" / "overrides.yaml").write_text(f"- allocator.num_slots={slots}\n")
        m = json.loads(finished(0.0, {"allocator": {"num_slots": slots}}))
        m.update(num_requests=2, num_errors=2, request_errors=[{"index": 0, "error": "the KV pool is small"}])
        (sweep / name / "metrics.json").write_text(json.dumps(m))
        (sweep / name / "error.json").write_text(json.dumps({"error": "every request failed (2 of 2; ...)"}))
    with pytest.raises(SystemExit) as e:
        main([str(sweep)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("specpipe.report:") and err.count("\n") == 1
    assert "none finished, so there is nothing to report" in err and "says: every request failed" in err
    assert not (sweep / "report.png").exists()


def test_an_earlier_runs_metrics_json_under_new_overrides_is_unfinished(tmp_path):
    """Folders of older versions: a re-sweep into an earlier sweep's folder that was interrupted (or killed under
    a launcher) in job 0 left that sweep's metrics.json beside the new job's overrides.yaml; its config says
    draft.topk=1 where the job asked for 4, so the job is unfinished, not a finished job with old numbers."""
    from specpipe.sweep.report import failure_summary

    sweep = tmp_path / "sweep"
    for name, topk, ran in (("0", 4, 1), ("1", 2, 2)):
        (sweep / name / ".hydra").mkdir(parents=True)
        (sweep / name / ".hydra" / "overrides.yaml").write_text(  # 016 is Hydra's 16 (YAML 1.1 reads octal 14)
            f"- draft.topk={topk}\n- workload.max_new_tokens=016\n- latency_limit_ms=5\n- model=random_tiny\n")
        config = {"draft": {"topk": ran}, "workload": {"max_new_tokens": 16}, "latency_limit_ms": 20.0,
                  "model": {"name": "random_tiny"}}
        (sweep / name / "metrics.json").write_text(finished(5.0 + topk, config))
    main([str(sweep)])
    with open(sweep / "report.csv") as f:
        table = {r["job"]: r for r in csv.DictReader(f)}
    assert table["1"]["tokens_per_s"] == "7.0" and table["1"]["error"] == ""  # latency_limit_ms does not count
    assert table["0"]["tokens_per_s"] == ""
    assert table["0"]["error"].startswith("unfinished: its metrics.json is an earlier run's (draft.topk=1 there, "
                                          "draft.topk=4 in this job's overrides)")
    assert "Best: job 1 (draft.topk=2)" in (sweep / "report.md").read_text()
    summary = failure_summary(sweep, since=float("-inf"))
    assert summary.startswith("specpipe: 1 of 2 jobs failed:\n  job 0 (draft.topk=4): unfinished: its metrics.json")


def test_a_failed_job_without_overrides_yaml_is_named_by_its_error_json(tmp_path):
    """hydra.output_subdir=null: a failed job has no metrics.json config to tell its point by; error.json records
    the job's overrides, so its row and the end-of-sweep list name its swept value."""
    from specpipe.sweep.report import failure_summary

    sweep = tmp_path / "sweep"
    for name, steps in (("0", 2), ("1", 3)):
        (sweep / name).mkdir(parents=True)
        (sweep / name / "metrics.json").write_text(finished(5.0 + steps, {"draft": {"num_steps": steps}, "seed": 0}))
    (sweep / "2").mkdir()
    (sweep / "2" / "error.json").write_text(json.dumps({
        "error": "specpipe: invalid configuration: draft.num_steps=0 must be between 1 and 128", "crash": False,
        "overrides": ["draft.num_steps=0", "seed=0", "model=random_tiny"]}))
    main([str(sweep)])
    with open(sweep / "report.csv") as f:
        table = {r["job"]: r for r in csv.DictReader(f)}
    assert {j: r["draft.num_steps"] for j, r in table.items()} == {"1": "3", "0": "2", "2": "0"}
    assert "seed" not in table["2"] and "model" not in table["2"]  # the same in every job: not a column
    summary = failure_summary(sweep, since=float("-inf"))
    assert "  job 2 (draft.num_steps=0): invalid configuration: draft.num_steps=0" in summary


def test_override_values_read_as_hydra_reads_them():
    from specpipe.sweep.overrides import hydra_value

    assert hydra_value("a", "010") == "010" and hydra_value("a", "0x10") == "0x10"  # YAML 1.1: 8 and 16
    assert (hydra_value("a", "1e3") == 1000.0 and hydra_value("a", "true") is True
            and hydra_value("a", "[1,2]") == [1, 2])
    assert hydra_value("a", "compile(x") == "compile(x"  # unparsable: the text


def test_a_stopped_re_sweep_does_not_rank_the_earlier_sweeps_jobs_it_did_not_reach(tmp_path, capsys):
    """A re-sweep into the folder of an earlier one of the same size, stopped by Ctrl-C before job 1: job 1 still
    holds the earlier sweep's overrides and results, which are none of the newest sweep's points (multirun.yaml),
    so its row says so and is not ranked, rather than passing for the new sweep's job 1. Values the points compare
    as Hydra parses them: NaN equals NaN, and a preset's ${...} value matches whatever it resolved to."""
    sweep = tmp_path / "sweep"
    (sweep / "multirun.yaml").parent.mkdir(parents=True)
    (sweep / "multirun.yaml").write_text(yaml.safe_dump({"hydra": {
        "sweeper": {"_target_": "hydra._internal.core_plugins.basic_sweeper.BasicSweeper", "params": None},
        "overrides": {"task": ["draft.num_steps=2,3", "workload.max_new_tokens=200", "resume=true"]}}}))
    for name, overrides, tps in (("0", ["draft.num_steps=2", "workload.max_new_tokens=200", "resume=true"], 5.0),
                                 ("1", ["draft.topk=2", "workload.max_new_tokens=8"], 9.0)):  # the earlier sweep's
        (sweep / name / ".hydra").mkdir(parents=True)
        (sweep / name / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
        (sweep / name / "metrics.json").write_text(finished(tps, {}))
    main([str(sweep)])
    with open(sweep / "report.csv") as f:
        table = {r["job"]: r for r in csv.DictReader(f)}
    assert not table["0"]["error"] and table["1"]["tokens_per_s"] == ""
    assert table["1"]["error"].startswith("not the newest sweep's point for its job number (multirun.yaml)")
    assert "Best: job 0" in (sweep / "report.md").read_text()
    main([str(sweep), "--all"])
    with open(sweep / "report.csv") as f:
        assert [r["job"] for r in csv.DictReader(f)] == ["1", "0"]  # ranked again
    from specpipe.sweep.points import is_point, newest_sweep_points

    (sweep / "multirun.yaml").write_text(yaml.safe_dump({"hydra": {
        "sweeper": {"_target_": "hydra._internal.core_plugins.basic_sweeper.BasicSweeper",
                    "params": {"draft.num_steps": "2,${oc.env:STEPS}"}},
        "overrides": {"task": ["latency_limit_ms=nan,50"]}}}))
    points = newest_sweep_points(sweep)
    assert len(points) == 4 and is_point({"draft.num_steps": "7", "latency_limit_ms": "nan"}, points)
    assert not is_point({"latency_limit_ms": "40"}, points)


def test_without_a_hydra_folder_a_swept_group_is_one_column_from_the_recorded_overrides(tmp_path):
    """hydra.output_subdir=null: finished jobs record their point in metrics.json ("overrides"), failed ones in
    error.json, so a swept group (draft=none,eagle) is one `draft` column for every row, not the finished jobs'
    draft.* settings beside a `draft` column only the failed jobs fill."""
    sweep = tmp_path / "sweep"
    for name, draft, ok in (("0", "none", False), ("1", "none", True), ("2", "eagle", False), ("3", "eagle", True)):
        (sweep / name).mkdir(parents=True)
        overrides = [f"draft={draft}", f"allocator.num_slots={4096 if ok else 8}", "seed=0"]
        if ok:
            config = {"draft": {"method": draft, "topk": 1 if draft == "none" else 4}, "seed": 0}
            (sweep / name / "metrics.json").write_text(json.dumps({**json.loads(finished(5.0 + int(name), config)),
                                                                   "overrides": overrides}))
        else:
            (sweep / name / "error.json").write_text(
                json.dumps({"error": "specpipe: too small", "overrides": overrides}))
    main([str(sweep)])
    with open(sweep / "report.csv") as f:
        table = {r["job"]: r for r in csv.DictReader(f)}
    assert {j: (r["draft"], r["allocator.num_slots"]) for j, r in table.items()} == {
        "3": ("eagle", "4096"), "1": ("none", "4096"), "0": ("none", "8"), "2": ("eagle", "8")}
    assert not [k for k in table["3"] if k.startswith("draft.")]
    assert "Fixed in every job: `seed=0`" in (sweep / "report.md").read_text()


def test_a_job_without_step_latency_is_within_the_limit_in_the_column_as_in_the_best_line(tmp_path):
    """max_new_tokens=1 makes no decode step, so no p90: the objective (and the Best line) count the job as within
    the limit, and the column said nothing (blank) while the slower jobs said "no"."""
    sweep = tmp_path / "sweep"
    for name, p90, tps in (("0", None, 9.0), ("1", 50.0, 20.0)):
        (sweep / name / ".hydra").mkdir(parents=True)
        (sweep / name / ".hydra" / "overrides.yaml").write_text(
            f"- workload.max_new_tokens={1 if p90 is None else 8}\n")
        m = json.loads(finished(tps, {"latency_limit_ms": 10.0}))
        (sweep / name / "metrics.json").write_text(json.dumps({**m, "step_latency_ms_p90": p90}))
    main([str(sweep)])
    with open(sweep / "report.csv") as f:
        assert {r["job"]: r["within_latency_limit"] for r in csv.DictReader(f)} == {"1": "no", "0": "yes"}
    assert "Best: job 0 (workload.max_new_tokens=1), 9.0 tokens/s\n" in (sweep / "report.md").read_text()


@pytest.mark.parametrize("output_subdir", ["null", "meta"])
def test_a_re_sweep_with_another_output_subdir_is_read_from_its_own_record(tmp_path, output_subdir):
    """A re-sweep with hydra.output_subdir=null (or another name) leaves the earlier sweep's .hydra in each job
    folder: its overrides were taken for the job's, so the new results read as "an earlier run's" or as no point of
    the newest sweep. The overrides metrics.json records (and the newest Hydra folder) are the job's."""
    sweep = tmp_path / "sweep"
    (sweep / "multirun.yaml").parent.mkdir(parents=True)
    (sweep / "multirun.yaml").write_text(yaml.safe_dump({"hydra": {
        "sweeper": {"_target_": "hydra._internal.core_plugins.basic_sweeper.BasicSweeper", "params": None},
        "overrides": {"task": ["draft.num_steps=2,3"]}}}))
    for name, steps in (("0", 2), ("1", 3)):
        old = sweep / name / ".hydra"
        old.mkdir(parents=True)
        (old / "overrides.yaml").write_text(f"- draft.topk={name}\n")  # the earlier sweep's
        os.utime(old / "overrides.yaml", (time.time() - 1000,) * 2)
        if output_subdir == "meta":
            (sweep / name / "meta").mkdir()
            for f, text in (("overrides.yaml", f"- draft.num_steps={steps}\n"), ("config.yaml", "{}\n"),
                            ("hydra.yaml", "{}\n")):
                (sweep / name / "meta" / f).write_text(text)
        m = json.loads(finished(5.0 + steps, {"draft": {"num_steps": steps, "topk": 1}}))
        (sweep / name / "metrics.json").write_text(json.dumps({**m, "overrides": [f"draft.num_steps={steps}"]}))
    main([str(sweep)])
    with open(sweep / "report.csv") as f:
        table = {r["job"]: r for r in csv.DictReader(f)}
    assert {j: (r["draft.num_steps"], r["error"]) for j, r in table.items()} == {"1": ("3", ""), "0": ("2", "")}


def test_an_earlier_sweeps_job_at_another_number_is_not_ranked(tmp_path):
    """draft.topk=1,2,4, then draft.topk=4,2,1 stopped after job 0: job 2 still holds topk=4 from the first sweep, a
    point of the newest one, but job 0's; the sweeper's order (job i runs point i) tells it apart."""
    sweep = tmp_path / "sweep"
    (sweep / "multirun.yaml").parent.mkdir(parents=True)
    (sweep / "multirun.yaml").write_text(yaml.safe_dump({"hydra": {
        "sweeper": {"_target_": "hydra._internal.core_plugins.basic_sweeper.BasicSweeper", "params": None},
        "overrides": {"task": ["draft.topk=4,2,1"]}}}))
    for name, topk in (("0", 4), ("1", 2), ("2", 4)):
        (sweep / name / ".hydra").mkdir(parents=True)
        (sweep / name / ".hydra" / "overrides.yaml").write_text(f"- draft.topk={topk}\n")
        (sweep / name / "metrics.json").write_text(finished(5.0 + int(name), {"draft": {"topk": topk}}))
    main([str(sweep)])
    with open(sweep / "report.csv") as f:
        table = {r["job"]: r for r in csv.DictReader(f)}
    assert [j for j, r in table.items() if r["error"].startswith("not the newest sweep's point")] == ["2"]
    assert "Best: job 1" in (sweep / "report.md").read_text()


@pytest.mark.parametrize("num_errors", ["1" + "0" * 400, "NaN"])
def test_a_damaged_error_count_gets_no_traceback(tmp_path, num_errors):
    """num_errors past float's range raised an OverflowError; NaN read as "nan of 2 requests failed"."""
    sweep = make_sweep(tmp_path / "sweep")
    m = json.loads((sweep / "0" / "metrics.json").read_text())
    text = json.dumps({**m, "num_requests": 2}).rstrip("}") + f', "num_errors": {num_errors}}}'
    (sweep / "0" / "metrics.json").write_text(text)
    main([str(sweep)])
    with open(sweep / "report.csv") as f:
        row = {r["job"]: r for r in csv.DictReader(f)}["0"]
    assert ("requests failed" in row["error"]) == (num_errors != "NaN"), row


def test_a_report_that_cannot_be_written_whole_changes_none_of_its_files(tmp_path, capsys):
    """report.png could not be written (a folder of that name), but report.csv and report.md had been rewritten
    already: a half-updated set."""
    sweep = make_sweep(tmp_path / "sweep")
    main([str(sweep)])
    before = {n: (sweep / n).read_bytes() for n in ("report.csv", "report.md")}
    m = json.loads((sweep / "0" / "metrics.json").read_text())
    (sweep / "0" / "metrics.json").write_text(json.dumps({**m, "tokens_per_s": 999.0}))  # a different table
    (sweep / "report.png").unlink()
    (sweep / "report.png").mkdir()
    with pytest.raises(SystemExit) as e:
        main([str(sweep)])
    assert e.value.code == 2 and "report.png" in capsys.readouterr().err
    assert {n: (sweep / n).read_bytes() for n in before} == before
    assert not list(sweep.glob(".report*.tmp"))


def test_the_plot_puts_a_job_without_a_finite_acceptance_length_at_one():
    from specpipe.sweep.plot import plotted_acceptance

    assert [plotted_acceptance(v) for v in (2.5, None, float("nan"), float("inf"), 10 ** 400, "x")] == \
        [2.5, 1.0, 1.0, 1.0, 1.0, 1.0]


def test_a_huge_tokens_per_s_prints_in_a_few_digits(tmp_path):
    sweep = make_sweep(tmp_path / "sweep")
    m = json.loads((sweep / "1" / "metrics.json").read_text())
    (sweep / "1" / "metrics.json").write_text(json.dumps({**m, "tokens_per_s": 1e308}))
    main([str(sweep)])
    md = (sweep / "report.md").read_text()
    assert "Best: job 1" in md and "1e+308 tokens/s" in md and "0" * 50 not in md


def test_a_sweep_over_batch_sizes_gets_a_tokens_per_s_by_batch_plot(tmp_path):
    """Varying workload.batch_size adds report_batch.png (a line per policy); a sweep that does not, does not."""
    root = tmp_path / "sweep"
    root.mkdir()
    (root / "multirun.yaml").write_text("hydra: {}\n")
    for i, (pol, b, tps) in enumerate([("static", 1, 10.0), ("static", 4, 30.0), ("cost", 1, 12.0),
                                       ("cost", 4, 29.0)]):
        d = root / str(i)
        (d / ".hydra").mkdir(parents=True)
        (d / ".hydra" / "overrides.yaml").write_text(f"- speculation={pol}\n- workload.batch_size={b}\n")
        (d / "metrics.json").write_text(json.dumps({"tokens_per_s": tps, "accept_length_mean": 1.5,
                                                    "num_verify_steps": 5, "recompiles": 0, "wall_s": 1.0,
                                                    "config": {}}))
    main([str(root), "--out", str(tmp_path / "out")])
    png = (tmp_path / "out" / "report_batch.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    main([str(make_sweep(tmp_path / "other")), "--out", str(tmp_path / "out2")])
    assert not (tmp_path / "out2" / "report_batch.png").exists()
