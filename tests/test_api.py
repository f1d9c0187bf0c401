"""The Python API: overrides as on the command line, weights loaded once, completions in prompt order,
equal to what the CLI's run() decodes; bad prompts fail alone, bad overrides raise the CLI's message."""
import json
import re
import weakref
from pathlib import Path

import pytest

from helpers import compose
from specpipe import SpecPipe, SpecpipeError  # the error class is exported where the API is
from specpipe.models.cache import MODEL_LOADS
from specpipe.run import run

BASE = ("model=random_tiny", "device.dtype=float64", "workload.max_new_tokens=12")
PROMPTS = ["def f(x):", "class A:\n    ", "import os"]


def test_generate_equals_the_cli_run_and_loads_weights_once(tmp_path):
    sp = SpecPipe(*BASE, "draft.topk=2", "draft.num_steps=3", "speculation=static")  # (drafts verified every step)
    loads = MODEL_LOADS[0]
    got = sp.generate(PROMPTS + [[5, 6, 7]])
    assert sp.metrics["accept_length_mean"] > 1 and sp.metrics["num_requests"] == 4
    again = sp.generate(PROMPTS[:1], max_new_tokens=4)
    assert MODEL_LOADS[0] == loads  # no reload between calls
    text = got[0].text
    stopped = sp.generate(PROMPTS[:1], stop=text[4:6])[0]
    assert stopped.finish_reason == "stop" and text[4:6] in stopped.text and len(stopped.output_ids) <= 6
    with pytest.raises(SpecpipeError, match="stop must be a non-empty string"):
        sp.generate(PROMPTS[:1], stop=[""])
    assert again[0].output_ids == got[0].output_ids[:4] and again[0].finish_reason in ("length", "stop")

    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS) + json.dumps({"prompt_ids": [5, 6, 7]}))
    ref = run(compose(*BASE, "draft=none", f"workload.prompts_file={path}"), quiet=True)["requests"]
    assert [c.output_ids for c in got] == [r.output_ids for r in ref]  # lossless, and in prompt order
    assert [c.prompt for c in got[:3]] == PROMPTS and got[0].text == sp.tokenizer.decode(got[0].output_ids)


def test_bad_prompts_fail_alone_and_out_dir_gets_the_files(tmp_path):
    sp = SpecPipe(*BASE, "draft=ngram")
    out = sp.generate(["ok", "", {"prompt_ids": "abc"}, {"messages": [{"role": "user", "content": "hi"}]},
                       {"text": "x"}], out_dir=str(tmp_path / "run"))
    assert [c.finish_reason for c in out][1:] == ["error"] * 4 and out[0].finish_reason in ("length", "stop")
    assert (out[1].error.startswith("prompt 1: empty prompt")
            and 'prompt 2: "prompt_ids" must be a list of integers' in out[2].error)
    assert "no chat template" in out[3].error and 'prompt 4: missing the "prompt" field' in out[4].error
    assert (tmp_path / "run" / "metrics.json").exists() and (tmp_path / "run" / "completions.jsonl").exists()


@pytest.mark.parametrize("overrides,fragment", [
    (("allocator=foo",), "config group 'allocator' has no option 'foo'"),
    (("draft.topk=0",), "draft.topk=0 must be between 1 and 1024"),
    (("topk",), "overrides are 'key=value' strings"),
])
def test_bad_overrides_raise_the_cli_message(overrides, fragment):
    with pytest.raises(SpecpipeError, match=fragment):
        SpecPipe("model=random_tiny", *overrides)


@pytest.mark.parametrize("override", ["allocator._target_=specpipe.run.json.dumps",
                                      "model._target_=specpipe.run.torch.load",
                                      "allocator._target_=specpipe.allocators.swa.SWAAllocator",
                                      "allocator._target_=specpipe.nonexistent.Foo"])
def test_a_target_outside_the_schemas_is_refused_by_the_constructor(override):
    """Issue #46: SpecPipe("allocator._target_=specpipe.app.json.dumps") was accepted, and generate() raised
    Hydra's InstantiationException; now the constructor raises the CLI's message, before loading anything."""
    key, value = override.split("=")
    loads = MODEL_LOADS[0]
    with pytest.raises(SpecpipeError, match=re.escape(f"{key}={value!r} is refused: a config builds only the class")):
        SpecPipe("model=random_tiny", override)
    assert MODEL_LOADS[0] == loads


def test_a_target_changed_after_the_constructor_is_refused_by_generate():
    sp = SpecPipe(*BASE, "draft=none")
    sp.cfg.allocator._target_ = "specpipe.run.json.dumps"
    with pytest.raises(SpecpipeError, match=re.escape("allocator._target_='specpipe.run.json.dumps' is refused")):
        sp.generate(PROMPTS[:1])


@pytest.mark.parametrize("override,key", [
    ("hydra.run.dir=/tmp/somewhere", "hydra.run.dir"), ("hydra.job.chdir=true", "hydra.job.chdir"),
    ("hydra/launcher=joblib", "hydra/launcher"), ("workload.prompts_file=-", "workload.prompts_file"),
    ("workload.prompt_set=heldout", "workload.prompt_set"), ("+workload.num_prompts=3", "workload.num_prompts"),
])
def test_overrides_the_api_never_reads_are_refused(override, key):
    """SpecPipe writes no Hydra run folder and takes its prompts as arguments: these settings did nothing,
    silently (a user looked for outputs in hydra.run.dir)."""
    with pytest.raises(SpecpipeError, match=f"invalid override {re.escape(override)}: SpecPipe does not read "
                                            f"{re.escape(key)} "):
        SpecPipe("model=random_tiny", override)


def test_hydra_searchpath_is_still_read_by_the_api(tmp_path):
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text("# @package _global_\ndraft:\n  topk: 3\n")
    sp = SpecPipe("model=random_tiny", f"hydra.searchpath=[file://{tmp_path}]", "+experiment=mine")
    assert sp.cfg.draft.topk == 3


@pytest.mark.parametrize("overrides,fragment", [
    (("model=hf", f"model.path={Path(__file__).resolve().parents[1]}/specpipe/assets/tiny/target", "draft=eagle"),
     "draft=eagle needs an EAGLE head"),
    (("model=tiny", "draft=standalone"), "draft=standalone needs draft.path=DIR"),
    (("model=random_tiny", "allocator=swa"), "has no sliding-window layers"),
    (("model=random_tiny", "model.sliding_window=64", "allocator=swa", "allocator.window=32"),
     "allocator.window=32 is smaller than the model's sliding window of 64"),
])
def test_model_dependent_refusals_come_from_the_constructor(overrides, fragment):
    """What generate() would refuse because of the loaded model is refused by SpecPipe(...) already, before
    a program builds on the object."""
    with pytest.raises(SpecpipeError, match=fragment):
        SpecPipe(*overrides)


