"""Fuzz SpecPipe.generate()'s arguments (issue #46): prompts of every kind (strings, lists, dicts, ids, nested,
cyclic, wrong types, empty), max_new_tokens, stop, seed, logprobs, out_dir, on_event and the sampling arguments
with values of every type. Each call returns its completions (a bad prompt fails alone, with its error) or raises
SpecpipeError; never another exception, never a hang. A few SpecPipe(...) objects are built from random overrides
too. FUZZ_EXAMPLES=N for a long run (tests/fuzz_strategies.py)."""
import math

import numpy as np
import pytest
import torch
from hypothesis import event, example, given
from hypothesis import strategies as st

from fuzz_strategies import (RUN_UNSAFE, LongText, bounded, brief, fuzz_settings, good_texts, json_values, overrides,
                             prompt_objects, texts)
from specpipe import SpecPipe, SpecpipeError
from specpipe.api import Completion, StreamEvent

FINISH = ("stop", "length", "error")


@pytest.fixture(scope="module")
def sp():
    return SpecPipe("model=random_tiny", "device.dtype=float64", "workload.max_new_tokens=3")


def cyclic(d: dict) -> dict:
    d = dict(d)
    d["metadata"] = d  # issue #46 item 2: generate() never returned
    return d


class Said(list):
    """A list whose repr is its description: a failing example's report must not write out a list 5000 deep or
    one of 2**40 leaves (specpipe never should either)."""

    def __init__(self, items, what: str):
        super().__init__(items)
        self.what = what

    def __repr__(self) -> str:
        return f"<{self.what}>"


def deep(x, depth: int = 5000) -> list:
    for _ in range(depth - 1):
        x = [x]
    return Said([x], f"a list nested {depth} deep")


def doubling(n: int = 40) -> list:
    x: list = [1]
    for _ in range(n - 1):
        x = [x, x]  # 2**40 leaves written out, 41 objects in memory
    return Said([x, x], f"a list sharing its elements {n} levels deep")


class Opaque:
    pass


odd = st.sampled_from([None, 1, 2.5, float("nan"), True, b"bytes", bytearray(b"x"), {"a", "b"}, 1 + 2j, Opaque(),
                       np.array([5, 6, 7]), np.array([[5, 6]]), np.array([1.5, 2.5]), np.array("x"), np.int64(5),
                       torch.tensor([5, 6, 7]), torch.tensor(5), torch.tensor([[5, 6]]), (5, 6, 7), [],
                       [5, -1], [2 ** 63], [10 ** 40], [True, 5], ["a", 5], [[5, 6]], "", " ", LongText("x" * 100_000),
                       "\ud800", "\x00", "\U0001F600" * 3])
one_prompt = st.one_of(good_texts, good_texts, texts, prompt_objects(), prompt_objects().filter(
    lambda o: isinstance(o, dict)).map(cyclic), st.lists(st.integers(0, 257), min_size=1, max_size=8), odd,
    st.sampled_from([300, 5000, "doubling"]).map(lambda k: doubling() if k == "doubling" else deep(5, k)))
prompts = st.one_of(st.lists(one_prompt, max_size=4), one_prompt, st.lists(one_prompt, max_size=3).map(tuple),
                    st.lists(good_texts, max_size=3).map(iter), st.sampled_from([[], (), 5, None, b"x", range(2)]))
# each argument is mostly good (the first bad one decides the error, so a call of bad ones would only ever test
# the first check), else a value of the wrong kind, range or type
def mostly(good, bad) -> st.SearchStrategy:
    return st.one_of(good, good, good, good, bad)


limits = mostly(st.one_of(st.none(), st.integers(1, 3)), st.sampled_from(
    [0, -1, 2 ** 63, 10 ** 40, 10 ** 5000, True, 2.0, 2.5, "2", float("nan"), float("inf"), [2], np.int64(2),
     torch.tensor(2), 1_000_000]))
SAMPLING = {"temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(0, 50),
            "repetition_penalty": st.floats(0.5, 2), "min_p": st.floats(0, 1)}
junk_numbers = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-2, 2 ** 31), st.sampled_from(
    [True, "0.5", [0.5], 10 ** 40, np.float32(0.5), np.int64(3), torch.tensor(0.5), 1e-300, 1e308, -1]))
sampling_args = st.fixed_dictionaries({}, optional={k: mostly(st.one_of(st.none(), good), junk_numbers)
                                                    for k, good in SAMPLING.items()})
stops = mostly(st.one_of(st.none(), good_texts, st.lists(good_texts, min_size=1, max_size=2)), st.one_of(
    texts, st.lists(texts, max_size=3), json_values, st.sampled_from(
        [["s"] * 20_000, np.array(["a", "b"]), "\ud800", deep("x"), ("a", "b")])))
seeds = mostly(st.one_of(st.none(), st.integers(0, 2 ** 63 - 1)), st.sampled_from([-1, 2 ** 63, 1.0, "1", np.int64(7)]))
logprobs_args = mostly(st.one_of(st.none(), st.booleans()), st.sampled_from([1, "yes", np.bool_(1), None]))


