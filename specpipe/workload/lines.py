"""A prompts file's lines, streamed and bounded: a file, standard input (`-`) or a pipe, read a chunk at a time.

Reading the whole input first made `workload.prompts_file=/dev/zero` (or `- < /dev/zero`) read until memory ran
out. Here no line longer than MAX_LINE_BYTES is ever held: past it the input is refused (InputError, exit 2),
because finding that line's end could mean reading forever (/dev/zero, an endless pipe), and a line that long is
not a prompt (16 MiB is ~4M tokens, past any model's context) but a file of another kind. A regular file is read
only as far as its lines are used (workload.num_prompts=5 of a 10 GB file reads five lines); standard input and
pipes give their bytes once, so the lines read from them are kept for the next job of an in-process sweep.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, Optional

from specpipe.errors import InputError

MAX_LINE_BYTES = 16 * 2 ** 20  # one prompt's line; a longer one ends the read (InputError)
CHUNK_BYTES = 2 ** 20


class LineTooLong(Exception):
    def __init__(self, line: int):
        super().__init__(line)
        self.line = line


def split_lines(read: Callable[[int], bytes], cap: Optional[int] = None,
                chunk: Optional[int] = None) -> Iterator[bytes]:
    """The lines of a byte stream (`read(n)` gives up to n bytes, b"" at its end), without their "\\n" (a "\\r\\n"
    line keeps its "\\r", which JSON reads as white space). A stream whose first line has no "\\n" but bare CRs
    (classic Mac OS) is split at those. Raises LineTooLong with the line's number once a line passes `cap`
    bytes (MAX_LINE_BYTES unless given), having read at most `cap + chunk` bytes of it."""
    cap, chunk = cap or MAX_LINE_BYTES, chunk or CHUNK_BYTES
    sep: Optional[bytes] = None  # decided at the first "\n", or (none in the first line) at the cap or the end
    pending: list[bytes] = []  # the line read so far, in pieces (no separator in them)
    size, n = 0, 0
    while True:
        data = read(chunk)
        if sep is None and (b"\n" in data or not data or size + len(data) > cap):
            head = b"".join(pending) + data
            sep = b"\r" if b"\n" not in head and b"\r" in head.strip() else b"\n"
            pending, size, data = [], 0, head
        if not data:
            yield b"".join(pending)
            return
        if sep is None or sep not in data:
            pending.append(data)
            size += len(data)
            if size > cap:
                raise LineTooLong(n + 1)
            continue
        parts = data.split(sep)
        for part in parts[:-1]:
            n += 1
            if size + len(part) > cap:
                raise LineTooLong(n)
            yield b"".join(pending) + part if size else part
            pending, size = [], 0
        pending, size = [parts[-1]], len(parts[-1])
        if size > cap:
            raise LineTooLong(n + 1)


class _Replayed:
    """Lines of a stream that can be read once (standard input, a pipe), kept as they are read so that every
    reader (each job of an in-process sweep) gets them all; a reader that stops early leaves the rest unread."""

    def __init__(self, stream: BinaryIO):
        self.lines: list[bytes] = []
        self.live = split_lines(_reader(stream))
        self.error: Optional[LineTooLong] = None
        self.ended = False

    def __iter__(self) -> Iterator[bytes]:
        i = 0
        while True:
            if i < len(self.lines):
                yield self.lines[i]
                i += 1
                continue
            if self.error is not None:
                raise self.error
            if self.ended:
                return
            try:
                self.lines.append(next(self.live))
            except StopIteration:
                self.ended = True
            except LineTooLong as e:
                self.error = e


_STREAMS: dict[str, _Replayed] = {}  # "-" or a pipe's path -> its lines, read once for every job


def _stdin() -> BinaryIO:
    if sys.stdin is None or sys.stdin.isatty():
        what = "closed" if sys.stdin is None else "a terminal"
        raise InputError(f"workload.prompts_file='-' reads the prompts from standard input, which is {what} "
                         "here; pipe a JSON-lines file in: python -m specpipe workload.prompts_file=- < "
                         "prompts.jsonl")
    return sys.stdin.buffer


def _reader(stream: BinaryIO) -> Callable[[int], bytes]:
    """`read1` where the stream has it: what a pipe holds now, not a wait until a whole chunk has come (a pipe fed
    slowly starts decoding at its first line)."""
    return getattr(stream, "read1", stream.read)


def _file_lines(f: BinaryIO) -> Iterator[bytes]:
    with f:
        yield from split_lines(_reader(f))


def prompt_lines(path: str) -> Iterator[bytes]:
    """The lines of `workload.prompts_file` (`-`: standard input; a pipe such as <(zcat p.jsonl.gz), /dev/stdin
    or a FIFO is read once and kept). Raises InputError for a path that cannot be read and, while iterating, for
    a line longer than MAX_LINE_BYTES."""
    p = Path(path)
    try:
        if path == "-" or not (p.is_file() or not p.exists()):
            if path not in _STREAMS:
                _STREAMS[path] = _Replayed(_stdin() if path == "-" else open(p, "rb"))
            lines: Iterator[bytes] = iter(_STREAMS[path])
        else:  # (opened here: a missing file is refused before the first line is asked for)
            lines = _file_lines(open(p, "rb"))
    except FileNotFoundError:
        raise InputError(f"workload.prompts_file={path!r} does not exist (give a JSON-lines file with one "
                         f'{{"prompt": "..."}} object per line, or leave it unset for the built-in prompts)') from None
    except (IsADirectoryError, PermissionError) as e:
        raise InputError(f"workload.prompts_file={path!r} cannot be read ({e.strerror}); give a readable "
                         "JSON-lines file") from None
    return _bounded(lines, path)


def _mib(n: int) -> str:
    return f"{n // 2 ** 20} MiB" if n >= 2 ** 20 else f"{n} bytes"


def _bounded(lines: Iterator[bytes], path: str) -> Iterator[bytes]:
    try:
        yield from lines
    except LineTooLong as e:
        what = f"{path!r} (standard input)" if path == "-" else repr(path)
        raise InputError(f"workload.prompts_file={what}: line {e.line} is longer than {_mib(MAX_LINE_BYTES)}, "
                         f"the cap on one prompt's line (a prompt that long is past any model's context, and "
                         f"finding the line's end could mean reading forever); such a file is not JSON lines (a "
                         f"binary file, /dev/zero, or a JSON array written on one line): give one "
                         f'{{"prompt": "..."}} object per line') from None