def test_a_short_context_model_builds_and_generate_bounds_max_new_tokens():
    """The default workload.max_new_tokens (64) is no reason to refuse a 48-token model in the constructor: a call
    may ask for fewer. One that does not is refused then; an explicit override is still refused up front."""
    sp = SpecPipe("model=random_tiny", "model.max_position=48", "device.dtype=float64")
    out = sp.generate(["ab"], max_new_tokens=8)
    assert out[0].finish_reason == "length" and len(out[0].output_ids) == 8
    with pytest.raises(SpecpipeError,
                       match="max_new_tokens=64 leaves no room for a prompt in the model's context of 48"):
        sp.generate(["ab"])
    with pytest.raises(SpecpipeError, match="max_new_tokens=64 leaves no room"):
        SpecPipe("model=random_tiny", "model.max_position=48", "workload.max_new_tokens=64")


def test_numpy_and_torch_values_are_numbers_too():
    """Ids and settings often come out of numpy or torch: their scalars and 1-D arrays are accepted (they were
    refused as "not a list of integers" / "not an integer")."""
    import numpy as np
    import torch

    sp = SpecPipe("model=random_tiny", "draft=none")
    plain = sp.generate([[5, 6, 7], "x"], max_new_tokens=4)
    out = sp.generate([np.array([5, 6, 7]), torch.tensor([5, 6, 7]), [np.int64(5), np.int32(6), 7],
                       {"prompt": "x", "seed": np.int64(1)}], max_new_tokens=np.int64(4),
                      temperature=np.float32(0.0), top_k=np.int64(5))  # greedy: equal outputs
    assert [o.error for o in out] == [None] * 4
    assert out[0].output_ids == out[1].output_ids == out[2].output_ids == plain[0].output_ids
    assert all(type(t) is int for o in out for t in o.output_ids)
    with pytest.raises(SpecpipeError, match="on_event=5 must be a function"):
        sp.generate(["x"], on_event=5)
    zero_d = sp.generate([[torch.tensor(5), torch.tensor(6), np.int64(7)]], max_new_tokens=4)  # ids of a tensor
    assert zero_d[0].error is None and zero_d[0].output_ids == plain[0].output_ids
    floats = sp.generate(torch.tensor([104.0, 105.0]), max_new_tokens=4)  # one prompt of ids, not two texts
    assert len(floats) == 1 and '"prompt_ids" must be a list of integers' in floats[0].error
    # the call's own settings as 0-d tensors / arrays, as a prompt dict's already were (they were refused)
    sampled = sp.generate(["x"], max_new_tokens=6, seed=3, temperature=0.5, top_k=20)
    tensors = sp.generate(["x"], max_new_tokens=torch.tensor(6), seed=np.array(3), temperature=torch.tensor(0.5),
                          top_k=torch.tensor(20))
    assert tensors[0].output_ids == sampled[0].output_ids and len(sampled[0].output_ids) == 6
    with pytest.raises(SpecpipeError, match="seed=.* must be an integer"):
        sp.generate(["x"], seed=torch.tensor([3, 4]))


@pytest.mark.parametrize("kwargs", [{"seed": 10 ** 5000}, {"max_new_tokens": 10 ** 5000}, {"top_k": -10 ** 5000},
                                    {"temperature": 10 ** 5000}, {"stop": ["x", 10 ** 5000]}])
def test_integers_too_long_to_print_are_refused_by_name(kwargs):
    """Python refuses to print an int of over 4300 digits: the error about it raised a raw ValueError from its own
    f-string (and temperature an OverflowError)."""
    sp = SpecPipe("model=random_tiny", "draft=none")
    with pytest.raises(SpecpipeError, match=r"is an integer of about 5001 digits, beyond any valid value"):
        sp.generate(["x"], **{"max_new_tokens": 2, **kwargs})
    out = sp.generate([{"prompt": "x", **kwargs}, [1, 10 ** 5000],
                       {"prompt": "x", "stop_token_ids": [10 ** 5000]}, "x"], max_new_tokens=2)
    assert [o.finish_reason for o in out] == ["error", "error", "error", "length"]  # each fails alone
    assert "prompt 1: field 'prompt_ids'[1] is an integer of about 5001 digits" in out[1].error
    assert "prompt 2: field 'stop_token_ids'[0]" in out[2].error


def test_bad_generate_arguments():
    sp = SpecPipe("model=random_tiny")
    with pytest.raises(SpecpipeError, match="max_new_tokens=0 must be an integer >= 1"):
        sp.generate(["x"], max_new_tokens=0)
    with pytest.raises(SpecpipeError, match=r"generate\(\) needs at least one prompt"):
        sp.generate([])
    with pytest.raises(SpecpipeError, match=r"stream\(\) needs at least one prompt"):
        sp.stream([])
    with pytest.raises(SpecpipeError, match="stop string '\\\\ud800' holds a lone UTF-16 surrogate"):
        sp.generate(["x"], stop=["\ud800"])
    out = sp.generate(["x", "bad \ud800"], max_new_tokens=2)
    assert out[0].finish_reason == "length" and "prompt 1: the text holds a lone UTF-16 surrogate" in out[1].error


def test_stream_events_add_up_to_the_completions():
    import threading

    sp = SpecPipe(*BASE, "draft.topk=2", "draft.num_steps=3")
    prompts = PROMPTS + [""]
    want = sp.generate(prompts, max_new_tokens=30)
    events = list(sp.stream(prompts, max_new_tokens=30))
    for c in want:
        mine = [e for e in events if e.index == c.index]
        assert [t for e in mine for t in e.token_ids] == c.output_ids
        assert "".join(e.text for e in mine) == c.text
        assert mine[-1].finish_reason == c.finish_reason and all(e.finish_reason is None for e in mine[:-1])
    assert len([e for e in events if e.index == 0]) > 2  # really incremental, not one event at the end
    assert [e.error for e in events if e.index == 3] == [want[3].error] and "empty prompt" in want[3].error
    assert events[0].index == 3  # a prompt that fails before decoding is told first, not after all decoding

    it = sp.stream(PROMPTS * 3, max_new_tokens=40)
    next(it)
    it.close()  # leaving early stops the worker thread
    assert not any(t.name == "specpipe-stream" for t in threading.enumerate())
    assert sp.generate(PROMPTS[:1], max_new_tokens=30)[0].output_ids == want[0].output_ids


