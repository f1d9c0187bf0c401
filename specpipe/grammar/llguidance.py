"""grammar=llguidance: token masks from llguidance (Rust; JSON schema, regex and Lark grammars in one engine).

Why llguidance: it computed masks fastest at both our vocabulary sizes (docs/structured.md has the measurement),
it has no Python dependencies, and it gives the forced tokens a jump-forward drafts. The tokenizer is converted
once per run, on the first constrained request; each request gets its own matcher, advanced by what it commits
and walked (consume, roll back) along each draft tree.
"""
from __future__ import annotations

from functools import cached_property
from typing import Optional, Sequence

import numpy as np


class ByteVocabulary:
    """A vocabulary as llguidance's `TokenizerWrapper` reads it: each id's bytes, EOS and the special ids. For the
    tokenizers that have no tokenizer.json (bytes, letters)."""

    def __init__(self, tokenizer, vocab_size: int, eos: Sequence[int]):
        specials = set(getattr(tokenizer, "special_ids", ())) | set(eos)
        self.eos_token_id = next(iter(eos), None)
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
        self.special_token_ids = sorted(i for i in specials if i < vocab_size)
        self.tokens = [f"<|special_{i}|>".encode() if i in specials else token_bytes(tokenizer, i)
                       for i in range(vocab_size)]
        self._encode = tokenizer.encode

    def __call__(self, text) -> list[int]:
        return self._encode(text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text)


def token_bytes(tokenizer, i: int) -> bytes:
    """Id i's bytes: a byte tokenizer's byte, else its decoded text."""
    if type(tokenizer).__name__ == "ByteTokenizer":
        return bytes([i]) if i < 256 else b""
    return tokenizer.decode([i]).encode()


class LLGuidanceGrammar:
    """The run's engine: compiles each request's constraint into a matcher over the model's vocabulary."""

    def __init__(self, g, tokenizer, vocab_size: int, eos: Sequence[int]):
        self.cfg = g
        self.tokenizer = tokenizer
        self.V = vocab_size
        self.eos = [int(e) for e in eos]
        self.words = -(-vocab_size // 32)  # int32 words of one mask

    @cached_property
    def lltokenizer(self):
        """The vocabulary in llguidance's form (~0.3 s for a 49k BPE vocabulary): built on first use."""
        from llguidance import LLTokenizer, TokenizerWrapper

        hf = getattr(self.tokenizer, "_tok", None)
        eos = self.eos or None
        if hf is not None:  # a tokenizer.json (after any rebuild `workload.tokenizer` applied)
            n = max(self.V, getattr(self.tokenizer, "id_limit", 0))
            return LLTokenizer(hf.to_str(), n_vocab=n, eos_token=eos)
        return LLTokenizer(TokenizerWrapper(ByteVocabulary(self.tokenizer, self.V, self.eos)), eos_token=eos)

    def matcher(self, constraint, consumed: Sequence[int] = ()):
        """(a matcher at the state after `consumed` tokens, None) or (None, why it cannot be built)."""
        from llguidance import LLMatcher

        m = LLMatcher(self.lltokenizer, constraint.grammar(), log_level=0)
        if m.is_error():
            return None, one_line(m.get_error())
        if consumed and not m.consume_tokens(list(consumed)):
            return None, f"the tokens it already generated do not match its constraint ({one_line(m.get_error())})"
        return m, ""

    def fill(self, m, row: np.ndarray) -> None:
        """Write m's mask of allowed next tokens into row [W] int32 (bit t of word t // 32: token t)."""
        m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    @staticmethod
    def forced(m) -> list[int]:
        """The tokens the grammar allows one way only from m's state (jump-forward's chain)."""
        return m.compute_ff_tokens()

    @staticmethod
    def error(m) -> Optional[str]:
        return one_line(m.get_error()) if m.is_error() else None


def one_line(message: str) -> str:
    """llguidance's messages may span lines (a caret under the bad character): one paragraph for errors."""
    return " ".join(part.strip() for part in message.splitlines() if part.strip())
