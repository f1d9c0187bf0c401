"""Stop strings: a request ends at the token that completes one of its stop strings (HF `stop_strings`).

Checked on the host as committed tokens are appended, over a window of the newest tokens only (long
enough to hold the longest stop string: every token stands for at least one byte of text (byte-level and
byte-fallback tokens exactly one), the margin covers special tokens that decode to nothing), so the cost per token does not grow with the output. The tokens
are kept up to and including the completing one, so the text ends with (or just past) the stop string.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence


class StopStrings:
    def __init__(self, stops: Sequence[str], decode: Callable[[list], str]):
        self.stops = tuple(stops)
        self.decode = decode
        self.window = max(len(s.encode("utf-8")) for s in self.stops) + 8  # a token is at least one byte

    def hit(self, output_ids: list) -> bool:
        """Whether the newest token completed a stop string (called after every appended token)."""
        text = self.decode(output_ids[-self.window:])
        return any(s in text for s in self.stops)


ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def unescape(s: str) -> str:
    """`workload.stop` from the command line: \\n, \\t, \\r and \\\\ are escapes (a shell cannot easily pass a
    newline); any other backslash stays as it is."""
    out, i = [], 0
    while i < len(s):
        if s[i] == "\\" and i + 1 < len(s) and s[i + 1] in ESCAPES:
            out.append(ESCAPES[s[i + 1]])
            i += 2
        else:
            out.append(s[i])
            i += 1
    return "".join(out)


def check_stop(value) -> Optional[str]:
    """Why `value` is not a stop-string list (a string or a list of non-empty strings), or None."""
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, (list, tuple)) or not all(isinstance(s, str) and s for s in values):
        return f"stop must be a non-empty string or a list of them, got {value!r}"
    return None