def test_per_call_sampling():
    sp = SpecPipe(*BASE, "draft.topk=2", "draft.num_steps=3")
    greedy = sp.generate(PROMPTS, max_new_tokens=16)
    hot = sp.generate([{"prompt": p, "seed": 3} for p in PROMPTS], max_new_tokens=16, temperature=1.5, top_k=40)
    assert sp.metrics["sampling"]["temperature"] == 1.5 and sp.metrics["sampling"]["top_k"] == 40
    assert [c.output_ids for c in hot] != [c.output_ids for c in greedy]
    again = sp.generate([{"prompt": p, "seed": 3} for p in PROMPTS], max_new_tokens=16, temperature=1.5, top_k=40)
    assert [c.output_ids for c in again] == [c.output_ids for c in hot]  # seeded: reproducible
    assert sp.generate(PROMPTS, max_new_tokens=16)[0].output_ids == greedy[0].output_ids  # the call's own setting
    with pytest.raises(SpecpipeError, match=r"temperature=-1 must be a number >= 0 and finite"):
        sp.generate(PROMPTS, temperature=-1)
    with pytest.raises(SpecpipeError, match="top_k=.many. must be an integer >= 0"):
        sp.generate(PROMPTS, top_k="many")


def _feed(decode, outputs: list[list[int]]):
    """Drive _Deltas with one request whose output grows through `outputs` (the last one finishes it)."""
    from types import SimpleNamespace

    from specpipe.api import _Deltas

    events = []
    deltas = _Deltas(decode, events.append)
    for k, ids in enumerate(outputs):
        done = k == len(outputs) - 1
        deltas([SimpleNamespace(index=0, output_ids=ids, finished=done, finish_reason="length" if done else None,
                                error=None)])
    return events


def test_stream_text_is_decoded_incrementally_and_waits_for_whole_characters():
    from specpipe.workload.tokenizer import ByteTokenizer

    tok, decoded = ByteTokenizer(), []

    def decode(ids):
        decoded.append(len(ids))
        return tok.decode(ids)

    text = "naïve café — 日本語 🙂 " * 40
    ids = tok.encode(text)
    events = _feed(decode, [ids[:n] for n in range(1, len(ids) + 1)])
    assert "".join(e.text for e in events) == text
    assert all("\ufffd" not in e.text for e in events)  # a split character is held back, never sent broken
    assert text.startswith("".join(e.text for e in events[:-1]))  # final before the closing reconciliation
    # Each step decodes a window since the last character boundary, not the whole output: O(n) in all.
    assert sum(decoded[:-1]) < 8 * len(ids) and max(decoded[:-1]) <= 8
    assert [e.text for e in events[:4]] == ["n", "a", "", "ï"]


