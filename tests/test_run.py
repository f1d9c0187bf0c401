"""Bad inputs fail per request, KV pressure retracts instead of failing, NaN stops only its request."""
import json
import random

import pytest

from helpers import compose
from specpipe.run import run
from specpipe.models.random_tiny import build_random_tiny


def run_on(path, pair, *overrides):
    cfg = compose("model=random_tiny", "device.dtype=float64", f"workload.prompts_file={path}", *overrides)
    return run(cfg, quiet=True, pair=pair)


@pytest.fixture(scope="module")
def pair():
    return build_random_tiny(seed=2, dtype="float64", max_position=128)


def test_bad_requests_fail_alone(tmp_path, pair):
    lines = [json.dumps({"prompt": "def f(x):"}).encode(), json.dumps({"prompt": ""}).encode(),
             b'{"prompt": "\xff\xfe broken"}', json.dumps({"text": "no prompt field"}).encode(),
             json.dumps({"prompt": "x" * 200}).encode(), json.dumps({"prompt_ids": [1, 2, 99999]}).encode(),
             b"{not json", json.dumps({"prompt_ids": [100, 101, 102]}).encode(),
             json.dumps({"prompt": "class A:"}).encode()]
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    out = run_on(path, pair, "workload.max_new_tokens=8")
    reqs = out["requests"]
    assert [r.finish_reason for r in reqs] == ["length", "error", "error", "error", "error", "error", "error",
                                               "length", "length"]
    msgs = [r.error for r in reqs]
    assert "empty prompt" in msgs[1] and "UTF-8" in msgs[2] and '"prompt" field' in msgs[3]
    assert "exceeds the model's context of 128" in msgs[4] and "outside the vocabulary" in msgs[5]
    # the errors found after parsing name their line like the parse errors do
    assert [m.split(":")[0] for m in msgs[1:7]] == [f"line {n}" for n in range(2, 8)], msgs
    assert "not valid JSON" in msgs[6]
    assert out["metrics"]["num_errors"] == 6 and out["metrics"]["kv_leaked_slots"] == 0
    # metrics.json names the first five failures (the console summary prints them)
    assert out["metrics"]["request_errors"] == [{"index": i, "error": msgs[i]} for i in (1, 2, 3, 4, 5)]


def test_text_that_is_not_unicode_fails_only_its_request(tmp_path, pair):
    """JSON's "\\ud800" escape gives a lone surrogate, which no tokenizer can encode (the tokenizers package
    raised TypeError, and a stop string UnicodeEncodeError, ending the whole run with a traceback)."""
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "def f(x):"}\n{"prompt": "a \\ud800 b"}\n'
                    '{"messages": [{"role": "user", "content": "x \\udc80"}]}\n'
                    '{"prompt": "def g():", "stop": ["ok", "\\ud83d"]}\n{"prompt": "emoji \\ud83d\\ude00 fine"}\n')
    out = run_on(path, pair, "workload.max_new_tokens=4")
    reqs = out["requests"]
    assert [r.finish_reason for r in reqs] == ["length", "error", "error", "error", "length"]
    assert (reqs[1].error.startswith('line 2: field "prompt" holds a lone UTF-16 surrogate')
            and "character 2" in reqs[1].error)
    assert 'field "messages[0].content" holds a lone UTF-16 surrogate' in reqs[2].error
    assert 'field "stop[1]" holds a lone UTF-16 surrogate' in reqs[3].error
    assert out["metrics"]["kv_leaked_slots"] == 0


