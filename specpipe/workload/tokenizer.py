"""Tokenizers a model folder can describe: bytes (the shipped pair) or a `tokenizer.json` (HF `tokenizers`)."""
from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Callable, Optional, Sequence


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; special ids follow. Invalid UTF-8 in output decodes with U+FFFD."""

    def __init__(self, vocab_size: int = 258, bos_token_id: Optional[int] = 256, eos_token_id: Optional[int] = 257):
        if vocab_size < 256:
            raise ValueError(f"a byte tokenizer needs vocab_size >= 256, got {vocab_size}")
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    @cached_property
    def special_ids(self) -> frozenset:
        """Ids past the bytes: they decode to nothing."""
        return frozenset(range(256, self.vocab_size))

    def describe(self) -> dict:
        return {"type": "byte", "vocab_size": self.vocab_size, "bos_token_id": self.bos_token_id,
                "eos_token_id": self.eos_token_id}


class HFTokenizer:
    """A `tokenizer.json` read with the `tokenizers` package (no other tokenizer dependency).

    `encode` adds the special tokens the file's post-processor defines (Llama's BOS, for instance), as
    HF transformers' `tokenizer(prompt)` and vLLM do by default, so a prompt gives the same ids here as
    there. `eos_token_ids`: every id that ends a request (config.json and generation_config.json may
    list several, e.g. Llama-3 instruct's <|end_of_text|> and <|eot_id|>)."""

    def __init__(self, path: str | Path, eos_token_id: Optional[int] = None, bos_token_id: Optional[int] = None,
                 eos_token_ids: Sequence[int] = (), add_special_tokens: bool = True,
                 pipeline: Optional[tuple] = None, split_special_tokens: bool = False):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(path))
        self.pipeline = pipeline  # transformers_pipeline's rebuild, or None: the file as saved
        if pipeline is not None:
            rebuild_as(self._tok, pipeline)
        # tokenizer_config.json's split_special_tokens: special tokens written in a prompt are encoded as text, as
        # transformers does (a rendered chat template's too)
        self._tok.encode_special_tokens = bool(split_special_tokens)
        # a file saved with truncation or padding on would cut or pad every prompt: transformers' tokenizer(...)
        # does neither unless asked, and neither does specpipe
        self._tok.no_truncation()
        self._tok.no_padding()
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_token_id = eos_token_id
        self.eos_token_ids = tuple(dict.fromkeys([*([eos_token_id] if eos_token_id is not None else []),
                                                  *eos_token_ids]))
        self.bos_token_id = bos_token_id
        self.add_special_tokens = add_special_tokens

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=self.add_special_tokens).ids

    def encode_plain(self, text: str) -> list[int]:
        """No special tokens added: for text that already holds them (a rendered chat template)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        # ids the library cannot take (negative, >= 2**32: an errored request's prompt_ids) decode to nothing, as
        # ids past the vocabulary do there, instead of raising OverflowError in the completions writer
        return self._tok.decode([i for i in ids if 0 <= i < 2**32], skip_special_tokens=True)  # the library's u32

    @cached_property
    def id_limit(self) -> int:
        """One past the largest id of any token (a vocabulary may have gaps, so not always vocab_size): the ids of
        a model's padded vocabulary, from here on, decode to nothing."""
        return max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1

    @cached_property
    def special_ids(self) -> frozenset:
        """Ids of special tokens: decoding skips them, so they add no text."""
        return frozenset(i for i, tok in self._tok.get_added_tokens_decoder().items() if tok.special)

    def special_token_id(self, text: str) -> Optional[int]:
        """The id of the special token spelled `text` (decoding skips it, so a stop string cannot see it)."""
        for i, tok in self._tok.get_added_tokens_decoder().items():
            if tok.special and tok.content == text:
                return i
        return None


MISTRAL_TYPES = ("mistral", "mixtral", "ministral", "ministral3", "mistral3", "mistral_large4")
# Qwen2Tokenizer's pre-tokenizer split (transformers 5, models/qwen2/tokenization_qwen2.py)
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
               r"""\s*[\r\n]+|\s+(?!\S)|\s+""")