def test_stream_keeps_the_spaces_a_metaspace_tokenizer_decodes(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from specpipe.workload.tokenizer import HFTokenizer

    words = ["▁the", "▁cat", "▁sat", "▁on", "▁mat", "s", "."]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[unk]"] + words)}, unk_token="[unk]"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = HFTokenizer(tmp_path / "tokenizer.json")
    ids = [1, 2, 3, 4, 1, 5, 6, 7, 2, 3] * 5
    events = _feed(hf.decode, [ids[:n] for n in range(1, len(ids) + 1)])
    full = hf.decode(ids)
    assert full.startswith("the cat sat on the mats. cat")
    assert "".join(e.text for e in events[:-1]) == hf.decode(ids[:-1])  # windows keep the word spaces
    assert "".join(e.text for e in events) == full


def test_prompts_of_the_wrong_type(tmp_path):
    sp = SpecPipe(*BASE)
    with pytest.raises(SpecpipeError, match="prompts must be a prompt .* or a list of them, got int '5'"):
        sp.generate(5)
    got = sp.generate([104, None, "ok", {"prompt": "a", "prompt_ids": [1]}], max_new_tokens=2)
    assert "prompt 0: is int '104'" in got[0].error and "[[1, 2, 3]]" in got[0].error
    assert "prompt 1: is NoneType" in got[1].error and got[2].error is None
    assert "has both 'prompt' and 'prompt_ids'" in got[3].error
    assert [c.output_ids for c in sp.generate((p for p in ["ok"]), max_new_tokens=2)] == [got[2].output_ids]
    (tmp_path / "f").write_text("x")
    with pytest.raises(SpecpipeError, match="out_dir=.* is a file, not a folder"):
        sp.generate(["ok"], out_dir=str(tmp_path / "f"))


def test_calls_from_several_threads_take_turns_and_reentry_is_refused():
    import threading

    sp = SpecPipe(*BASE, "draft.topk=2", "draft.num_steps=3")
    other = SpecPipe(*BASE, "draft.topk=2", "draft.num_steps=3")  # shares the loaded weights and KV pools
    want = {p: sp.generate([p] * 3, max_new_tokens=12)[0].output_ids for p in PROMPTS}
    got, errors = {}, []

    def work(obj, p):
        try:
            got[p] = [c.output_ids for c in obj.generate([p] * 3, max_new_tokens=12)]
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(obj, p)) for obj, p in zip((sp, other, sp), PROMPTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and all(got[p] == [want[p]] * 3 for p in PROMPTS)

    def nested(ev):
        sp.generate(["x"], max_new_tokens=2)

    with pytest.raises(SpecpipeError, match="called while this thread is already decoding"):
        sp.generate(PROMPTS[:1], max_new_tokens=4, on_event=nested)
    assert sp.generate(PROMPTS[:1], max_new_tokens=12)[0].output_ids == want[PROMPTS[0]]


def join_stream_workers() -> None:
    import threading

    for t in [t for t in threading.enumerate() if t.name == "specpipe-stream"]:
        t.join(timeout=120)
        assert not t.is_alive()


def test_a_stream_dropped_while_it_waits_for_its_turn_never_decodes(monkeypatch):
    """Dropped in the thread that holds the decode lock (an on_event callback, or the garbage collector
    running there), a stream must not wait for its worker, which waits for that lock: that deadlocked."""
    import specpipe.run as app

    calls, real = [], app.run
    monkeypatch.setattr(app, "run", lambda *a, **k: calls.append(1) or real(*a, **k))
    sp, box = SpecPipe(*BASE), {}

    def on_event(ev):
        if "s" not in box:
            box["s"] = sp.stream(PROMPTS[:1], max_new_tokens=5)  # its worker waits for this call's turn
        else:
            box["s"] = None  # dropped here
    out = sp.generate(PROMPTS[:1], max_new_tokens=6, on_event=on_event)
    join_stream_workers()
    assert len(out[0].output_ids) == 6 and box["s"] is None and len(calls) == 1  # the stream never decoded


def test_a_stream_left_open_is_closed_by_with_close_or_exit(tmp_path):
    import subprocess
    import sys
    import threading

    sp = SpecPipe(*BASE)
    with sp.stream(PROMPTS * 4, max_new_tokens=40) as events:
        next(events)
    assert not any(t.name == "specpipe-stream" for t in threading.enumerate())
    dropped = sp.stream(PROMPTS * 4, max_new_tokens=400)
    next(dropped)
    gone = weakref.ref(dropped)
    del dropped  # nothing else holds it (its worker did, and decoded on to the end under the decode lock)
    assert gone() is None
    join_stream_workers()
    named = sp.stream(PROMPTS, max_new_tokens=12)
    for _ in named:
        break  # a named stream stays open after break: generate() waits for it, and is still right
    assert [c.output_ids for c in sp.generate(PROMPTS, max_new_tokens=12)] == \
        [c.output_ids for c in SpecPipe(*BASE).generate(PROMPTS, max_new_tokens=12)]
    named.close()
    script = tmp_path / "leave_open.py"
    script.write_text("from specpipe import SpecPipe\n"
                      "s = SpecPipe('model=random_tiny', 'device.num_threads=1').stream(['def f(x):'] * 8, "
                      "max_new_tokens=64)\nnext(s)\nprint('left open')\n")
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "left open" in p.stdout, (p.returncode, p.stderr[-500:])


def test_api_inputs_refused_or_handled_before_decoding(tmp_path):
    sp = SpecPipe(*BASE)
    greedy = sp.generate(PROMPTS, max_new_tokens=8)
    tiny = sp.generate(PROMPTS, max_new_tokens=8, temperature=1e-40)  # subnormal: greedy, not inf logits
    assert [c.output_ids for c in tiny] == [c.output_ids for c in greedy]
    mixed = sp.generate([{"prompt": "a", "top_k": 2 ** 63, "temperature": 1.0}, "b"], max_new_tokens=4)
    assert "below 2**31" in mixed[0].error and mixed[1].error is None  # fails alone
    with pytest.raises(SpecpipeError, match="temperature='0.7' must be a number"):
        sp.generate(PROMPTS, temperature="0.7")
    with pytest.raises(SpecpipeError, match="not bytes"):
        sp.generate(b"def")
    with pytest.raises(SpecpipeError, match="out_dir='' must be a folder path"):
        sp.generate(PROMPTS, out_dir="")
    (tmp_path / "f").write_text("x")
    with pytest.raises(SpecpipeError, match="cannot be written"):
        sp.generate(PROMPTS, out_dir=str(tmp_path / "f" / "sub"))
    with pytest.raises(SpecpipeError, match="workload.max_new_tokens=2048 leaves no room for a prompt in the "
                                            "model's context of 2048 tokens"):
        sp.generate(PROMPTS, max_new_tokens=2048)
    with pytest.raises(SpecpipeError, match="overrides are 'key=value' strings"):
        SpecPipe("--cfg=job")
    with pytest.raises(SpecpipeError, match="draft.topk=300 is larger than the draft's vocabulary"):
        SpecPipe("model=random_tiny", "draft.topk=300")


def test_stream_text_never_repeats_when_a_decoder_rewrites_sent_bytes():
    """HF's ByteFallback decoder turns a whole run of byte tokens into U+FFFD when later bytes make it invalid
    UTF-8: text already sent cannot be taken back, and it is never sent twice."""

    def decode(ids):  # ids are bytes; a trailing run that is not valid UTF-8 becomes U+FFFD per byte
        raw = bytes(ids)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw[:1].decode("utf-8", "replace") + "\ufffd" * (len(raw) - 1)

    events = _feed(decode, [[120], [120, 0xC3], [120, 0xC3, 0xA9], [120, 0xC3, 0xA9, 0xC3]])
    texts = [e.text for e in events]
    assert (texts[:3] == ["x", "", "é"] and "x" not in texts[3]
            and len("".join(texts)) == len(decode([120, 0xC3, 0xA9, 0xC3])))


def test_logprobs_through_the_api_and_streams():
    sp = SpecPipe(*BASE, "draft.topk=2", "draft.num_steps=3", "speculation=static")  # (the same widths each call:
    # a GEMM over other row counts rounds the last bits of a logprob differently)
    plain = sp.generate(PROMPTS, max_new_tokens=10)
    got = sp.generate(PROMPTS, max_new_tokens=10, logprobs=True)
    assert [c.output_ids for c in got] == [c.output_ids for c in plain] and plain[0].logprobs is None
    assert all(len(c.logprobs) == len(c.output_ids) and all(lp <= 0 for lp in c.logprobs) for c in got)
    events = list(sp.stream(PROMPTS, max_new_tokens=10, logprobs=True))
    for c in got:
        assert [x for e in events if e.index == c.index for x in e.logprobs] == c.logprobs
    with pytest.raises(SpecpipeError, match="logprobs=1 must be True or False"):
        sp.generate(PROMPTS, logprobs=1)


@pytest.mark.parametrize("draft", [["draft=none"], ["draft=ngram"], ["draft.topk=2", "draft.num_steps=4"]])
def test_a_prompts_stop_token_ids_end_it_where_the_first_one_is_generated(draft):
    """vLLM's per-request stop_token_ids: the output ends with the first of them (kept, as EOS is), also in the
    middle of a speculative run; other requests and ignore_eos are not affected; bad ids fail the request."""
    sp = SpecPipe(*BASE, "workload.max_new_tokens=24", *draft)
    ref = SpecPipe(*BASE, "workload.max_new_tokens=24", "draft=none").generate(PROMPTS, max_new_tokens=24)
    ids = ref[0].output_ids
    cut = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])  # a token's first appearance, not at 0
    got = sp.generate([{"prompt": PROMPTS[0], "stop_token_ids": [ids[cut]]}, PROMPTS[1],
                       {"prompt": PROMPTS[0], "stop_token_ids": [ids[cut], -1]},
                       {"prompt": PROMPTS[0], "stop_token_ids": [10 ** 9]}], max_new_tokens=24)
    assert got[0].output_ids == ids[:cut + 1] and got[0].finish_reason == "stop"
    assert got[1].output_ids == ref[1].output_ids
    assert 'prompt 2: "stop_token_ids" must be a list of token ids' in got[2].error
    assert "prompt 3: stop_token_ids [1000000000] are outside the vocabulary" in got[3].error
    free = SpecPipe(*BASE, "workload.max_new_tokens=24", "workload.ignore_eos=true", *draft)
    assert free.generate([{"prompt": PROMPTS[0], "stop_token_ids": [ids[cut]]}])[0].output_ids == ids