def test_prompt_file_details(tmp_path):
    """A byte-order mark does not cost the first prompt; a prompt's seed has the top-level seed's range (out of
    it, torch wrapped it modulo 2**64, so different seeds gave the same coins)."""
    from specpipe.workload.prompts import read_prompts_file

    path = tmp_path / "p.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "a"}\n{"prompt": "b", "seed": -1}\n'
                     b'{"prompt": "c", "seed": 9223372036854775808}\n'
                     b'{"prompt": "d", "seed": 9223372036854775807}\n')
    items = read_prompts_file(str(path))
    assert items[0] == {"prompt": "a", "where": "line 1"}
    assert items[3] == {"prompt": "d", "seed": 2 ** 63 - 1, "where": "line 4"}
    for i, v in ((1, "-1"), (2, "9223372036854775808")):
        assert items[i]["error"] == f'line {i + 1}: "seed" must be an integer between 0 and 2**63-1, got {v}'
    # files joined by `cat`, the second saved with a byte-order mark: its first line failed as "not valid JSON"
    path.write_bytes(b'{"prompt": "a"}\r\n\xef\xbb\xbf{"prompt": "b"}\r\n\xef\xbb\xbf\r\n')
    assert read_prompts_file(str(path)) == [{"prompt": "a", "where": "line 1"}, {"prompt": "b", "where": "line 2"}]


def mixed_prompts(n, seed=0):
    rng = random.Random(seed)
    return [{"prompt": "".join(rng.choice("abcdefgh ()=:") for _ in range(rng.randint(1, 40)))} for _ in range(n)]


@pytest.mark.parametrize("draft", [["draft.topk=4", "draft.num_steps=3"], ["draft=none"],
                                   # rejection-sampled chains draw with their own coins: a re-admitted request must
                                   # resume the round it was in, not draw its next token with plain decoding's coin
                                   ["draft=standalone", "draft.topk=1", "draft.num_steps=3",
                                    "sampling.temperature=1.0"]],
                         ids=["eagle", "none", "sampled-standalone-chain"])
def test_memory_pressure_outputs_equal_ample_pool(tmp_path, pair, draft):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in mixed_prompts(200)))
    # static: which nodes a step verifies must not depend on timings (under `cost` a sampled run's coins do)
    common = ["workload.max_new_tokens=16", "workload.batch_size=64", "speculation=static", *draft]
    ample = run_on(path, pair, *common, "allocator.num_slots=20000")
    # 200 requests need ~ 200 * (20 + 16 + tree) slots in all; a quarter of that keeps ~50 resident
    tight = run_on(path, pair, *common, "allocator.num_slots=1600", "allocator=paged", "allocator.page_size=16")
    assert [r.output_ids for r in tight["requests"]] == [r.output_ids for r in ample["requests"]]
    assert [r.finish_reason for r in tight["requests"]] == [r.finish_reason for r in ample["requests"]]
    assert all(r.finish_reason in ("length", "stop") for r in tight["requests"])
    assert tight["metrics"]["kv_leaked_slots"] == 0
    assert tight["metrics"]["kv_peak_slots"] <= tight["metrics"]["kv_pool_slots"] == 1600
    assert tight["metrics"]["retractions"] > 0  # running requests really were evicted and recomputed
    assert ample["metrics"]["kv_peak_slots"] > 1600  # the tight pool really was too small for the batch


def test_request_larger_than_the_pool_fails_alone(tmp_path, pair):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "ab"}) + "\n" + json.dumps({"prompt": "q" * 100}) + "\n")
    out = run_on(path, pair, "workload.max_new_tokens=8", "allocator.num_slots=64", "draft=none")
    assert out["requests"][0].finish_reason == "length"
    assert out["requests"][1].finish_reason == "error" and "raise allocator.num_slots" in out["requests"][1].error


NAN_CASES = [("target", ["draft.topk=2", "draft.num_steps=3"]), ("target", ["draft=none"]),
             ("target", ["draft=ngram"]), ("draft", ["draft.topk=2", "draft.num_steps=3"])]


@pytest.mark.parametrize("where,draft", NAN_CASES)
def test_nan_in_one_requests_logits_stops_only_that_request(tmp_path, pair, where, draft):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in mixed_prompts(4, seed=1)))
    common = ["workload.max_new_tokens=12", "workload.batch_size=4", *draft]
    clean = run_on(path, pair, *common)
    calls = {"n": 0}

    def poison(_mod, _inp, out):  # the third forward (a decode step) returns NaN for batch row 1
        calls["n"] += 1
        if calls["n"] == 3 and out.shape[0] > 1:
            out = out.clone()
            out[1] = float("nan")
        return out

    module = pair.target if where == "target" else pair.draft
    handle = module.register_forward_hook(poison)
    try:
        hit = run_on(path, pair, *common)
    finally:
        handle.remove()
    reasons = [r.finish_reason for r in hit["requests"]]
    assert reasons.count("error") == 1
    assert f"the {where}'s logits contained NaN" in hit["requests"][reasons.index("error")].error
    for a, b in zip(hit["requests"], clean["requests"]):
        if a.finish_reason != "error":
            assert a.output_ids == b.output_ids
    assert hit["metrics"]["kv_leaked_slots"] == 0


