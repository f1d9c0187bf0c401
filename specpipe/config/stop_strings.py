"""Stop strings as config values: the checks and escapes `workload.stop` and a prompt's `stop` go through
before any run (the matcher itself is specpipe.decode.stop_strings)."""
from __future__ import annotations

from typing import Optional

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
    for s in values:
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as e:
            return (f"stop string {s!r} holds a lone UTF-16 surrogate ({s[e.start]!r}), which is not Unicode text "
                    f"and can never appear in an output")
    return None