def test_generate_leaves_the_callers_random_stream_alone():
    """A training loop calling generate() kept getting torch.manual_seed(seed) reset under it."""
    import torch

    sp = SpecPipe(*BASE, "draft=none")
    torch.manual_seed(123)
    expected = torch.rand(2), torch.rand(2)
    torch.manual_seed(123)
    first = torch.rand(2)
    sp.generate(PROMPTS[:1], max_new_tokens=2)
    assert torch.equal(first, expected[0]) and torch.equal(torch.rand(2), expected[1])
    # a stream decodes in a thread: the caller's draws while it runs, and after, go on from their own stream
    torch.manual_seed(123)
    ref = torch.rand(6)
    torch.manual_seed(123)
    drawn = [torch.rand(2)]
    for ev in SpecPipe(*BASE, "device.weight_layout=auto").stream(PROMPTS[:1], max_new_tokens=3):
        if len(drawn) == 1:
            drawn.append(torch.rand(2))
    drawn.append(torch.rand(2))
    assert torch.equal(torch.cat(drawn), ref)


def test_a_job_that_does_not_draft_with_a_model_lets_its_kv_pool_go():
    """In-process sweeps share the loaded pair: draft=standalone then draft=eagle kept the standalone model's KV
    pool (and the reverse the head's) allocated, set up again, in every later job."""
    from specpipe.models.cache import load_pair
    from specpipe.devices.cpu import CpuDevice

    cfg = compose(*BASE, "draft=standalone")
    pair = load_pair(cfg, "float64", CpuDevice())
    alone = run(compose(*BASE, "draft=standalone"), quiet=True, items=[{"prompt": PROMPTS[0]}])["requests"]
    run(cfg, quiet=True, pair=pair, items=[{"prompt": PROMPTS[0]}])
    assert pair.standalone.kv is not None and pair.draft.kv is None
    out = run(compose(*BASE), quiet=True, pair=pair, items=[{"prompt": PROMPTS[0]}])["requests"]
    assert pair.standalone.kv is None and pair.draft.kv is not None
    again = run(cfg, quiet=True, pair=pair, items=[{"prompt": PROMPTS[0]}])["requests"]
    assert again[0].output_ids == alone[0].output_ids == out[0].output_ids


def test_a_run_that_fails_before_decoding_leaves_no_timing_hooks(tmp_path, monkeypatch):
    """The shared models' timing hooks were attached before the run's try/finally: a failure (or Ctrl-C) in
    between left them timing, syncing the device, on every later forward. They stay registered (once: a compiled
    branch guards on them) and time nothing outside a run."""
    import specpipe.run as app
    import specpipe.decode.metrics as metrics_mod

    sp = SpecPipe(*BASE)
    hooked = lambda: sum(len(m._forward_hooks) + len(m._forward_pre_hooks)  # noqa: E731
                         for m in (sp.pair.target, sp.pair.target.lm_head, sp.pair.draft) if m is not None)
    real = app.build_pipeline
    sp.generate(PROMPTS[:1], max_new_tokens=2)
    once = hooked()

    def broken(*a, **k):
        raise RuntimeError("boom")
    monkeypatch.setattr(app, "build_pipeline", broken)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="boom"):
            sp.generate(PROMPTS[:1], max_new_tokens=2)
    assert hooked() == once and metrics_mod._TIMED[0] is None  # nothing times (or syncs) outside a run
    monkeypatch.setattr(app, "build_pipeline", real)
    (tmp_path / "out" / "completions.partial.jsonl").mkdir(parents=True)  # cannot be the partial file
    out = sp.generate(PROMPTS[:1], max_new_tokens=2, out_dir=tmp_path / "out")
    assert len(out[0].output_ids) == 2 and (tmp_path / "out" / "metrics.json").exists() and hooked() == once
    assert metrics_mod._TIMED[0] is None


def test_an_interrupt_right_after_taking_the_decode_lock_hands_it_back(monkeypatch):
    """Ctrl-C can land between the lock's acquire() and the end of __enter__, where `with` never runs __exit__:
    the lock would stay held and every later generate() in the process would hang."""
    import threading

    from specpipe.api import _DECODING

    real = _DECODING.lock

    class InterruptedAfterAcquire:
        def acquire(self, *a, **k):
            real.acquire(*a, **k)
            monkeypatch.setattr(_DECODING, "lock", real)
            raise KeyboardInterrupt

        def release(self):
            real.release()
    monkeypatch.setattr(_DECODING, "lock", InterruptedAfterAcquire())
    sp = SpecPipe(*BASE, "draft=none")
    with pytest.raises(KeyboardInterrupt):
        sp.generate(PROMPTS[:1], max_new_tokens=2)
    free = []
    other = threading.Thread(target=lambda: free.append(real.acquire(timeout=5) and real.release() is None))
    other.start()
    other.join()
    assert free == [True] and _DECODING.owner is None
    assert sp.generate(PROMPTS[:1], max_new_tokens=2)[0].finish_reason in ("length", "stop")


def test_leaving_a_stream_with_break_right_before_exit_does_not_abort(tmp_path):
    """The README's pattern: `for ev in sp.stream(...): break`, then the script ends. The dropped stream closed
    without waiting and left the registry of open streams, so exit tore torch down under its still-running worker
    ("terminate called without an active exception", status 134)."""
    import subprocess
    import sys

    script = tmp_path / "leave_early.py"
    script.write_text("from specpipe import SpecPipe\n"
                      "sp = SpecPipe('model=random_tiny', 'device.num_threads=1')\n"
                      "for ev in sp.stream(['def f(x):'] * 8, max_new_tokens=400):\n    break\nprint('done')\n")
    for _ in range(2):
        p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
        assert p.returncode == 0 and "done" in p.stdout, (p.returncode, p.stderr[-500:])