def test_batch_size_far_above_the_prompt_count_sizes_nothing_for_it(tmp_path, pair, monkeypatch):
    # buffers, the draft state and the weight-layout timing follow the requests the run has: with
    # batch_size=10**6 and 3 prompts they once timed GEMMs over 8 million rows and never finished
    from specpipe.devices.base import Device

    rows_seen = []
    real = Device.lay_out_weights

    def spy(self, models, rows):
        rows_seen.append(rows)
        assert max(rows) <= 3 * 8, f"weight layout timed for {rows} rows"
        return real(self, models, rows)

    monkeypatch.setattr(Device, "lay_out_weights", spy)
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["def f(x):", "class A:", "import os"]))
    res = run_on(path, pair, "workload.batch_size=1000000", "workload.max_new_tokens=6")
    assert rows_seen and all(len(r.output_ids) == 6 for r in res["requests"])
    ref = run_on(path, pair, "workload.batch_size=3", "workload.max_new_tokens=6")
    assert [r.output_ids for r in res["requests"]] == [r.output_ids for r in ref["requests"]]


def test_weight_layout_is_timed_on_the_plain_step_too_where_the_policy_trims_trees():
    """A trimming policy takes plain `batch`-row steps and narrow ones (on ordinary prompts, mostly those); static
    verifies the full tree every step."""
    from specpipe.run import decode_rows

    assert decode_rows(compose("draft=none"), 4) == (4,)
    assert decode_rows(compose("draft=ngram", "speculation=cost", "draft.num_draft_tokens=5"), 4) == (4, 8, 20)
    assert decode_rows(compose("draft=ngram", "speculation=adaptive", "draft.num_draft_tokens=16"), 4) == (4, 16, 64)
    assert decode_rows(compose("draft=ngram", "speculation=static", "draft.num_draft_tokens=5"), 4) == (20,)


@pytest.mark.parametrize("draft", ["draft=eagle", "draft=none", "draft=ngram"])
def test_a_second_eos_id_ends_requests_too(tmp_path, pair, monkeypatch, draft):
    # instruct checkpoints list several EOS ids (config.json / generation_config.json); any of them stops
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["def f(x):", "class A:"]))
    free = run_on(path, pair, draft, "workload.max_new_tokens=12")
    out = free["requests"][0].output_ids
    stop = out[4]
    monkeypatch.setattr(pair.tokenizer, "eos_token_ids", (pair.tokenizer.eos_token_id, stop), raising=False)
    res = run_on(path, pair, draft, "workload.max_new_tokens=12")
    for r, f in zip(res["requests"], free["requests"]):
        cut = f.output_ids.index(stop) + 1 if stop in f.output_ids else len(f.output_ids)
        assert r.output_ids == f.output_ids[:cut]
        assert r.finish_reason == ("stop" if stop in f.output_ids else "length")
    assert res["requests"][0].finish_reason == "stop" and len(res["requests"][0].output_ids) <= 5


