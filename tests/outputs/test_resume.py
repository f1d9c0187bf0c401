"""resume=true continues a stopped run: the requests its partial file holds are kept, only the rest decode."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import compose
from specpipe.run import run
from specpipe.models.random_tiny import build_random_tiny
from specpipe.outputs.resume import META, PARTIAL

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["workload.max_new_tokens=10", "workload.batch_size=3", "draft.topk=2", "draft.num_steps=3",
          "speculation=static"]  # (every tree verified: requests finish within the steps the stops count)


@pytest.fixture(scope="module")
def pair():
    return build_random_tiny(seed=2, dtype="float64", max_position=128)


def prompts(tmp_path, n=12, seed=4):
    import random

    rng = random.Random(seed)
    path = tmp_path / "p.jsonl"
    lines = [{"prompt": "".join(rng.choice("abcdefgh ()=:") for _ in range(rng.randint(1, 40)))} for _ in range(n)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"prompt": ""}\n')  # the last fails at once
    return path


def tiny(path, *extra) -> list:
    return ["model=random_tiny", "device.dtype=float64", f"workload.prompts_file={path}", *COMMON, *extra]


def stop_after(monkeypatch, steps: int) -> None:
    """Ctrl-C at the given decode step."""
    from specpipe.decode.speculative import SpecPipeline

    real, calls = SpecPipeline.step, []

    def step(self):
        calls.append(1)
        if len(calls) == steps:
            raise KeyboardInterrupt
        return real(self)
    monkeypatch.setattr(SpecPipeline, "step", step)


def run_stopped(monkeypatch, steps: int, out: Path, pair, *args) -> None:
    """A run into out, stopped by Ctrl-C at the given decode step."""
    with monkeypatch.context() as m:
        stop_after(m, steps)
        with pytest.raises(KeyboardInterrupt):
            run(compose(*args), out_dir=str(out), quiet=True, pair=pair)


def records(path: Path) -> list:
    return [json.loads(x) for x in path.read_text().splitlines()]


def same_output(rec: dict, r) -> bool:
    return (rec["output_ids"], rec["finish_reason"], rec.get("error")) == (r.output_ids, r.finish_reason, r.error)


@pytest.mark.parametrize("sampling", [[], ["sampling.temperature=0.9", "sampling.top_k=20"]], ids=["greedy", "sampled"])
def test_a_resumed_run_decodes_only_what_the_stopped_one_left_and_ends_as_an_uninterrupted_run(
        tmp_path, pair, monkeypatch, capsys, sampling):
    path = prompts(tmp_path)
    args = tiny(path, *sampling)
    full = run(compose(*args), quiet=True, pair=pair)
    out = tmp_path / "run"
    run_stopped(monkeypatch, 12, out, pair, *args)
    records_before = records(out / PARTIAL)
    kept = [r for r in records_before if r["finish_reason"] != "error"]
    assert 2 < len(kept) < 12 and (out / META).is_file()
    capsys.readouterr()
    resumed = run(compose(*args, "resume=true"), out_dir=str(out), quiet=True, pair=pair)
    err = capsys.readouterr().err
    assert f"{len(kept)} of 13 requests had finished" in err and f"decoding the other {12 - len(kept)}" in err, err  # (not the empty prompt)
    m = resumed["metrics"]
    assert m["resumed_requests"] == len(kept) and m["num_requests"] == 13
    left = {r.index for r in full["requests"]} - {r["index"] for r in kept}
    # only the others were decoded: their tokens are all this run generated
    assert m["generated_tokens"] == sum(len(full["requests"][i].output_ids) for i in left) < \
        full["metrics"]["generated_tokens"]
    done = records(out / "completions.jsonl")
    assert [r["index"] for r in done] == list(range(13))
    assert all(same_output(rec, r) for rec, r in zip(done, full["requests"]))  # as if never stopped
    assert not (out / PARTIAL).exists() and not (out / META).exists()  # the ordered file holds it all
    assert records(out / (PARTIAL + ".prev")) == records_before  # what it continued from: set aside, not deleted


def test_a_second_stop_keeps_what_the_first_run_finished(tmp_path, pair, monkeypatch):
    """The resumed run writes the carried requests into its own partial file first: stopped again, it loses
    nothing the first run finished."""
    path = prompts(tmp_path)
    args = tiny(path)
    out = tmp_path / "run"
    run_stopped(monkeypatch, 6, out, pair, *args)
    first = {r["index"] for r in records(out / PARTIAL)}
    run_stopped(monkeypatch, 6, out, pair, *args, "resume=true")
    second = {r["index"] for r in records(out / PARTIAL)}
    assert first < second < set(range(13))
    m = run(compose(*args, "resume=true"), out_dir=str(out), quiet=True, pair=pair)["metrics"]
    assert m["resumed_requests"] == len(second) - 1  # (the empty prompt fails again, at once)


@pytest.mark.parametrize("change, why", [
    (["workload.max_new_tokens=9"], "came from a run with other settings"),
    (["sampling.temperature=0.5"], "came from a run with other settings"),
    ("prompts", "came from a run of other prompts"),
    ("no sidecar", f"{META} is missing"),
])
def test_records_of_another_run_are_never_taken(tmp_path, pair, monkeypatch, capsys, change, why):
    path = prompts(tmp_path)
    args = tiny(path)
    out = tmp_path / "run"
    run_stopped(monkeypatch, 12, out, pair, *args)
    again = list(args)
    if change == "prompts":
        path.write_text(path.read_text().replace('{"prompt": ""}', '{"prompt": "x"}'))
    elif change == "no sidecar":
        (out / META).unlink()
    else:
        again += change
    capsys.readouterr()
    m = run(compose(*again, "resume=true"), out_dir=str(out), quiet=True, pair=pair)["metrics"]
    err = capsys.readouterr().err
    assert m["resumed_requests"] == 0 and f"resume: {out}: " in err and why in err and "every request runs again" in err


def test_the_same_prompts_file_named_another_way_resumes(tmp_path, pair, monkeypatch, capsys):
    """workload.prompts_file given relative in one run and absolute in the other (or through a symlink) names the
    same file: it was a changed setting, and every request ran again. The prompts themselves are compared anyway."""
    path = prompts(tmp_path)
    out = tmp_path / "run"
    run_stopped(monkeypatch, 12, out, pair, *tiny(path))
    kept = [r for r in records(out / PARTIAL) if r["finish_reason"] != "error"]
    (tmp_path / "link").symlink_to(tmp_path)
    monkeypatch.chdir(tmp_path / "link")
    capsys.readouterr()
    m = run(compose(*tiny("p.jsonl"), "resume=true"), out_dir=str(out), quiet=True, pair=pair)["metrics"]
    assert m["resumed_requests"] == len(kept) > 0, capsys.readouterr().err
    other = tmp_path / "q.jsonl"  # another file with other prompts still runs everything again
    other.write_text(path.read_text().replace('{"prompt": ""}', '{"prompt": "x"}'))
    run_stopped(monkeypatch, 12, out, pair, *tiny(path))
    m = run(compose(*tiny(other), "resume=true"), out_dir=str(out), quiet=True, pair=pair)["metrics"]
    assert m["resumed_requests"] == 0


def test_damaged_records_decode_again(tmp_path, pair, monkeypatch):
    """A line cut by a kill, a record of a failed request, ids outside the vocabulary or a record whose prompt
    is not the request's: those requests decode again; the sound records are kept."""
    path = prompts(tmp_path)
    args = tiny(path)
    full = run(compose(*args), quiet=True, pair=pair)["requests"]
    out = tmp_path / "run"
    run_stopped(monkeypatch, 12, out, pair, *args)
    recs = [r for r in records(out / PARTIAL) if r["finish_reason"] != "error"]
    assert len(recs) >= 4
    recs[0]["output_ids"] = [10 ** 6]
    recs[1]["prompt"] += "?"
    recs[2].update(finish_reason="error", error="it failed")
    lines = [json.dumps(r) for r in recs]
    lines[3] = lines[3][:len(lines[3]) // 2]  # the line being written when the run was killed
    if len(recs) > 5:
        recs[4]["finish_reason"] = "banana"
        recs[5]["logprobs"] = ["x"] * len(recs[5]["output_ids"])
        lines[4:6] = [json.dumps(r) for r in recs[4:6]]
    (out / PARTIAL).write_text("\n".join(lines) + "\n")
    m = run(compose(*args, "resume=true"), out_dir=str(out), quiet=True, pair=pair)["metrics"]
    assert m["resumed_requests"] == len(recs) - 4 - 2 * (len(recs) > 5)
    assert all(same_output(rec, r) for rec, r in zip(records(out / "completions.jsonl"), full))


def test_a_sweep_job_stopped_part_way_continues_from_its_finished_requests(tmp_path):
    """A sweep job's folder is cleared (set aside as *.prev) before the job runs: its partial file must be read
    first. The stopped job is made by hand from a finished one: its completions.jsonl cut to two records."""
    sweep = tmp_path / "sweep"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    args = [sys.executable, "-m", "specpipe", "-m", "model=random_tiny", "workload.num_prompts=5",
            "workload.max_new_tokens=8", "draft.topk=2", f"hydra.sweep.dir={sweep}",
            "speculation=static"]  # (the records' draft counts are compared: under cost they follow the timings)
    p = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    job = sweep / "0"
    finished = json.loads((job / "metrics.json").read_text())
    done = records(job / "completions.jsonl")
    (job / PARTIAL).write_text("".join(json.dumps(r) + "\n" for r in done[3:]))
    (job / META).write_text(json.dumps({k: finished[k] for k in ("config", "prompts_sha256", "model_files_sha256")}))
    (job / "metrics.json").unlink()
    (job / "completions.jsonl").unlink()
    p = subprocess.run([*args, "resume=true"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert f"resume: {job}: 2 of 5 requests had finished" in p.stderr, p.stderr[-2000:]
    m = json.loads((job / "metrics.json").read_text())
    assert m["resumed_requests"] == 2
    assert m["generated_tokens"] == sum(len(r["output_ids"]) for r in done[:3])
    assert records(job / "completions.jsonl") == done
    assert (job / (PARTIAL + ".prev")).is_file()  # what it continued from is set aside, not deleted


def test_a_run_stopped_after_its_last_request_finished_decodes_nothing(tmp_path, pair, capsys):
    """Stopped while its outputs were written: every request is in the partial file, nothing is left to decode, and
    the run still ends with its ordered completions.jsonl and a metrics.json that reads as finished."""
    from specpipe.sweep.job_files import metrics_problem

    path = prompts(tmp_path)
    args = tiny(path)
    out = tmp_path / "run"
    m = run(compose(*args), out_dir=str(out), quiet=True, pair=pair)["metrics"]
    done = records(out / "completions.jsonl")
    os.replace(out / "completions.jsonl", out / PARTIAL)
    (out / META).write_text(json.dumps({k: m[k] for k in ("config", "prompts_sha256", "model_files_sha256")}))
    (out / "metrics.json").unlink()
    capsys.readouterr()
    again = run(compose(*args, "resume=true"), out_dir=str(out), quiet=False, pair=pair)["metrics"]
    err = capsys.readouterr().err
    assert "12 of 13 requests had finished" in err and "nothing is left to decode" in err, err
    assert again["resumed_requests"] == 12 and again["generated_tokens"] == 0
    assert records(out / "completions.jsonl") == done and metrics_problem(again) is None


def test_a_resumed_suffix_run_drafts_from_the_outputs_the_stopped_run_finished(tmp_path, pair, monkeypatch):
    """draft=suffix matches in a cache of finished requests' outputs: the carried requests join it first, as they
    had in the run that was stopped, so the cache ends as an uninterrupted run's does."""
    path = prompts(tmp_path)
    args = ["model=random_tiny", "device.dtype=float64", f"workload.prompts_file={path}", "draft=suffix",
            "workload.max_new_tokens=10", "workload.batch_size=3"]
    full = run(compose(*args), quiet=True, pair=pair)["metrics"]
    out = tmp_path / "run"
    run_stopped(monkeypatch, 12, out, pair, *args)
    m = run(compose(*args, "resume=true"), out_dir=str(out), quiet=True, pair=pair)["metrics"]
    assert m["resumed_requests"] > 2 and m["draft_cache"] == full["draft_cache"]
    assert full["draft_cache"]["texts_added"] == 12


def test_a_resume_stopped_before_it_decoded_and_one_refused_over_a_setting_lose_nothing(tmp_path, pair, monkeypatch,
                                                                                    capsys):
    """A resumed sweep job sets the folder aside before it loads the model, and a resume with a changed setting
    sets aside the records it refused: a stop there, or the command put right, used to decode every request again.
    The set-aside partial files (*.prev, *.prev.N) are read too."""
    from specpipe.outputs.run_files import clear_outputs

    path = prompts(tmp_path)
    args = tiny(path)
    out = tmp_path / "run"
    run_stopped(monkeypatch, 12, out, pair, *args)
    records_before = records(out / PARTIAL)
    kept = [r for r in records_before if r["finish_reason"] != "error"]
    clear_outputs(str(out))  # as a sweep job does before it runs; then stopped before decoding
    capsys.readouterr()
    run_stopped(monkeypatch, 2, out, pair, *args, "workload.max_new_tokens=9", "resume=true")
    err = capsys.readouterr().err
    assert "came from a run with other settings (workload.max_new_tokens: 10 there, 9 now)" in err, err
    assert records(out / (PARTIAL + ".prev")) == records_before  # the first run's, set aside; beside the refused run's
    assert (out / PARTIAL).is_file()
    m = run(compose(*args, "resume=true"), out_dir=str(out), quiet=True, pair=pair)["metrics"]
    err = capsys.readouterr().err
    assert m["resumed_requests"] == len(kept) and f"{len(kept)} of 13 requests had finished" in err, err


def test_records_of_other_model_files_under_the_same_path_are_not_taken(tmp_path, pair, monkeypatch, capsys):
    from specpipe.outputs.resume import model_files_digest

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"x" * 10)
    before = model_files_digest([folder])
    assert model_files_digest([folder]) == before and model_files_digest([]) != before
    (folder / "model.safetensors").write_bytes(b"y" * 11)  # retrained, saved under the same name
    assert model_files_digest([folder]) != before
    path = prompts(tmp_path)
    args = tiny(path)
    out = tmp_path / "run"
    run_stopped(monkeypatch, 12, out, pair, *args)
    meta = json.loads((out / META).read_text())
    (out / META).write_text(json.dumps({**meta, "model_files_sha256": before}))
    capsys.readouterr()
    m = run(compose(*args, "resume=true"), out_dir=str(out), quiet=True, pair=pair)["metrics"]
    err = capsys.readouterr().err
    assert m["resumed_requests"] == 0 and "came from other model files" in err, err


def test_resume_with_nothing_to_resume_says_so(tmp_path, pair, capsys):
    """A mistyped hydra.run.dir decoded everything again without a word."""
    path = prompts(tmp_path)
    out = tmp_path / "nowhere"
    run(compose(*tiny(path, "resume=true")), out_dir=str(out), quiet=True, pair=pair)
    assert f"resume: {out} holds no {PARTIAL} of a stopped run, so every request runs" in capsys.readouterr().err