GPT2_CLASSES = ("GPT2Tokenizer", "CodeGenTokenizer")  # transformers 5 rebuilds both as plain byte-level BPE
# model types transformers 5's AutoTokenizer builds as Qwen2Tokenizer when the folder names no class
QWEN2_TOKENIZER_TYPES = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "qwen3_next")


def transformers_pipeline(tokenizer_json: str, tokenizer_config: dict, model_type: Optional[str]) -> Optional[tuple]:
    """How transformers 5's AutoTokenizer rebuilds this folder's tokenizer, or None when it reads the
    tokenizer.json as saved: ("metaspace", prepend_scheme), ("qwen2", add_prefix_space) or ("gpt2",
    add_prefix_space).

    transformers 5 builds `LlamaTokenizer` and `Qwen2Tokenizer` folders anew from the file's vocabulary and
    merges, ignoring its normalizer, pre-tokenizer and decoder (and it treats every `model_type: qwen2`
    folder as Qwen2Tokenizer, whatever class it names, and a qwen3 or other Qwen folder that names no class,
    in tokenizer_config.json or config.json, as its model type's registered Qwen2Tokenizer):
    - LlamaTokenizer: a Metaspace pre-tokenizer that prepends "▁" to the first piece only (`legacy: false`,
      the default), to every piece between special tokens (`legacy: true`), or never (`add_prefix_space:
      false`). A Llama-2-era file prepends through its normalizer, after every special token too, so a chat
      prompt ("<s>[INST] Hi") or a prompt starting with a space got other ids than transformers and vLLM.
      A byte-level file under that class (Llama-3 vocabularies) is read as saved, as in transformers.
    - Qwen2Tokenizer: NFC, Qwen2's split (every digit alone) and byte-level bytes. Applied to byte-level
      files only: over a SentencePiece vocabulary transformers' rebuild yields ids the model never saw.
    - GPT2Tokenizer, CodeGenTokenizer (byte-level files): GPT-2's own split and byte-level bytes, with no
      normalizer, so a file's Split regex (Llama-3 style), Digits or NFC step is not applied.
    Mistral models keep the file, as in transformers.
    Not followed: `clean_up_tokenization_spaces: true`, with which transformers' decode of a Unigram, WordPiece
    or WordLevel model drops the space before . , ! ? and in contractions ("don 't" -> "don't"). That rewrite
    reaches across the prompt's end and across streamed text already sent (a prompt ending in "'" lost it, the
    deltas stopped adding up), so decoded text stays the tokenizer's own."""
    try:
        model = json.loads(tokenizer_json).get("model", {}).get("type")
    except ValueError:
        return None
    if model != "BPE":
        return None
    if model_type in MISTRAL_TYPES:
        return None
    cls = str(tokenizer_config.get("tokenizer_class") or "").removesuffix("Fast")
    if not cls and model_type in QWEN2_TOKENIZER_TYPES:
        cls = "Qwen2Tokenizer"
    byte_level = '"ByteLevel"' in tokenizer_json
    if model_type == "qwen2" or cls == "Qwen2Tokenizer":
        return ("qwen2", bool(tokenizer_config.get("add_prefix_space") or False)) if byte_level else None
    if cls in GPT2_CLASSES:
        return ("gpt2", bool(tokenizer_config.get("add_prefix_space") or False)) if byte_level else None
    if cls != "LlamaTokenizer" or byte_level:
        return None
    if tokenizer_config.get("add_prefix_space") is False:
        return ("metaspace", "never")
    return ("metaspace", "always" if tokenizer_config.get("legacy") else "first")


def tokenizer_class_built(pipeline: Optional[tuple]) -> Optional[str]:
    """The class transformers 5 builds a folder's tokenizer as, from `transformers_pipeline`'s answer (None: it
    reads the file as saved, TokenizersBackend)."""
    return {"metaspace": "LlamaTokenizer", "qwen2": "Qwen2Tokenizer", "gpt2": "GPT2Tokenizer"}.get(
        pipeline[0]) if pipeline else None


