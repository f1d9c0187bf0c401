"""python -m specpipe.report on a hand-made sweep dir: CSV rows, markdown sorted by tokens/s, a real PNG."""
import csv
import json

import pytest

from specpipe.report import UNFINISHED, main

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
    assert "11 jobs (8 without metrics)" in capsys.readouterr().out


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
        (target / "0" / "error.json").write_text(json.dumps({"error": "specpipe: bad topk"}))
    with pytest.raises(SystemExit) as e:
        main([str(target)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("specpipe.report:") and err.count("\n") == 1  # one paragraph
    assert ("no metrics.json" in err) != (setup == "missing")
    if setup == "only_failed":
        assert "specpipe: bad topk" in err


def test_latency_limited_sweep_picks_the_fastest_job_within_the_limit(tmp_path):
    sweep = make_sweep(tmp_path, latency_limit_ms=10.0)
    main([str(sweep)])
    with open(sweep / "report.csv") as f:
        table = list(csv.DictReader(f))
    assert [r["job"] for r in table] == ["1", "2", "0", "3", "10"]  # still sorted by tokens/s
    assert [r["within_latency_limit"] for r in table] == ["no", "no", "yes", "", ""]
    assert "Best: job 0 (draft.topk=1 draft.num_steps=3), 310.0 tokens/s" in (sweep / "report.md").read_text()


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
    assert "Best: job 2 (draft.topk=4 draft.num_steps=3), 402.2 tokens/s" in (tmp_path / "out" / "report.md").read_text()


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