def test_prompt_dicts_take_numpy_and_torch_values():
    """An array of ids in a prompt's dict, a numpy scalar for a neutral field: as in a list of prompts, values,
    not types (a numpy array made the error message's json.dumps raise, and the whole call was lost)."""
    np = pytest.importorskip("numpy")
    import torch

    sp = SpecPipe(*BASE, "draft=none")
    out = sp.generate([{"prompt": "x", "stop_token_ids": np.array([9])},
                       {"prompt": "x", "stop_token_ids": torch.tensor([9])},
                       {"prompt": "x", "stop_token_ids": {9}}, {"prompt": "x", "n": np.int64(1)},
                       {"prompt": "x", "presence_penalty": np.float32(0)}, {"prompt_ids": np.array([5, 6, 7])},
                       {"prompt_ids": (5, 6, 7)}, {"prompt": "x", "n": np.int64(2)}], max_new_tokens=4)
    assert [c.error is None for c in out] == [True, True, False, True, True, True, True, False]
    assert '"stop_token_ids" must be a list of token ids' in out[2].error and "{9}" in out[2].error
    assert 'field "n"=2 is not supported' in out[7].error
    assert out[5].output_ids == out[6].output_ids == sp.generate([[5, 6, 7]], max_new_tokens=4)[0].output_ids


def test_constructor_settings_hold_unless_a_call_sets_its_own():
    sp = SpecPipe(*BASE, "draft=none", "workload.logprobs=true")
    assert sp.generate(PROMPTS[:1], max_new_tokens=3)[0].logprobs is not None  # generate() used to force False
    assert sp.generate(PROMPTS[:1], max_new_tokens=3, logprobs=False)[0].logprobs is None
    np = pytest.importorskip("numpy")
    assert sp.generate(PROMPTS[:1], max_new_tokens=3, logprobs=np.bool_(True))[0].logprobs is not None
    with pytest.raises(SpecpipeError, match="logprobs=1 must be True or False"):
        sp.generate(PROMPTS[:1], logprobs=1)


def test_repeated_calls_draw_fresh_samples_reproducibly():
    """Without seeds each call samples anew (every call gave the same "random" text); the first call is the CLI
    run's, a call's seed= pins it, a prompt's own "seed" wins, and a new SpecPipe repeats the same sequence."""
    over = (*BASE, "draft.topk=2", "draft.num_steps=3", "sampling.temperature=1.5", "workload.max_new_tokens=10")
    sp = SpecPipe(*over)
    calls = [[c.output_ids for c in sp.generate(PROMPTS)] for _ in range(3)]
    assert calls[0] != calls[1] != calls[2] != calls[0]
    assert calls[0] == [r.output_ids for r in run(compose(*over), quiet=True,
                                                    items=[{"prompt": p} for p in PROMPTS])["requests"]]
    assert [[c.output_ids for c in SpecPipe(*over).generate(PROMPTS)] for _ in range(1)] == calls[:1]
    pinned = [[c.output_ids for c in sp.generate(PROMPTS, seed=11)] for _ in range(2)]
    assert pinned[0] == pinned[1]
    own = [sp.generate([{"prompt": PROMPTS[0], "seed": 4}])[0].output_ids for _ in range(2)]
    assert own[0] == own[1]
    with pytest.raises(SpecpipeError, match=r"seed=-1 must be an integer between 0 and 2\*\*63-1"):
        sp.generate(PROMPTS, seed=-1)


def test_calls_from_two_threads_at_once_draw_different_seeds():
    """Each call takes its number under a lock (two threads both took call 0's seed: the number was read before
    the prompts were parsed and counted after)."""
    import threading

    sp = SpecPipe(*BASE, "draft=none")
    seeds, real, start = [], sp._decode, threading.Barrier(2)
    sp._decode = lambda cfg, *a: seeds.append(cfg.sampling.seed) or real(cfg, *a)
    prompts = [{"prompt": f"prompt {i} " * 3} for i in range(300)]

    def call():
        start.wait()
        sp.generate(prompts, max_new_tokens=1, temperature=1.0)
    threads = [threading.Thread(target=call) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(seeds)) == 2 and sp._calls == 2


def test_suffix_cache_lasts_across_calls():
    """draft=suffix drafts from earlier requests' outputs: calls of one SpecPipe share the cache (each call
    started with an empty one, so one request per call never drafted from the others)."""
    sp = SpecPipe(*BASE, "draft=suffix", "workload.max_new_tokens=24", "speculation=static")  # (the whole tree each
    # round: acceptance is the cache's, not the cost policy's timing-dependent choice)
    first = sp.generate(PROMPTS[:1])
    assert sp.metrics["draft_cache"]["texts_added"] == 1
    again = sp.generate(PROMPTS[:1])
    assert sp.metrics["draft_cache"]["texts_added"] == 2 and again[0].output_ids == first[0].output_ids
    assert sp.metrics["accept_length_mean"] > 3  # the first call's output drafted the second's
    assert SpecPipe(*BASE, "draft=suffix", "workload.max_new_tokens=24").generate(PROMPTS[:1]) and True


