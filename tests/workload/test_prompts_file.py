"""Prompts files are streamed with a cap on each line: /dev/zero, an endless pipe, or a line of many megabytes
end the read at once with one paragraph (they read until memory ran out, a MemoryError traceback), and a file is
read only as far as the run uses it. A JSON error keeps its place in the line."""
import io
import json
import sys
import time
import tracemalloc

import pytest

from specpipe.errors import InputError
from specpipe.workload import lines
from specpipe.workload.prompts import NOT_JSON_PROBE, read_prompts_file


class Endless(io.RawIOBase):
    """Standard input that gives `line` again and again, one per read, and fails the test once it is read more
    than `most` times (a reader that wants it all fails after `most` reads)."""

    def __init__(self, line: bytes, most: int):
        self.line, self.most, self.reads = line, most, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        self.reads += 1
        assert self.reads <= self.most, "read past what the run uses"
        buffer[:len(self.line)] = self.line
        return len(self.line)


@pytest.fixture
def stdin(monkeypatch):
    """Sets standard input to an Endless stream (and forgets any stream read before)."""
    monkeypatch.setattr(lines, "_STREAMS", {})

    def use(line: bytes, most: int) -> Endless:
        stream = Endless(line, most)
        fake = io.TextIOWrapper(io.BufferedReader(stream, buffer_size=len(line)))
        fake.isatty = lambda: False
        monkeypatch.setattr(sys, "stdin", fake)
        return stream
    return use


def test_dev_zero_ends_at_the_line_cap_with_one_paragraph():
    start = time.monotonic()
    with pytest.raises(InputError) as e:
        read_prompts_file("/dev/zero")
    assert time.monotonic() - start < 30
    msg = str(e.value)
    assert msg.startswith("workload.prompts_file='/dev/zero': line 1 is longer than 16 MiB, the cap on one prompt's "
                          "line") and "\n" not in msg


def test_a_line_past_the_cap_names_its_number(tmp_path, monkeypatch):
    monkeypatch.setattr(lines, "MAX_LINE_BYTES", 1000)
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "a"}) + "\n\n" + json.dumps({"prompt": "x" * 2000}) + "\n")
    with pytest.raises(InputError, match="line 3 is longer than 1000 bytes, the cap on one prompt's line"):
        read_prompts_file(str(path))
    assert read_prompts_file(str(path), limit=1) == [{"prompt": "a", "where": "line 1"}]  # never reached


def test_an_endless_standard_input_is_read_only_as_far_as_the_run_uses_it(stdin):
    stream = stdin(b'{"prompt": "a"}\n', most=10)
    assert [it["prompt"] for it in read_prompts_file("-", limit=2)] == ["a", "a"]
    assert stream.reads <= 3
    # the next job of an in-process sweep gets the same lines, and those past them from where the read stopped
    assert [it["where"] for it in read_prompts_file("-", limit=4)] == ["line 1", "line 2", "line 3", "line 4"]


def test_an_endless_stream_of_lines_that_are_no_json_is_refused_after_the_probe(stdin):
    stdin(bytes(range(1, 10)) + b"\n", most=NOT_JSON_PROBE + 10)  # (what /dev/urandom gives, roughly)
    with pytest.raises(InputError, match=f"none of its first {NOT_JSON_PROBE} non-blank lines is a UTF-8 JSON "
                                         f"object"):
        read_prompts_file("-")


def test_standard_input_of_zeros_ends_at_the_cap(stdin, monkeypatch):
    monkeypatch.setattr(lines, "MAX_LINE_BYTES", 5000)
    stdin(b"\0" * 1000, most=10)
    with pytest.raises(InputError, match=r"prompts_file='-' \(standard input\): line 1 is longer than 5000 bytes"):
        read_prompts_file("-")


def test_a_file_is_read_no_further_than_its_limit(tmp_path):
    """Two prompts, then 64 MiB with no line end: workload.num_prompts=2 reads the prompts and stops (the whole
    file was read into memory first)."""
    path = tmp_path / "p.jsonl"
    with open(path, "wb") as f:
        f.write(b'{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c"}\n')
        f.truncate(64 * 2 ** 20)  # (sparse: no disk used)
    tracemalloc.start()
    try:
        items = read_prompts_file(str(path), limit=2)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [it["prompt"] for it in items] == ["a", "b"] and peak < 8 * 2 ** 20, peak


def test_json_errors_keep_their_place_in_the_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"prompt": "a\x01b"}\n{"prompt": "a" "b"}\n{"prompt": }\n{"prompt": "ok"}\n')
    items = read_prompts_file(str(path))
    assert [it.get("error") for it in items] == [
        "line 1: not valid JSON (Invalid control character at column 14)",
        "line 2: not valid JSON (Expecting ',' delimiter at column 16)",
        "line 3: not valid JSON (Expecting value at column 12)", None]
