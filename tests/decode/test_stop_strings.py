"""Stop strings end a request at the token that completes one (HF stop_strings semantics), at the same
token for speculative and plain decoding; the check looks only at a window of the newest tokens."""
import json

import pytest

from helpers import compose, random_prompts
from specpipe.run import run
from specpipe.models.random_tiny import build_random_tiny
from specpipe.config.stop_strings import check_stop, unescape
from specpipe.decode.stop_strings import StopStrings


@pytest.fixture(scope="module")
def pair():
    return build_random_tiny(seed=3, dtype="float64", max_position=256)


def decode_run(pair, path, *overrides):
    cfg = compose("model=random_tiny", "device.dtype=float64", f"workload.prompts_file={path}",
                  "workload.max_new_tokens=40", *overrides)
    return run(cfg, quiet=True, pair=pair)["requests"]


def cut(ids, decode, stop):
    """The expected output: the shortest prefix whose text holds a stop string (all of it if none does)."""
    for j in range(1, len(ids) + 1):
        if any(s in decode(ids[:j]) for s in stop):
            return ids[:j], "stop"
    return ids, None


def test_unescape_and_check():
    assert unescape(r"a\nb\t\\n\x") == "a\nb\t\\n\\x"
    assert check_stop("x") is None and check_stop(["a", "b"]) is None
    assert "non-empty string" in check_stop([""]) and "non-empty string" in check_stop([3])


def test_window_sees_a_stop_string_only_once_completed():
    s = StopStrings(["ab"], lambda ids: "".join(chr(97 + i) for i in ids))
    assert not s.hit([0]) and s.hit([0, 1]) and not s.hit([1, 0])
    assert s.hit([2] * 100 + [0, 1]) and not s.hit([0, 1] + [2] * 100)  # only the newest tokens are read


@pytest.mark.parametrize("draft", [["draft.topk=2", "draft.num_steps=3"], ["draft=ngram"]])
def test_speculative_stops_where_plain_decoding_would(tmp_path, pair, draft):
    path = tmp_path / "p.jsonl"
    prompts = random_prompts(5, [3, 8, 15, 30])
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    free = decode_run(pair, path, "draft=none")
    dec = pair.tokenizer.decode
    text = dec(free[0].output_ids)
    stop = [text[10:12], text[20:23]]  # strings the first request really produces, mid-output
    per_line = {"prompt": prompts[1], "stop": dec(free[1].output_ids)[5:7]}
    path2 = tmp_path / "p2.jsonl"
    path2.write_text("".join(json.dumps(x) + "\n" for x in [{"prompt": prompts[0]}, per_line]
                             + [{"prompt": p} for p in prompts[2:]]))
    stop_arg = "workload.stop=[" + ",".join(json.dumps(s) for s in stop) + "]"
    spec = decode_run(pair, path2, stop_arg, *draft)
    plain = decode_run(pair, path2, stop_arg, "draft=none")
    stops_of = [stop, stop + [per_line["stop"]]] + [stop] * 2
    for f, s, p, st in zip(free, spec, plain, stops_of):
        want, reason = cut(f.output_ids, dec, st)
        assert s.output_ids == want == p.output_ids
        if reason:
            assert s.finish_reason == "stop" == p.finish_reason
    assert spec[0].finish_reason == "stop" and len(spec[0].output_ids) < len(free[0].output_ids)
    assert spec[1].finish_reason == "stop" and len(spec[1].output_ids) <= 8


def test_ignore_eos_runs_every_request_to_its_limit(tmp_path, pair):
    path = tmp_path / "p.jsonl"
    prompts = random_prompts(6, [3, 8, 15, 30, 5, 9])
    path.write_text("".join(json.dumps({"prompt": p, "stop": "a"}) + "\n" for p in prompts))
    base = ["draft.topk=2", "draft.num_steps=3", "workload.stop=[' ']"]
    normal = decode_run(pair, path, *base)
    assert any(r.finish_reason == "stop" for r in normal)
    forced = decode_run(pair, path, *base, "workload.ignore_eos=true")
    assert all(r.finish_reason == "length" and len(r.output_ids) == 40 for r in forced)
    for n, f in zip(normal, forced):  # the same tokens up to where the normal run stopped
        assert f.output_ids[:len(n.output_ids)] == n.output_ids