def test_foreign_fields_fail_their_prompt_and_typos_are_noted(capsys):
    """Another engine's field set to a value that would do nothing here fails its prompt; at its neutral value it
    passes (replayed vLLM requests carry "ignore_eos": false). A key like a typo of ours runs, noted once;
    dataset columns (ids, counts, short names) pass without a word."""
    sp = SpecPipe(*BASE, "draft=none")
    out = sp.generate([{"prompt": "x", "stop_sequences": ["\n"]}, {"prompt": "x", "ignore_eos": True},
                       {"prompt": "x", "do_sample": True}, {"prompt": "x", "add_generation_prompt": False},
                       {"prompt": "x", "ignore_eos": False, "stop_sequences": [], "add_generation_prompt": True,
                        "continue_final_message": False, "do_sample": False, "temperature": 0},
                       {"prompt": "x", "max_new_token": 2, "temprature": 0.5},
                       {"prompt": "x", "id": 7, "prompt_id": "a1", "prompt_idx": 3, "promptId": "b", "top": 1,
                        "question_id": 4, "metadata": {"k": 1}, "n_tokens": 5, "document": "d"},
                       {"prompt": "x", "Temperature": 1.5}, {"prompt": "x", "top-p": 0.5},
                       {"prompt": "x", "max_new_length": 2}, {"prompt": "x", "do_sample": False},
                       {"prompt": "x", "N": 5, "Logprobs": None}], max_new_tokens=3)
    assert 'field "stop_sequences"=["\\n"] is not supported per prompt' in out[0].error and 'use "stop"' in out[0].error
    assert "workload.ignore_eos=true" in out[1].error and 'disagrees with the temperature 0' in out[2].error
    assert "add_generation_prompt=true" in out[3].error
    assert [c.error for c in out[4:7]] == [None, None, None] and out[10].error is None  # do_sample agrees
    assert out[11].error is None  # a count column "N" is not OpenAI's "n"
    assert len(out[5].output_ids) == 3  # "max_new_token": 2 is not a setting here
    assert sp.metrics["ignored_prompt_fields"] == {"max_new_token": {"did_you_mean": "max_new_tokens", "prompts": 1},
                                                   "temprature": {"did_you_mean": "temperature", "prompts": 1}}
    assert 'field "Temperature" is not one specpipe reads, so it would be ignored; write it "temperature"' \
        in out[7].error and 'write it "top_p"' in out[8].error and 'use "max_new_tokens"' in out[9].error
    hot = sp.generate([{"prompt": "x", "do_sample": True}, {"prompt": "x", "do_sample": False}], max_new_tokens=2,
                      temperature=0.8)  # without its own temperature, the call's decides
    assert hot[0].error is None and 'field "do_sample"=false disagrees with the temperature 0.8' in hot[1].error
    err = capsys.readouterr().err
    assert err.count("prompt fields specpipe does not read were ignored") == 1 and '"max_new_token" in 1 prompt' in err
    sp.generate(["x"], max_new_tokens=2)
    assert "ignored_prompt_fields" not in sp.metrics and "were ignored" not in capsys.readouterr().err


def test_api_misuse_is_named_before_anything_decodes(tmp_path, monkeypatch):
    import threading

    with pytest.raises(SpecpipeError, match="SpecPipe runs one configuration, and this is a sweep"):
        SpecPipe(*BASE, "sweep=tree_shape")
    with pytest.raises(SpecpipeError, match="invalid override draft.topk=1,4: SpecPipe runs one configuration"):
        SpecPipe(*BASE, "draft.topk=1,4")
    sp = SpecPipe(*BASE, "draft=none")
    with pytest.raises(SpecpipeError, match="temperature=-1 must be"):
        sp.stream(PROMPTS, temperature=-1)  # at the call, not at the first next()
    with pytest.raises(SpecpipeError, match="stream.. got an unknown argument 'on_event'"):
        sp.stream(PROMPTS, on_event=print)

    class Progress:  # a callback object with its own `cancelled` attribute
        def __init__(self):
            self.cancelled, self.seen = False, 0

        def __call__(self, ev):
            self.seen += 1
    cb = Progress()
    assert sp.generate(PROMPTS[:1], max_new_tokens=3, on_event=cb)[0].finish_reason == "length" and cb.seen

    box = {}

    def reads_a_stream(ev):
        if "err" not in box:
            try:
                next(iter(sp.stream(PROMPTS[:1], max_new_tokens=2)))
            except SpecpipeError as e:
                box["err"] = str(e)
    worker = threading.Thread(target=lambda: sp.generate(PROMPTS[:1], max_new_tokens=3, on_event=reads_a_stream),
                              daemon=True)
    worker.start()
    worker.join(timeout=120)
    assert not worker.is_alive(), "reading a stream inside on_event hung"
    assert "a stream was read inside an on_event callback" in box["err"]
    join_stream_workers()

    def fails(ev):
        raise RuntimeError("callback bug")
    with pytest.raises(RuntimeError, match="callback bug"):
        sp.generate(PROMPTS[:1], max_new_tokens=3, on_event=fails)
    assert sp.metrics is None  # not an earlier call's
    monkeypatch.setenv("HOME", str(tmp_path))
    sp.generate(PROMPTS[:1], max_new_tokens=3, out_dir="~/runs/a")
    assert (tmp_path / "runs" / "a" / "metrics.json").exists() and not Path("~").exists()


def test_arrays_of_ids_nested_values_and_stream_limits():
    """A 1-D array of ids is one prompt (it became one prompt per id, each "is int64 '104'"); an int64 alone gets
    the token-id hint; a dict prompt nested thousands deep fails alone (a RecursionError ended the call); stream()
    refuses max_new_tokens past the model's context when called, not while iterating."""
    import numpy as np
    import torch

    sp = SpecPipe(*BASE)
    want = sp.generate([[104, 105]], max_new_tokens=3)[0].output_ids
    assert [c.output_ids for c in sp.generate(np.array([104, 105]), max_new_tokens=3)] == [want]
    assert [c.output_ids for c in sp.generate(torch.tensor([104, 105]), max_new_tokens=3)] == [want]
    assert [c.prompt for c in sp.generate(np.array(["ab", "cd"]), max_new_tokens=1)] == ["ab", "cd"]
    assert "[[1, 2, 3]]" in sp.generate([np.int64(5)], max_new_tokens=1)[0].error
    deep = inner = {}
    for _ in range(5000):
        inner["m"] = {}
        inner = inner["m"]
    got = sp.generate([{"prompt": "a", "meta": deep}, "b"], max_new_tokens=2)
    assert got[0].error == ("prompt 0: field 'meta'[...]['m']['m'] is nested too deeply to read (more than 100 levels "
                            "deep, the cap on a prompt's nesting); flatten it") and got[1].error is None
    with pytest.raises(SpecpipeError, match="max_new_tokens=1000000 leaves no room for a prompt"):
        sp.stream(["a"], max_new_tokens=10 ** 6)


def test_a_checkpoint_saved_again_in_place_is_loaded_again(tmp_path):
    """The in-process cache keeps a pair across runs with the same settings; a folder re-saved at the same path
    (a notebook, an eval during training) must not keep decoding with the old files."""
    import shutil

    folder = tmp_path / "target"
    shutil.copytree(Path(__file__).resolve().parents[1] / "specpipe/assets/tiny/target", folder)
    over = ("model=hf", f"model.path={folder}", "draft=none", "workload.max_new_tokens=8", "workload.num_prompts=1")
    ids = run(compose(*over), quiet=True)["requests"][0].output_ids
    loads = MODEL_LOADS[0]
    assert run(compose(*over), quiet=True)["requests"][0].output_ids == ids and MODEL_LOADS[0] == loads
    config = json.loads((folder / "config.json").read_text())
    config["specpipe_tokenizer"]["eos_token_id"] = ids[1]  # the same settings, another file
    (folder / "config.json").write_text(json.dumps(config))
    again = run(compose(*over), quiet=True)["requests"][0]
    assert MODEL_LOADS[0] == loads + 1
    assert again.finish_reason == "stop" and len(again.output_ids) <= 2 and again.output_ids != ids