def rebuild_as(tok, pipeline: tuple) -> None:
    """Give a `tokenizers.Tokenizer` the normalizer, pre-tokenizer and decoder that transformers 5 gives the
    class `transformers_pipeline` named."""
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers

    kind, option = pipeline
    # the BPE model's own options too: transformers builds a fresh BPE from the vocabulary and merges, so a
    # Llama-2-era file saved without byte fallback (or before tokenizers had the key) still falls back to bytes
    # instead of <unk> for a character outside the vocabulary
    _bpe_options(tok, dropout=None, unk_token=None, continuing_subword_prefix=None, end_of_word_suffix=None,
                 ignore_merges=False, fuse_unk=kind == "metaspace", byte_fallback=kind == "metaspace")
    if kind == "gpt2":
        tok.normalizer = None
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=option)
        tok.decoder = decoders.ByteLevel()
        return
    if kind == "qwen2":
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=option, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        return
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=option, split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if option != "never":
        steps.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(steps)


def _bpe_options(tok, **options) -> None:
    """Set a `tokenizers` BPE model's options in place (the vocabulary and merges stay)."""
    for name, value in options.items():
        setattr(tok.model, name, value)


CONTEXT_TOKENS = 5  # prompt tokens decoded before an output (vLLM's initial detokenization offset)


def clean_start(decode: Callable[[Sequence[int]], str], ids: Sequence[int], start: int, back: int = 4) -> int:
    """`start`, or up to `back` tokens earlier, so that decoding ids[start:] does not begin inside a character:
    a byte-fallback decoder (Llama-2, Mistral) turns a whole run of byte tokens that starts with a UTF-8
    continuation byte into U+FFFD, valid bytes after it included."""
    return _nearest_clean(start, back, lambda s: not decode(ids[s:]).startswith("\ufffd"))


def _nearest_clean(at: int, back: int, clean: Callable[[int], bool]) -> int:
    """The first of at, at - 1, ..., at - back (not below 0) that is `clean`; `at` when none is."""
    return next((i for i in range(at, max(at - back, 0) - 1, -1) if clean(i)), at)


def prompt_context(decode: Callable[[Sequence[int]], str], prompt_ids: Sequence[int],
                   max_back: int = 64) -> list[int]:
    """The last few prompt ids, starting on a character boundary: the context `decode_after` reads outputs in.
    Prompts that end in special tokens (which decode to nothing) reach back to the last token with text, up
    to `max_back` tokens: a SentencePiece output read after no text at all would lose its first space."""
    prompt_ids = list(prompt_ids)
    if not prompt_ids:
        return []
    start = max(len(prompt_ids) - CONTEXT_TOKENS, 0)
    floor = max(len(prompt_ids) - max_back, 0)
    while start > floor and not decode(prompt_ids[start:]):
        start -= 1
    return prompt_ids[clean_start(decode, prompt_ids, start):]


def complete_end(decode: Callable[[Sequence[int]], str], context: Sequence[int], back: int = 4) -> int:
    """len(context), or up to `back` tokens less, so that context[:end] does not end inside a character: a
    prompt given as ids may stop in the middle of one, which the output then completes."""
    return _nearest_clean(len(context), back, lambda end: not decode(context[:end]).endswith("\ufffd"))


def decode_after(decode: Callable[[Sequence[int]], str], context: Sequence[int], ids: Sequence[int]) -> str:
    """The text of `ids` as it reads after `context` (prompt + text is then the whole text, as in vLLM): decoded
    alone, a SentencePiece continuation loses the space of its first word ("The cat" + "sat"). A character the
    context leaves unfinished and `ids` completes belongs to the output's text."""
    if not context:
        return decode(ids)
    context = list(context)
    before = decode(context[:complete_end(decode, context)])
    whole = decode([*context, *ids])
    return whole[own_start(before, decode(context), whole):]


def own_start(before: str, full: str, whole: str) -> int:
    """Where the output's text starts in `whole` (the context's text and the output's): after `before` (the
    context up to its last complete character), or after `full` (the whole context) when the character the
    context leaves unfinished stays unfinished: its U+FFFD is the prompt's, not the output's."""
    if len(full) > len(before) and whole.startswith(full):
        return len(full)
    # len(before) unless later bytes made the context's own text invalid (byte fallback)
    return next((i for i, (a, b) in enumerate(zip(before, whole)) if a != b), min(len(before), len(whole)))