def on_event_of(kind: str, events: list):
    return {"none": None, "collect": events.append, "junk": 1}[kind]


def out_dir_of(kind: str, tmp_path_factory):
    """None (most calls), a folder to make, a Path, or what is no folder: a file, "", an int."""
    if kind == "none":
        return None
    folder = tmp_path_factory.mktemp("fuzz_out")
    (folder / "a_file").write_text("x")
    return {"folder": str(folder / "run"), "path": folder / "run", "file": str(folder / "a_file"), "empty": "",
            "int": 1}[kind]


def files_hold(out_dir, n: int) -> None:
    """A call that wrote its files wrote one JSON line per request and a metrics.json."""
    import json
    from pathlib import Path

    lines = (Path(out_dir) / "completions.jsonl").read_text(encoding="utf-8").splitlines()
    assert len([json.loads(x) for x in lines]) == n
    json.loads((Path(out_dir) / "metrics.json").read_text(encoding="utf-8"))


def check_completions(out, events: list) -> None:
    assert isinstance(out, list) and all(isinstance(c, Completion) for c in out), brief(out)
    assert [c.index for c in out] == list(range(len(out)))
    for c in out:
        assert c.finish_reason in FINISH and (c.finish_reason != "error" or isinstance(c.error, str) and c.error)
        assert isinstance(c.text, str) and all(isinstance(t, int) for t in c.output_ids)
        event("error" if c.error else c.finish_reason)
    assert all(isinstance(e, StreamEvent) for e in events)


@example(prompts=cyclic({"prompt": "x"}), method="generate", max_new_tokens=2, stop=None, seed=None, sampling={},
         logprobs=None, on_event="none", out_dir="none")  # issue #46 item 2 (a hang)
@example(prompts=[{"prompt": "x", "seed": 10 ** 5000, 5: {1, 2}, "meta": float("nan")}], method="generate",
         max_new_tokens=2, stop=None, seed=None, sampling={}, logprobs=None, on_event="collect", out_dir="folder")
@given(prompts=prompts, method=st.sampled_from(["generate", "generate", "stream"]), max_new_tokens=limits,
       stop=stops, seed=seeds, logprobs=logprobs_args, sampling=sampling_args,
       on_event=st.sampled_from(["none", "none", "none", "collect", "collect", "junk"]),
       out_dir=st.sampled_from(["none"] * 6 + ["folder", "path", "file", "empty", "int"]))
@fuzz_settings("generate")
def test_generate_returns_completions_or_raises_specpipe_error(sp, prompts, method, max_new_tokens, stop, seed,
                                                                sampling, logprobs, on_event, out_dir,
                                                                tmp_path_factory):
    events: list = []
    folder = out_dir_of(out_dir, tmp_path_factory)
    with bounded(30, f"{method}({brief(prompts, 80)}, ...)"):
        try:
            if method == "generate":
                out = sp.generate(prompts, max_new_tokens=max_new_tokens, stop=stop, seed=seed, logprobs=logprobs,
                                  on_event=on_event_of(on_event, events), out_dir=folder, **sampling)
                check_completions(out, events)
            else:
                with sp.stream(prompts, max_new_tokens=max_new_tokens, stop=stop, seed=seed, logprobs=logprobs,
                               out_dir=folder, **sampling) as s:
                    events = list(s)
                assert all(isinstance(e, StreamEvent) and e.finish_reason in (None, *FINISH) for e in events)
                out = [e for e in events if e.finish_reason is not None]  # each request's last event
                event("streamed")
            if out_dir in ("folder", "path"):
                files_hold(folder, len(out))
        except SpecpipeError as e:
            assert str(e).startswith("specpipe:") and "Traceback" not in str(e), str(e)
            event("refused: " + str(e).split(":", 2)[1].strip()[:30])
    assert sp.metrics is None or math.isfinite(sp.metrics.get("wall_s", 0.0))


@given(ovs=overrides(exclude=RUN_UNSAFE, max_size=3))
@fuzz_settings("constructor")
def test_specpipe_from_random_overrides_builds_and_generates_or_raises(ovs):
    """SpecPipe(...) refuses a bad override with the CLI's message; one it builds decodes (issue #46 item 1:
    allocator._target_=... was accepted, then generate() raised Hydra's InstantiationException)."""
    with bounded(60, f"SpecPipe({ovs})"):
        try:
            built = SpecPipe("model=random_tiny", *ovs)
        except SpecpipeError as e:
            assert str(e).startswith("specpipe:"), str(e)
            event("refused")
            return
        try:
            check_completions(built.generate(["def f(x):", [5, 6, 7]], max_new_tokens=2), [])
            event("generated")
        except SpecpipeError as e:  # what only a call can tell (none expected: the constructor checks the model)
            assert str(e).startswith("specpipe:"), str(e)
            event("generate refused")