def test_per_request_max_new_tokens(tmp_path, pair):
    lines = [{"prompt": "def f(x):", "max_new_tokens": 3}, {"prompt": "def f(x):"},
             {"prompt": "class A:", "max_new_tokens": 50}, {"prompt": "x", "max_new_tokens": "many"},
             {"prompt_ids": [5, 6, 7], "max_new_tokens": 1}, {"prompt": "y", "seed": "7"},
             {"prompt": "z", "max_tokens": 5, "id": "q1"}, {"prompt": "z", "id": "q2", "temperature": 0.7},
             {"prompt": "z", "max_completion_tokens": 4}, {"prompt": "z", "max_tokens": 4, "max_completion_tokens": 5},
             {"prompt": "z", "n_predict": 4}]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    reqs = run_on(path, pair, "workload.max_new_tokens=8", "draft.topk=2", "draft.num_steps=3")["requests"]
    short, full = reqs[0].output_ids, reqs[1].output_ids
    assert len(full) == 8 and short == full[:3] and reqs[0].finish_reason == "length"  # trimmed mid-tree
    assert "max_new_tokens=50 is above the run's workload.max_new_tokens=8" in reqs[2].error
    assert '"max_new_tokens" must be an integer >= 1, got \'many\'' in reqs[3].error
    assert len(reqs[4].output_ids) == 1 and reqs[4].finish_reason == "length"
    assert '"seed" must be an integer between 0 and 2**63-1, got \'7\'' in reqs[5].error  # not silently ignored
    assert reqs[6].max_new_tokens == 5 and reqs[6].error is None  # OpenAI's "max_tokens"
    assert reqs[7].error is None and reqs[7].sampling == (0.7, 1.0, 0, 1.0, 0.0)  # its own temperature, the run's rest
    assert reqs[8].max_new_tokens == 4 and reqs[8].error is None  # OpenAI's newer name
    assert '"max_tokens" and "max_completion_tokens" disagree' in reqs[9].error
    assert ('field "n_predict"=4 is not supported per prompt and would be ignored; use "max_new_tokens"'
            in reqs[10].error)


def test_an_interrupted_run_keeps_every_finished_request(tmp_path, pair, monkeypatch):
    from specpipe.decode.speculative import SpecPipeline

    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in mixed_prompts(12, seed=4)) + '{"prompt": ""}\n')
    common = ["workload.max_new_tokens=10", "workload.batch_size=3", "draft.topk=2", "draft.num_steps=3"]
    full = run_on(path, pair, *common)["requests"]
    real_step, calls = SpecPipeline.step, []

    def step(self):
        calls.append(1)
        if len(calls) == 12:
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(SpecPipeline, "step", step)
    out = tmp_path / "run"
    cfg = compose("model=random_tiny", "device.dtype=float64", f"workload.prompts_file={path}", *common)
    with pytest.raises(KeyboardInterrupt):
        run(cfg, out_dir=str(out), quiet=True, pair=pair)
    saved = [json.loads(x) for x in (out / "completions.partial.jsonl").read_text().splitlines()]
    assert not (out / "metrics.json").exists() and 3 < len(saved) < 13  # some finished, not all
    for rec in saved:  # each as the uninterrupted run finished it
        r = full[rec["index"]]
        assert (rec["output_ids"], rec["finish_reason"], rec.get("error")) == (r.output_ids, r.finish_reason, r.error)
    assert 12 in {rec["index"] for rec in saved}  # the bad prompt, failed before the run, is there too

    monkeypatch.setattr(SpecPipeline, "step", real_step)  # a finished run: only the ordered file remains
    run(cfg, out_dir=str(out), quiet=True, pair=pair)
    assert not (out / "completions.partial.jsonl").exists() and (out / "metrics.json").exists()


def test_outputs_are_written_whole_or_not_at_all(tmp_path):
    """completions.jsonl was written in place: a Ctrl-C or a full disk during the final write left a cut file beside
    the partial one (and, in a reused folder, beside an older metrics.json that resume took as finished)."""
    from specpipe.outputs.files import write_outputs
    from specpipe.decode.request import Request
    from specpipe.workload.tokenizer import ByteTokenizer

    out = tmp_path / "run"
    out.mkdir()
    (out / "completions.jsonl").write_text("earlier\n")
    (out / "completions.partial.jsonl").write_text('{"index": 0}\n')
    good = Request(index=0, prompt="ab", prompt_ids=[97, 98], max_new_tokens=2)
    with pytest.raises(AttributeError):  # the second record cannot be written
        write_outputs(out, {"tokens_per_s": 1.0}, [good, object()], ByteTokenizer())
    assert (out / "completions.jsonl").read_text() == "earlier\n"
    assert (out / "completions.partial.jsonl").read_text() == '{"index": 0}\n'
    assert sorted(f.name for f in out.iterdir()) == ["completions.jsonl", "completions.partial.jsonl"]
    write_outputs(out, {"tokens_per_s": 1.0}, [good], ByteTokenizer())
    assert sorted(f.name for f in out.iterdir()) == ["completions.jsonl", "metrics.json"]
    assert json.loads((out / "completions.jsonl").read_text())["index"] == 0


