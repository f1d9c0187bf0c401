"""Stop strings: a request ends at the token that completes one of its stop strings (HF `stop_strings`).

Matched in the output's text (vLLM's rule: HF also fires on a stop string that begins in the prompt), checked
on the host as committed tokens are appended, over a window of the newest tokens only, long enough to hold the
longest stop string: every token stands for at least one byte of text (byte-level and byte-fallback tokens
exactly one), and the margin covers tokens that decode to nothing (special tokens, the ids of a padded vocabulary).
So the cost per token does not grow with the output. The tokens are kept up to and including the completing one,
so the text ends with (or just past) the stop string. A stop string that spells a special token (`<|im_end|>`)
stops at that token's id.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

from specpipe.workload.tokenizer import clean_start, decode_after


class StopStrings:
    """`decode`: the tokenizer's; `special_ids`: ids of special tokens spelled as one of the stop strings
    (decoding skips special tokens, so their text never appears: the id itself stops); `context`: the
    prompt's last ids (`tokenizer.prompt_context`), so the output's first tokens read as they do after the
    prompt (a SentencePiece continuation keeps its leading space)."""

    def __init__(self, stops: Sequence[str], decode: Callable[[list], str], special_ids: Sequence[int] = (),
                 context: Sequence[int] = (), silent_ids: Sequence[int] = (), silent_from: Optional[int] = None):
        self.stops = tuple(stops)
        self.decode = decode
        self.special_ids = frozenset(special_ids)
        self.silent = frozenset(silent_ids)  # ids that decode to nothing (special tokens): the window skips them
        # and the ids past every token of the tokenizer's (a model's padded vocabulary), which decode to nothing too
        self.silent_from = silent_from
        self.context = list(context)
        self.window = max(len(s.encode("utf-8")) for s in self.stops) + 8  # a token is at least one byte
        # a stop string holding U+FFFD is matched only against finished characters: a trailing U+FFFD may be the
        # first bytes of a character the next token completes (vLLM holds such text back too)
        self.replacement = any("\ufffd" in s for s in self.stops)

    def is_silent(self, t: int) -> bool:
        return t in self.silent or (self.silent_from is not None and t >= self.silent_from)

    def hit(self, output_ids: list) -> bool:
        """Whether the newest token completed a stop string (called after every appended token)."""
        if output_ids and output_ids[-1] in self.special_ids:
            return True
        start = max(len(output_ids) - self.window, 0)
        if self.silent or self.silent_from is not None:
            # widen past the window's silent tokens (and those the widening brings in)
            quiet = self.is_silent
            extra = sum(map(quiet, output_ids[start:]))
            while extra > 8 and start > 0:  # the window's margin covers 8
                wider = max(start - (extra - 8), 0)
                extra = 8 + sum(map(quiet, output_ids[wider:start]))
                start = wider
        if start > 0:  # a window that starts inside a character would decode its whole byte run as U+FFFD
            start = clean_start(self.decode, output_ids, start)
        if start <= 4:  # the output's first tokens may finish (or break) a character the prompt left open: read them
            text = decode_after(self.decode, self.context, output_ids)  # after the prompt, as the output's text is
        else:
            text = self.decode(output_ids[start:])
        if self.replacement:
            text = text.rstrip("\ufffd")
        return any(s in text for s in self.stops)
