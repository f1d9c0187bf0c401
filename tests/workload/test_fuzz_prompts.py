"""Fuzz prompts-file lines (issue #46): valid lines mixed with truncated JSON, wrong types for every field, huge
strings and ids, bytes that are no UTF-8, blank lines. Each line gives an item or a per-request error; a whole file
is refused (InputError) only for what is documented as the file's problem; and a run over good lines with bad
neighbours gives the good prompts the outputs they get alone. FUZZ_EXAMPLES=N for a long run
(tests/fuzz_strategies.py)."""
import pytest
from hypothesis import event, example, given
from hypothesis import strategies as st
from omegaconf import OmegaConf

from fuzz_strategies import (BLANK_LINES, HUGE_LINES, bad_lines, bounded, brief, dumps, fuzz_settings, good_prompts,
                             is_blank, prompt_objects)
from helpers import compose
from specpipe.errors import InputError
from specpipe.run import run
from specpipe.workload.prompts import line_item, parse_prompt_line, read_prompts_file

PROMPT_KEYS = ("prompt", "prompt_ids", "messages")


def an_item(item, where) -> None:
    """A request's item: its prompt (text, ids or a chat), or a per-request error naming where it came from."""
    assert isinstance(item, dict), (where, item)
    if "error" in item:
        assert isinstance(item["error"], str) and item["error"], (where, item)
        assert not item["error"].endswith(" at)"), item["error"]  # issue #46 item 6: a JSON error lost its place
        event("error: " + item["error"].split(": ", 1)[-1][:25])
    else:
        assert any(k in item for k in PROMPT_KEYS) and isinstance(item["prompt"], str), (where, item)
        event("item")


@example(obj={"prompt": "x", "temperature": float("nan")})
@example(obj={"messages": [{"role": "user", "content": [{"type": "image"}]}], "tools": "x"})
@given(obj=prompt_objects())
@fuzz_settings("prompt_values")
def test_each_prompt_value_gives_an_item_or_its_error(obj):
    with bounded(10, f"parse_prompt_line({brief(obj, 80)})"):
        an_item(parse_prompt_line(obj, 3), brief(obj))


def whole_file_problem(lines: list, msg: str) -> bool:
    """Whether an InputError is one of the documented whole-file refusals: no line that holds a JSON object, a
    JSON array, another encoding (gzip, UTF-16) or a line past the cap."""
    first = next((x.removeprefix(b"\xef\xbb\xbf") for x in lines if not is_blank(x)), b"")
    return ("is not a JSON-lines file" in msg or "holds no prompts" in msg or "longer than" in msg
            or ("JSON array" in msg and first.lstrip().startswith(b"["))
            or (("gzip" in msg or "UTF-16" in msg) and lines[0].removeprefix(b"\xef\xbb\xbf")[:2] in (
                b"\x1f\x8b", b"\xff\xfe", b"\xfe\xff")))


@example(lines=[b"[", dumps({"prompt": "a"})], crlf=False)
@example(lines=[b"\xff\xfe{", dumps({"prompt": "a"})], crlf=True)
@example(lines=[b'{"prompt": "a\x01"}'], crlf=False)  # issue #46 item 6: "Invalid control character at)"
@given(lines=st.lists(st.one_of(good_prompts().map(dumps), bad_lines()), min_size=1, max_size=8),
       crlf=st.booleans())
@fuzz_settings("prompt_files")
def test_a_prompts_file_gives_each_line_an_item_or_is_refused_whole(lines, crlf, tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz_prompts") / "p.jsonl"
    path.write_bytes((b"\r\n" if crlf else b"\n").join(lines))
    with bounded(20, f"read_prompts_file of {len(lines)} lines"):
        for n, line in enumerate(lines, 1):  # the per-line parser
            if not is_blank(line):
                item, _ = line_item(line.removeprefix(b"\xef\xbb\xbf"), n)
                an_item(item, line[:200])
        try:
            items = read_prompts_file(str(path))
        except InputError as e:
            assert whole_file_problem(lines, str(e)), (lines, str(e))
            event("refused whole")
            return
    kept = [x for x in lines if not is_blank(x)]
    assert len(items) == len(kept), (lines, items)
    for line, item in zip(kept, items):
        an_item(item, line[:200])


# ---- good prompts keep their outputs beside bad neighbours ---------------------------------------------------

BASE = ("model=random_tiny", "device.dtype=float64", "workload.max_new_tokens=3", "workload.batch_size=3",
        "sampling.temperature=0")


@pytest.fixture(scope="module")
def tiny_cfg():
    return compose(*BASE)


def decode_file(cfg, path, lines: list) -> list:
    path.write_bytes(b"\n".join(lines))
    cfg = OmegaConf.merge(cfg, {"workload": {"prompts_file": str(path), "num_prompts": None}})
    return run(cfg, quiet=True)["requests"]


@given(good=st.lists(good_prompts().map(dumps), min_size=1, max_size=3),
       bad=st.lists(st.one_of(bad_lines(), st.sampled_from(HUGE_LINES + BLANK_LINES)), min_size=1, max_size=4),
       order=st.randoms(use_true_random=False))
@fuzz_settings("bad_neighbours")
def test_bad_neighbours_do_not_change_good_prompts_outputs(good, bad, order, tiny_cfg, tmp_path_factory):
    """A run of good lines alone and one with bad lines among them (in random order): each good prompt gets the
    same tokens and finish reason (greedy, float64)."""
    folder = tmp_path_factory.mktemp("fuzz_neighbours")
    tagged = [(True, None)] * len(good) + [(False, x) for x in bad]
    order.shuffle(tagged)  # the bad lines anywhere among the good ones, which keep their order
    goods = iter(good)
    tagged = [(is_good, next(goods) if is_good else x) for is_good, x in tagged]
    with bounded(60, "two tiny runs"):
        alone = decode_file(tiny_cfg, folder / "good.jsonl", good)
        try:
            mixed = decode_file(tiny_cfg, folder / "mixed.jsonl", [x for _, x in tagged])
        except InputError as e:
            assert whole_file_problem([x for _, x in tagged], str(e)), str(e)
            event("refused whole")
            return
    event(f"{sum(r.finish_reason == 'error' for r in mixed)} bad neighbours failed")
    assert all(r.finish_reason in ("stop", "length") for r in alone), [(r.finish_reason, r.error) for r in alone]
    kept = [is_good for is_good, x in tagged if not is_blank(x)]
    assert len(mixed) == len(kept)
    got = [r for r, is_good in zip(mixed, kept) if is_good]
    assert [(r.output_ids, r.finish_reason) for r in got] == [(r.output_ids, r.finish_reason) for r in alone]
    for r, is_good in zip(mixed, kept):
        assert r.finish_reason in ("stop", "length", "error") and (r.finish_reason != "error" or r.error)