def test_lines_that_are_not_one_prompt_object_say_what_they_are(tmp_path):
    from specpipe.workload.prompts import read_prompts_file

    path = tmp_path / "p.jsonl"
    path.write_text('[1, 2]\n"def f():"\n5\nnull\n{"prompt": "a", "messages": []}\n{"prompt": "ok"}\n')
    items = read_prompts_file(str(path))
    kinds = ["an array", "a string", "a number", "null"]
    for n, (it, kind) in enumerate(zip(items, kinds), 1):
        assert it["error"].startswith(f'line {n}: is {kind}; each prompt is a JSON object: {{"prompt": "..."}}')
    assert items[4]["error"] == ("line 5: has both 'prompt' and 'messages'; give one of \"prompt\", \"prompt_ids\" "
                                 "and \"messages\"")
    assert items[5] == {"prompt": "ok", "where": "line 6"}


def test_null_prompt_and_chat_fields_are_absent_ones(tmp_path):
    # a dataset exported with pandas (to_json(orient="records", lines=True)) or HF datasets writes null for the
    # columns a row does not use: such lines failed with "has both 'prompt' and 'prompt_ids'"
    from specpipe.workload.prompts import read_prompts_file

    path = tmp_path / "p.jsonl"
    rows = [{"prompt": "a", "prompt_ids": None, "messages": None, "tools": None, "chat_template_kwargs": None},
            {"prompt": None, "prompt_ids": [1, 2], "messages": None},
            {"prompt": None, "prompt_ids": None, "messages": [{"role": "user", "content": "hi"}], "tools": None},
            {"prompt": None, "prompt_ids": None, "messages": None}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    items = read_prompts_file(str(path))
    assert items[0] == {"prompt": "a", "where": "line 1"}
    assert items[1] == {"prompt": "", "prompt_ids": [1, 2], "where": "line 2"}
    assert items[2]["messages"] == rows[2]["messages"] and "error" not in items[2] and "chat" not in items[2]
    assert items[3]["error"].startswith('line 4: missing the "prompt" field')


def test_openai_fields_that_would_do_nothing_fail_the_request_unless_neutral(tmp_path):
    from specpipe.workload.prompts import read_prompts_file

    path = tmp_path / "p.jsonl"
    lines = [{"prompt": "a", "presence_penalty": 0, "frequency_penalty": 0.0, "n": 1, "logit_bias": {},
              "logprobs": False}, {"prompt": "b", "presence_penalty": 0.5}, {"prompt": "c", "n": 2},
             {"prompt": "d", "logit_bias": {"50256": -100}}, {"prompt": "e", "logprobs": True},
             {"prompt": "f", "min_tokens": 8}, {"prompt": "g", "n": True}, {"prompt": "h", "stop_token_ids": []}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    items = read_prompts_file(str(path))
    assert "error" not in items[0]
    assert 'line 2: field "presence_penalty"=0.5 is not supported per prompt and would be ignored' in items[1]["error"]
    assert items[1]["prompt"] == "b"  # a refused request's completion still says which prompt it was
    assert 'field "n"=2' in items[2]["error"] and "different \"seed\" values" in items[2]["error"]
    assert 'field "logit_bias"' in items[3]["error"] and items[4]["run_wide"] == ["logprobs"]  # the run decides
    assert 'field "min_tokens"=8' in items[5]["error"] and 'field "n"=true' in items[6]["error"]
    assert "error" not in items[7] and "stop_token_ids" not in items[7]  # [] stops nothing more: neutral


@pytest.mark.parametrize("pool", [["allocator=paged", "allocator.page_size=16", "allocator.num_slots=1024"],
                                  ["allocator=hisparse", "allocator.num_slots=160", "model.sparse_top_k=8",
                                   "model.sparse_local=4"]], ids=["paged", "hisparse"])
def test_admission_leaves_room_for_the_next_step(tmp_path, pair, monkeypatch, pool):
    """A request is admitted only when its prefill and the next step (every request's growth, or the drafts'
    scratch) both fit; admitting on the prefill alone evicted it again in the very next step (the paged
    allocator's scratch is whole pages per request): prefill, retract, prefill again, over and over."""
    from specpipe.decode.pipeline import Pipeline

    admitted, bounced = [], []
    admit, make_room = Pipeline.admit, Pipeline.make_room

    def spy_admit(self, reqs):
        ok = admit(self, reqs)
        admitted[:] = [r.index for r in reqs] if ok else []
        return ok

    def spy_make_room(self):
        out = make_room(self)
        bounced.extend(r.index for r in out if r.index in admitted)
        admitted.clear()
        return out

    monkeypatch.setattr(Pipeline, "admit", spy_admit)
    monkeypatch.setattr(Pipeline, "make_room", spy_make_room)
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in mixed_prompts(48, seed=3)))
    sparse = "allocator=hisparse" in pool  # (a hisparse run decodes after its first forward through host ids)
    out = run_on(path, None if sparse else pair, "workload.max_new_tokens=24", "workload.batch_size=16",
                 "draft.topk=4", "draft.num_steps=3", *pool)
    assert out["metrics"]["retractions"] > 0 and out["metrics"]["num_errors"] == 0  # the pool is tight
    assert bounced == []