def test_generation_config_eos_ends_requests_of_a_specpipe_tokenizer_folder(tmp_path):
    """A folder whose tokenizer is described in config.json (`specpipe_tokenizer`, as the shipped pair's) still
    takes generation_config.json's eos_token_id list as what ends a request, as a tokenizer.json folder does; it
    was ignored, so such a request ran to max_new_tokens past the model's stop id."""
    import shutil

    from specpipe.models.hf.load import load_target
    from specpipe.models.hf.tokenizer import load_tokenizer
    from specpipe.workload.tokenizer import stop_token_ids

    folder = tmp_path / "target"
    shutil.copytree(Path(__file__).resolve().parents[1] / "specpipe/assets/tiny/target", folder)
    over = ("model=hf", f"model.path={folder}", "draft=none", "workload.max_new_tokens=8", "workload.num_prompts=1")
    ids = run(compose(*over), quiet=True)["requests"][0].output_ids
    eos = json.loads((folder / "config.json").read_text())["specpipe_tokenizer"]["eos_token_id"]
    assert eos not in ids[:2]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, ids[1]]}))
    assert list(stop_token_ids(load_tokenizer(folder, load_target(folder).config))) == [eos, ids[1]]
    again = run(compose(*over), quiet=True)["requests"][0]
    assert again.finish_reason == "stop" and again.output_ids[-1] == ids[1] and len(again.output_ids) <= 2


@pytest.mark.parametrize("prompt_ids", [[0xC3, 257, 257, 257, 257], [0xFF, 0xFF, 0xFF, 0xFF, 0xC3]],
                         ids=["specials-after", "invalid-bytes-before"])
def test_stream_adds_up_when_the_output_finishes_a_character_the_prompt_left_open(prompt_ids):
    """The prompt ends inside "À" (0xC3) with no clean boundary in its last tokens (specials, or invalid bytes,
    all decode to U+FFFD or nothing): the stream's first text dropped the "À" and the closing event sent "a" again."""
    from types import SimpleNamespace

    from specpipe.api import _Deltas
    from specpipe.workload.tokenizer import ByteTokenizer, output_text

    tok, out, events = ByteTokenizer(), [0x80, *b"ab"], []
    deltas = _Deltas(tok.decode, events.append)
    for n in range(1, len(out) + 1):
        done = n == len(out)
        deltas([SimpleNamespace(index=0, prompt_ids=prompt_ids, output_ids=out[:n], finished=done,
                                finish_reason="length" if done else None, error=None)])
    assert "".join(e.text for e in events) == output_text(tok, prompt_ids, out) == "Àab"


def test_a_call_refused_by_validate_takes_no_call_number():
    """A call validate() refuses (max_new_tokens past the context) must not shift the seeds of later calls: the
    first call that runs draws as a fresh SpecPipe's first call (and `python -m specpipe`) does."""
    sp = SpecPipe(*BASE, "sampling.temperature=1.0")
    ctx = sp.pair.target.config.max_position_embeddings
    with pytest.raises(SpecpipeError, match="leaves no room"):
        sp.generate(PROMPTS, max_new_tokens=ctx)
    with pytest.raises(SpecpipeError, match="leaves no room"):
        sp.stream(PROMPTS, max_new_tokens=ctx)
    first = [c.output_ids for c in sp.generate(PROMPTS)]
    assert first == [c.output_ids for c in SpecPipe(*BASE, "sampling.temperature=1.0").generate(PROMPTS)]


def test_metrics_are_none_after_a_call_refused_before_decoding():
    """README: sp.metrics is None after a call that raised, one refused at its arguments too (not the earlier
    call's)."""
    sp = SpecPipe(*BASE)
    sp.generate(PROMPTS[:1], max_new_tokens=2)
    assert sp.metrics is not None
    with pytest.raises(SpecpipeError, match="max_new_tokens=0"):
        sp.generate(PROMPTS, max_new_tokens=0)
    assert sp.metrics is None
    sp.generate(PROMPTS[:1], max_new_tokens=2)
    with pytest.raises(SpecpipeError, match="temperature"):
        sp.stream(PROMPTS, temperature=-1)
    assert sp.metrics is None


def test_a_prompts_logprobs_or_ignore_eos_true_runs_where_the_run_does_the_same():
    """"logprobs": true / "ignore_eos": true (replayed OpenAI / vLLM requests) fail their prompt only where the run
    would ignore them; with workload.logprobs=true / workload.ignore_eos=true they ask for what the run does (they
    failed there too, telling the user to set what was already set)."""
    asks = [{"prompt": "x", "logprobs": True}, {"prompt": "x", "ignore_eos": True}]
    on = SpecPipe(*BASE, "draft=none", "workload.logprobs=true", "workload.ignore_eos=true").generate(asks)
    assert [c.error for c in on] == [None, None] and all(len(c.logprobs) == len(c.output_ids) > 0 for c in on)
    off = SpecPipe(*BASE, "draft=none").generate(asks)
    assert "prompt 0: " in off[0].error and "workload.logprobs=true" in off[0].error
    assert "prompt 1: " in off[1].error and "workload.ignore_eos=true" in off[1].error


def test_a_prompt_that_holds_itself_fails_alone_and_never_hangs():
    """issue #46: a self-referencing prompt dict (d["metadata"] = d) hung generate(): each walk of its values
    looped forever. It is that prompt's error now, and a `stop` argument that holds itself is refused by name."""
    import threading

    sp = SpecPipe("model=random_tiny", "draft=none")
    d = {"prompt": "x"}
    d["metadata"] = d
    stop = ["a"]
    stop.append(stop)
    out = []

    def calls():
        out.append(sp.generate(["def f(x):", d], max_new_tokens=4))
        with pytest.raises(SpecpipeError, match=r"^specpipe: stop\[1\] holds a value that contains it \(a cycle\)"):
            sp.generate(["x"], stop=stop)
        out.append("refused")
    worker = threading.Thread(target=calls, daemon=True)  # (a hang fails the test instead of stopping the suite)
    worker.start()
    worker.join(120)
    assert len(out) == 2, "generate() did not return"
    ok, bad = out[0]
    assert ok.error is None and len(ok.output_ids) == 4 and bad.finish_reason == "error"
    assert bad.error.startswith("prompt 1: field 'metadata'['metadata'] holds a value that contains it (a cycle)")