def output_text(tokenizer, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> str:
    """A request's output text: its ids decoded after the prompt's last tokens (`decode_after`)."""
    return decode_after(tokenizer.decode, prompt_context(tokenizer.decode, prompt_ids), output_ids)


def encode_chat(tokenizer, messages: list[dict], tools: Optional[list] = None, documents: Optional[list] = None,
                chat_template_kwargs: Optional[dict] = None) -> tuple[str, list[int]]:
    """(prompt text, ids) of a chat, rendered with the model folder's chat template (`load_tokenizer` attaches
    it as `tokenizer.chat_template`); a ChatTemplateError when the model has none or it refuses the chat."""
    text = render_chat(tokenizer, messages, tools, documents, chat_template_kwargs)
    return text, encode_rendered(tokenizer, text)


def encode_rendered(tokenizer, text: str) -> list[int]:
    """The ids of a rendered chat: no special tokens added, the template wrote them."""
    return getattr(tokenizer, "encode_plain", tokenizer.encode)(text)


def render_chat(tokenizer, messages: list[dict], tools: Optional[list] = None, documents: Optional[list] = None,
                chat_template_kwargs: Optional[dict] = None) -> str:
    """A chat's prompt text (`encode_chat` without the encoding: a text far beyond the context is refused before
    it is tokenized, as a plain prompt is)."""
    from specpipe.workload.chat_template import ChatTemplateError

    template = getattr(tokenizer, "chat_template", None)
    if template is None:
        why = getattr(tokenizer, "chat_template_error", None) or (
            "this model folder has no chat template (chat_template.jinja, or 'chat_template' in "
            "tokenizer_config.json); give the conversation as one \"prompt\" string in the model's format")
        raise ChatTemplateError(why)
    return template.render(messages, tools=tools, documents=documents, **(chat_template_kwargs or {}))


def stop_token_ids(tokenizer):
    """What ends a request (for `pipeline.stop_set`): `eos_token_ids` when the tokenizer lists several, else its EOS."""
    return getattr(tokenizer, "eos_token_ids", None) or tokenizer.eos_token_id


def tokenizer_from_description(desc: dict, folder: Optional[Path] = None):
    """Build the tokenizer a model folder's `config.json` describes under the key "specpipe_tokenizer"."""
    kind = desc.get("type")
    if kind == "byte":
        return ByteTokenizer(desc.get("vocab_size", 258), desc.get("bos_token_id"), desc.get("eos_token_id"))
    if kind == "hf":
        return HFTokenizer(Path(folder) / desc.get("file", "tokenizer.json"), desc.get("eos_token_id"),
                           desc.get("bos_token_id"), desc.get("eos_token_ids", ()),
                           desc.get("add_special_tokens", True))
    raise ValueError(f"unknown tokenizer type {kind!r} (valid: byte, hf)")


class LetterTokenizer:
    """Tiny vocabularies (tests, toy models): id i is the letter chr(97 + i)."""

    def __init__(self, vocab_size: int, eos_token_id: Optional[int] = None):
        if not 1 <= vocab_size <= 26:
            raise ValueError(f"a letter tokenizer has 1..26 ids, got vocab_size={vocab_size}")
        self.vocab_size, self.eos_token_id, self.bos_token_id = vocab_size, eos_token_id, None

    def encode(self, text: str) -> list[int]:
        ids = [ord(c) - 97 for c in text]
        bad = [c for c, i in zip(text, ids) if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"characters {''.join(sorted(set(bad)))!r} are outside this {self.vocab_size}-letter "
                             f"vocabulary (valid: a..{chr(96 + self.vocab_size)})")
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(97 + i) for i in ids if 0 <= i < self.vocab_size)


def small_or_byte_tokenizer(vocab_size: int, eos_token_id: Optional[int]):
    """Bytes when the vocabulary holds them, else letters."""
    if vocab_size >= 256:
        return ByteTokenizer(vocab_size, bos_token_id=None, eos_token_id=eos_token_id)
    return LetterTokenizer(vocab_size, eos_token_id=None)