def test_a_request_the_pool_cannot_finish_says_what_it_needs(tmp_path, pair):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt_ids": list(range(3, 67))}) + "\n")
    out = run_on(path, pair, "workload.max_new_tokens=60", "workload.ignore_eos=true", "draft.topk=4",
                 "draft.num_steps=3", "allocator=paged", "allocator.page_size=16", "allocator.num_slots=240")
    r = out["requests"][0]
    assert r.finish_reason == "error" and r.output_ids  # decoded while it fitted; those tokens are kept
    assert f"after {len(r.output_ids)} generated tokens, which are kept" in r.error
    assert "slots of draft scratch" in r.error and "raise allocator.num_slots to at least" in r.error
    need = int(r.error.split("at least ")[1].split()[0])
    done = run_on(path, pair, "workload.max_new_tokens=60", "workload.ignore_eos=true", "draft.topk=4",
                  "draft.num_steps=3", "allocator=paged", "allocator.page_size=16", f"allocator.num_slots={need}")
    assert done["requests"][0].finish_reason == "length"  # the size it names is enough


def test_a_full_disk_loses_no_decoding_and_says_what_was_not_kept(tmp_path, pair, monkeypatch, capsys):
    """ENOSPC while a request's record is streamed out: decoding goes on (one warning); ENOSPC at the end: the
    summary still prints and the error is one paragraph with exit code 1, not a chain of tracebacks."""
    import errno

    from specpipe import run as app
    from specpipe.errors import OutputError

    class FullFile:
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self):
            pass

        def close(self):
            raise OSError(errno.ENOSPC, "No space left on device")

    real_init = app.PartialCompletions.__init__

    def full_partial(self, out, tokenizer, *meta):
        real_init(self, out, tokenizer, *meta)
        self.f.close()
        self.f = FullFile()

    monkeypatch.setattr(app.PartialCompletions, "__init__", full_partial)
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in mixed_prompts(3)))
    cfg = compose("model=random_tiny", f"workload.prompts_file={path}", "workload.max_new_tokens=6",
                  "workload.ignore_eos=true")
    out = run(cfg, out_dir=str(tmp_path / "a"), quiet=True, pair=pair)  # the end-of-run files still fit
    assert out["metrics"]["generated_tokens"] == 18 and (tmp_path / "a" / "metrics.json").exists()
    assert capsys.readouterr().err.count("warning: cannot write") == 1

    def full_disk(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(app, "write_outputs", full_disk)
    with pytest.raises(OutputError) as e:
        run(cfg, out_dir=str(tmp_path / "b"), quiet=False, pair=pair)
    assert e.value.exit_code == 1 and "could not be written to" in str(e.value) and "No space left" in str(e.value)
    assert "tokens/s" in capsys.readouterr().out  # the summary of the finished run was printed first


def test_prompt_files_as_users_write_them_by_mistake_or_by_openai_habit(tmp_path):
    """null for a request's limit or stop strings means the run's (OpenAI clients send it); a line nested too deeply
    for the JSON reader fails alone (it was a RecursionError ending the run); a JSON array, or a text file with a
    number on one line, is the wrong format (exit 2), not a run of per-line errors; "stop_token_id" is noted."""
    from specpipe.errors import InputError
    from specpipe.workload.prompts import near_miss, read_prompts_file

    path = tmp_path / "p.jsonl"
    deep = '{"prompt": "a", "meta": ' + "[" * 5000 + "]" * 5000 + "}"
    path.write_text(json.dumps({"prompt": "a", "max_tokens": None, "max_new_tokens": None, "stop": None}) + "\n"
                    + deep + "\n" + json.dumps({"prompt": "b"}) + "\n")
    items = read_prompts_file(str(path))
    assert items[0] == {"prompt": "a", "where": "line 1"}
    assert items[1]["error"] == "line 2: JSON nested too deeply to read" and items[2]["prompt"] == "b"
    for name, text in (("a.json", '[\n  {"prompt": "a"},\n  {"prompt": "b"}\n]\n'),
                       ("one.json", '[{"prompt": "a"}, {"prompt": "b"}]\n')):
        (tmp_path / name).write_text(text)
        with pytest.raises(InputError, match="holds a JSON array, not JSON lines"):
            read_prompts_file(str(tmp_path / name))
    (tmp_path / "p.txt").write_text("What is 2+2?\n42\nWrite a poem\n")
    with pytest.raises(InputError, match="none of its 3 non-blank lines is a UTF-8 JSON object"):
        read_prompts_file(str(tmp_path / "p.txt"))
    assert near_miss("stop_token_id", {}) == "stop_token_ids" and near_miss("prompt_id", {}) is None


def test_a_pipe_is_a_prompts_file_read_once_for_every_job(tmp_path):
    """<(zcat prompts.jsonl.gz), /dev/stdin or a FIFO: "is not a readable file" refused them, and a pipe gives its
    bytes once, so each job of an in-process sweep must get them from the first read."""
    import os
    import threading

    from specpipe.config.validate import validate
    from specpipe.workload.prompts import read_prompts_file

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_text('{"prompt": "a"}\n{"prompt": "b"}\n'))
    writer.start()
    validate(compose("model=random_tiny", f"workload.prompts_file={fifo}"))  # no error, and nothing read
    first = read_prompts_file(str(fifo))
    writer.join(timeout=10)
    assert [it["prompt"] for it in first] == ["a", "b"] and read_prompts_file(str(fifo)) == first