def test_long_non_ascii_stop_strings_fit_the_window_of_byte_tokens():
    """A byte-level tokenizer spends up to 4 tokens per character: the window counts bytes, not characters."""
    from specpipe.decode.stop_strings import StopStrings
    from specpipe.workload.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    for stop in ("中文中文中文", "😀😀😀😀😀", "é" * 20):
        ids = tok.encode("some text before " * 4 + stop)
        assert StopStrings([stop], tok.decode).hit(ids), stop


def test_a_replacement_character_stop_waits_for_the_character_to_finish():
    """Bytes 0xCE 0xA7 are 'Χ': after the first alone the text ends in U+FFFD, which fired a "\\ufffd" stop one
    token before the character was complete. A byte that stays invalid still stops, once it is followed."""
    from specpipe.workload.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    s = StopStrings(["\ufffd"], tok.decode)
    out = [117, 0xCE]
    assert not s.hit(out)  # 'u' + the first byte of 'Χ'
    assert not s.hit(out + [0xA7])  # 'uΧ'
    assert s.hit([117, 0xFF, 118])  # 0xFF is never valid UTF-8: U+FFFD, then 'v'
    assert StopStrings(["x"], tok.decode).hit([117, 0xCE, 120])  # other stops are matched as before


def test_a_replacement_character_stop_leaves_the_prompts_unfinished_character_alone():
    """The prompt ends inside a character (0xE4) that the output's first byte leaves unfinished: its U+FFFD is the
    prompt's text, not the output's (vLLM's rule, and `output_text`'s). Checked over the whole output (the first
    tokens) it did not fire; once the window left token 0 out, the window decoded 0x80 alone as U+FFFD and fired."""
    from specpipe.workload.tokenizer import ByteTokenizer, output_text, prompt_context

    tok = ByteTokenizer()
    prompt = list("😀".encode()) + [0xE4]
    out = [256, 0x80] + list(b"a" * 12)  # a special (decodes to nothing), then a byte that keeps 0xE4 broken
    s = StopStrings(["\ufffd"], tok.decode, context=prompt_context(tok.decode, prompt), silent_ids=tok.special_ids)
    assert "\ufffd" not in output_text(tok, prompt, out)
    assert [k for k in range(1, len(out) + 1) if s.hit(out[:k])] == []


def test_ids_of_a_padded_vocabulary_do_not_hide_a_stop_string(tmp_path):
    """A model's vocabulary padded past its tokenizer's (32000 -> 32064) has ids that decode to nothing, as special
    tokens do. The window counts every token as at least one byte, so 20 of them between "ab" and "c" pushed "ab"
    out of it: the text read "abc" (as vLLM's detokenized text does) and the stop never fired."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from specpipe.decode.requests import make_requests
    from specpipe.workload.tokenizer import HFTokenizer

    t = Tokenizer(models.WordLevel({"a": 0, "b": 1, "c": 2, "x": 3, "[UNK]": 4}, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.save(str(tmp_path / "tok.json"))
    tok = HFTokenizer(tmp_path / "tok.json")
    assert tok.id_limit == 5 and tok.decode([0, 1] + [7] * 20 + [2]) == "a b c"
    (req,) = make_requests([{"prompt": "x"}], tok, 64, 1024, 64, stop=["a b c"])
    out = [0, 1] + [7] * 20 + [2]
    assert not any(req.stop_strings.hit(out[:k]) for k in range(1, len(out)))
    assert req.stop_strings.hit(out)
    assert StopStrings(["a b c"], tok.decode).hit([0, 1, 2])