def test_compressed_or_utf16_files_say_so_and_a_limit_stops_reading(tmp_path):
    import gzip

    from specpipe.errors import InputError
    from specpipe.workload.prompts import load_prompts, read_prompts_file

    line = json.dumps({"prompt": "a"}) + "\n"
    (tmp_path / "p.jsonl.gz").write_bytes(gzip.compress(line.encode()))
    with pytest.raises(InputError, match=r"is gzip-compressed \(give it as a pipe"):
        read_prompts_file(str(tmp_path / "p.jsonl.gz"))
    (tmp_path / "p16.jsonl").write_bytes(line.encode("utf-16"))
    with pytest.raises(InputError, match="is UTF-16 text"):
        read_prompts_file(str(tmp_path / "p16.jsonl"))
    (tmp_path / "many.jsonl").write_text(line * 3 + "{not json\n" * 1000)  # lines past the limit are not parsed
    assert load_prompts(str(tmp_path / "many.jsonl"), "code", 3) == [{"prompt": "a", "where": f"line {n}"}
                                                                     for n in (1, 2, 3)]
    (tmp_path / "typo.jsonl").write_text(json.dumps({"promt": "a"}) + "\n")
    assert read_prompts_file(str(tmp_path / "typo.jsonl"))[0]["error"].endswith('did you mean "prompt" for "promt"?')


def test_a_prompt_far_beyond_the_context_fails_before_it_is_tokenized(monkeypatch):
    """A 100 MB prompt was tokenized whole (18 s, 2.8 GB) before its "too long" error."""
    from specpipe.decode.requests import make_requests
    from specpipe.workload.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    calls = []
    encode = tok.encode
    monkeypatch.setattr(tok, "encode", lambda text: calls.append(len(text)) or encode(text))
    reqs = make_requests([{"prompt": "x" * (1024 * 64 + 1)}, {"prompt": "ok"}], tok, 4, 64, tok.vocab_size)
    assert reqs[0].finish_reason == "error" and "far more than the model's context of 64 tokens" in reqs[0].error
    assert calls == [2] and reqs[1].finish_reason is None


def test_a_prompts_file_with_bare_cr_line_ends_or_only_unreadable_lines(tmp_path):
    """A file saved with classic Mac line ends (a bare CR, no LF anywhere) reads as its lines; it was one line of
    'Extra data'. A file whose every line is nested too deeply to read is the wrong format (exit 2), as a file of
    every other unreadable line is, not a run whose requests all fail."""
    from specpipe.errors import InputError
    from specpipe.workload.prompts import read_prompts_file

    path = tmp_path / "mac.jsonl"
    path.write_bytes(b'{"prompt": "a"}\r{"prompt": "b"}\r\r{"prompt": "c"}\r')
    assert [it["prompt"] for it in read_prompts_file(str(path))] == ["a", "b", "c"]
    crlf = tmp_path / "crlf.jsonl"
    crlf.write_bytes(b'{"prompt": "a"}\r\n{"prompt": "b"}\r\n')
    assert [(it["prompt"], it["where"]) for it in read_prompts_file(str(crlf))] == [("a", "line 1"), ("b", "line 2")]
    deep = tmp_path / "deep.jsonl"
    deep.write_text(("[" * 5000 + "]" * 5000 + "\n") * 2)
    with pytest.raises(InputError, match="none of its 2 non-blank lines is a UTF-8 JSON object"):
        read_prompts_file(str(deep))


def test_a_refused_long_prompt_sizes_no_buffer(tmp_path, pair, monkeypatch):
    # a prompt refused as too long for the context once sized every per-row buffer (the block table, the n-gram
    # token table, the penalty context) for its length: one stray 100k-token document cost gigabytes on a real model
    from specpipe import run as app

    sizes = []
    real = app.build_pipeline

    def spy(*a, **k):
        pipe = real(*a, **k)
        sizes.append(pipe.prep.table.shape[1])
        return pipe

    monkeypatch.setattr(app, "build_pipeline", spy)
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "def f(x):"}) + "\n" + json.dumps({"prompt": "x" * 100000}) + "\n")
    out = run_on(path, pair, "draft=ngram", "workload.max_new_tokens=6")
    assert [r.finish_reason for r in out["requests"]] == ["length", "error"]
    assert sizes and sizes[0] < 1000, sizes


def test_typo_checks_run_once_per_column_not_per_line(tmp_path, monkeypatch):
    # every line of a dataset repeats its columns: difflib on each key of each line was most of the time a
    # million-line prompts file took to read
    import difflib

    from specpipe.workload.prompts import read_prompts_file

    calls = []
    real = difflib.get_close_matches
    monkeypatch.setattr(difflib, "get_close_matches", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"p{i}", "source_doc_url": "u", "max_new_tokenz": 3}) + "\n"
                            for i in range(50)))
    items = read_prompts_file(str(path))
    assert all(it["ignored_fields"] == {"max_new_tokenz": "max_new_tokens"} for it in items)
    assert len(calls) <= 2, f"{len(calls)} typo checks for 2 columns"


def test_a_chat_set_on_a_model_without_a_chat_template_is_a_config_error():
    from specpipe.errors import ConfigError
    from specpipe.run import run
    from helpers import compose

    with pytest.raises(ConfigError, match="workload.prompt_set=chat holds chats"):
        run(compose("model=tiny", "workload.prompt_set=chat", "workload.num_prompts=1"), quiet=True)
