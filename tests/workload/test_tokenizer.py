"""HF tokenizers as real checkpoints ship them: output text read after the prompt, stop strings over
byte-fallback runs and special tokens, and tokenizer.json files saved with truncation or padding on."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from specpipe.decode.stop_strings import StopStrings
from specpipe.workload.tokenizer import ByteTokenizer, HFTokenizer, decode_after, output_text, prompt_context

CORPUS = ["The cat sat on the mat.", "I'm here, you're there.", "Hello world, hello there, cat."] * 20


def llama2_style(path: Path, **save) -> None:
    """A Llama-2-like tokenizer.json: SentencePiece BPE (▁ for spaces, one stripped at the start), byte fallback
    (<0x..> tokens: every non-ASCII character here is spelled in bytes) and a <s> post-processor."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    def metaspace(t):
        t.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])

    plain = Tokenizer(models.BPE())
    metaspace(plain)
    plain.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    plain.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=120, show_progress=False))
    learnt = json.loads(plain.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in sorted(learnt["vocab"], key=learnt["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learnt["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    metaspace(tok)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    if save.get("truncate"):
        tok.enable_truncation(max_length=save["truncate"])
    if save.get("pad"):
        tok.enable_padding(length=save["pad"], pad_id=2, pad_token="</s>")
    tok.save(str(path))
    if "byte_fallback" in save:  # a file saved without it (False), or before tokenizers had the key (None)
        saved = json.loads(path.read_text())
        if save["byte_fallback"] is None:
            del saved["model"]["byte_fallback"]
        else:
            saved["model"]["byte_fallback"] = save["byte_fallback"]
        path.write_text(json.dumps(saved))


@pytest.fixture(scope="module")
def sp(tmp_path_factory) -> HFTokenizer:
    path = tmp_path_factory.mktemp("llama2") / "tokenizer.json"
    llama2_style(path)
    return HFTokenizer(path, eos_token_id=2, bos_token_id=1)


def split(tok, prompt: str, whole: str) -> tuple[list, list]:
    """(prompt ids, output ids) of `whole`, which starts with `prompt` and tokenizes with its ids first."""
    p, w = tok.encode(prompt), tok.encode(whole)
    assert w[:len(p)] == p
    return p, w[len(p):]


def test_output_text_reads_after_the_prompt(sp):
    prompt, out = split(sp, "The cat", "The cat sat on the mat.")
    assert sp.decode(out) == "sat on the mat."  # alone, the first word loses its space (HF decode(output_ids))
    assert output_text(sp, prompt, out) == " sat on the mat."  # vLLM's text: prompt + text reads right
    assert sp.decode(prompt) + output_text(sp, prompt, out) == sp.decode(prompt + out)
    byte = ByteTokenizer()
    ids = byte.encode("naïve ★")
    assert output_text(byte, byte.encode("x"), ids) == "naïve ★"
    # a context that starts inside a character is moved back to its first byte, so the run still decodes
    cjk = sp.encode("猫")
    ctx = prompt_context(sp.decode, cjk + sp.encode("x")[1:])
    assert "\ufffd" not in sp.decode(ctx)
    assert decode_after(sp.decode, [], out) == sp.decode(out)


def first_hit(stops: StopStrings, out: list) -> int:
    return next((n for n in range(1, len(out) + 1) if stops.hit(out[:n])), -1)


@pytest.mark.parametrize("stop", ["麟", "麒麟", "\n\n", "\nI'm", " here,", "mat.", " sat"])
def test_stop_strings_fire_at_the_completing_token(sp, stop):
    """Reference: the first output prefix whose whole text (read after the prompt) holds the stop string. A
    window that starts inside a run of byte tokens decoded that whole run as U+FFFD and missed it."""
    prompt, out = split(sp, "The cat", "The cat sat on the mat. 龍虎鳳凰麒麟\n\nI'm here, 猫 sat.")
    want = next(n for n in range(1, len(out) + 1) if stop in output_text(sp, prompt, out[:n]))
    got = first_hit(StopStrings([stop], sp.decode, context=prompt_context(sp.decode, prompt)), out)
    assert got == want, (stop, got, want)


def test_a_stop_at_the_start_of_the_output_needs_the_prompt(sp):
    prompt, out = split(sp, "The cat", "The cat sat on the mat. The cat sat.")
    assert first_hit(StopStrings([" sat"], sp.decode, context=prompt_context(sp.decode, prompt)), out) == 1
    assert first_hit(StopStrings([" sat"], sp.decode), out) > 1  # without the prompt: only the second one


@pytest.mark.parametrize("specials", [0, 5, 12, 70])
def test_a_prompt_that_ends_in_special_tokens_keeps_the_outputs_space(sp, specials):
    """Special tokens decode to nothing: the context reaches back past them to the prompt's text (up to 64
    tokens), so the output still reads as it does after that text (it lost its first space after 5)."""
    prompt, out = split(sp, "The cat", "The cat sat on the mat.")
    prompt = prompt + [2, 1] * (specials // 2)
    want = " sat on the mat." if specials < 64 else "sat on the mat."  # past the reach: as after no text
    assert output_text(sp, prompt, out) == want
    assert sp.decode(prompt) + output_text(sp, prompt, out) == sp.decode(prompt + out) or specials >= 64


@pytest.mark.parametrize("silent", [0, 8, 9, 40])
def test_stop_strings_see_past_special_tokens_in_the_output(sp, silent):
    """A stop string split by special tokens the model emitted between its pieces (they add no text): the
    window widens past them (with more than 8 the stop was missed)."""
    prompt, head = split(sp, "The cat", "The cat sat on the")
    tail = sp.encode("mat.")[1:]
    out = head + [2] * silent + tail
    stop = "the ma"  # across the specials
    assert stop in output_text(sp, prompt, out)
    stops = StopStrings([stop], sp.decode, context=prompt_context(sp.decode, prompt), silent_ids=sp.special_ids)
    want = next(n for n in range(1, len(out) + 1) if stop in output_text(sp, prompt, out[:n]))
    assert first_hit(stops, out) == want


def test_a_stop_string_that_spells_a_special_token(sp):
    """Decoding skips special tokens, so "</s>" never shows in the text: the id stops instead."""
    assert sp.special_token_id("</s>") == 2 and sp.special_token_id("cat") is None
    out = sp.encode("cat")[1:] + [2] + sp.encode("mat")[1:]
    assert "</s>" not in sp.decode(out)
    stops = StopStrings(["</s>", "xyz"], sp.decode, special_ids=[2])
    assert first_hit(stops, out) == out.index(2) + 1


def test_saved_truncation_and_padding_are_ignored(tmp_path, sp):
    """transformers' tokenizer(prompt) neither truncates nor pads unless asked, whatever tokenizer.json saved."""
    text = "The cat sat on the mat. " * 6
    for name, save in {"truncate": {"truncate": 8}, "pad": {"pad": 400}}.items():
        path = tmp_path / f"{name}.json"
        llama2_style(path, **save)
        raw = json.loads(path.read_text())
        assert raw["truncation" if name == "truncate" else "padding"] is not None
        assert HFTokenizer(path).encode(text) == sp.encode(text)


def test_stream_deltas_add_up_to_the_text_read_after_the_prompt(sp):
    from specpipe.api import _Deltas

    class Req:
        index, finish_reason, error, logprobs = 0, None, None, None

        def __init__(self, prompt_ids, output_ids, finished):
            self.prompt_ids, self.output_ids, self.finished = prompt_ids, output_ids, finished

    prompt, out = split(sp, "The cat", "The cat sat on the mat. 龍虎 I'm here.")
    events = []
    deltas = _Deltas(sp.decode, events.append)
    for n in range(1, len(out) + 1):
        deltas([Req(prompt, out[:n], n == len(out))])
    assert events[0].text == " sat"
    assert "".join(e.text for e in events) == output_text(sp, prompt, out) == " sat on the mat. 龍虎 I'm here."
    assert all("\ufffd" not in e.text for e in events)


def stream_events(tok, prompt: list, out: list) -> list:
    """The StreamEvents of one request whose output grows a token at a time (the last one finishes it)."""
    from specpipe.api import _Deltas

    class Req:
        index, error, logprobs = 0, None, None

        def __init__(self, output_ids, last):
            self.prompt_ids, self.output_ids = prompt, output_ids
            self.finish_reason = "length" if last else None
            self.finished = last

    events = []
    deltas = _Deltas(tok.decode, events.append)
    for n in range(1, len(out) + 1):
        deltas([Req(out[:n], n == len(out))])
    return events


@pytest.mark.parametrize("cut", [1, 2, 4])
def test_a_prompt_that_ends_inside_a_character(cut):
    """Prompt ids may stop inside a UTF-8 character that the output completes: the character is the output's,
    in its text and in its stream (which once dropped it, then re-sent text at the end)."""
    tok = ByteTokenizer()
    whole = tok.encode("东京 cat😀 sat")
    prompt, out = whole[:cut], whole[cut:]
    text = output_text(tok, prompt, out)
    assert text == ("东京 cat😀 sat" if cut < 3 else "京 cat😀 sat")

    events = stream_events(tok, prompt, out)
    assert "".join(e.text for e in events) == text and all("\ufffd" not in e.text for e in events)


@pytest.mark.parametrize("cut", [1, 2, 4])
def test_a_character_the_output_leaves_unfinished_stays_the_prompts(cut):
    """Prompt ids that stop inside a character the output does not complete: the prompt's text holds its
    U+FFFD, the output's text (and stream) does not, and a request with no output ids has no text."""
    tok = ByteTokenizer()
    prompt = tok.encode("东京")[:cut]
    out = tok.encode(" cat sat")
    assert tok.decode(prompt).endswith("\ufffd")
    text = output_text(tok, prompt, out)
    assert text == " cat sat" and output_text(tok, prompt, []) == ""

    events = stream_events(tok, prompt, out)
    assert events[0].text == " " and "".join(e.text for e in events) == text


LLAMA_CLASS_TEXTS = ["The cat sat", " The cat", "  two  spaces", "\nhi cat", "<s>[INST] The cat [/INST] I'm here",
                     "cat</s><s>The mat", "héllo 龍 cat", ""]


@pytest.mark.parametrize("model_type,tokenizer_config", [
    ("llama", {"tokenizer_class": "LlamaTokenizerFast", "legacy": False}),
    ("llama", {"tokenizer_class": "LlamaTokenizer"}),  # legacy unset: transformers 5 defaults to False
    ("llama", {"tokenizer_class": "LlamaTokenizerFast", "legacy": True}),
    ("llama", {"tokenizer_class": "LlamaTokenizer", "add_prefix_space": False}),
    ("llama", {"tokenizer_class": "PreTrainedTokenizerFast"}),  # the file as saved
    ("llama", {}),
    ("mistral", {"tokenizer_class": "LlamaTokenizer"}),  # Mistral folders keep the file in transformers too
])
def test_llama_class_folders_encode_and_decode_as_transformers(tmp_path, model_type, tokenizer_config):
    """A Llama-2-era tokenizer.json (Prepend normalizer) under `tokenizer_class: LlamaTokenizer` gives the ids
    transformers 5's AutoTokenizer gives, which rebuilds it as Metaspace BPE: no "▁" after special tokens
    unless `legacy: true`, none doubled before a leading space. Decoding round-trips as in transformers."""
    from transformers import AutoTokenizer

    from specpipe.models.hf.tokenizer import load_tokenizer
    from specpipe.models.llama import LlamaConfig

    llama2_style(tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", **tokenizer_config}))
    raw = {"model_type": model_type, "architectures": ["LlamaForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    cfg = LlamaConfig(vocab_size=512, hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
                      num_key_value_heads=1, intermediate_size=8, bos_token_id=1, eos_token_id=2)
    mine = load_tokenizer(tmp_path, cfg, raw)
    for text in LLAMA_CLASS_TEXTS:
        ids = hf(text)["input_ids"]
        assert mine.encode(text) == ids, text
        assert mine.decode(ids) == hf.decode(ids, skip_special_tokens=True), text


@pytest.mark.parametrize("byte_fallback", [False, None])
def test_a_llama_class_file_without_byte_fallback_still_falls_back_to_bytes(tmp_path, byte_fallback):
    """transformers 5 builds LlamaTokenizer's BPE with byte_fallback=True whatever the file says: specpipe kept the
    file's model options, so characters outside the vocabulary became <unk> (id 0)."""
    llama2_style(tmp_path / "tokenizer.json", byte_fallback=byte_fallback)
    hf, mine = hf_and_ours(tmp_path, {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
                                      "unk_token": "<unk>"}, bos_token_id=1)
    for text in ["日本語 😀 café", "x\tTab <b>", "héllo 龍 cat"]:
        ids = hf(text)["input_ids"]
        assert 0 not in ids and mine.encode(text) == ids, text
        assert mine.decode(ids) == hf.decode(ids, skip_special_tokens=True) == text, text


def byte_level_style(path: Path) -> None:
    """A GPT-2-style byte-level BPE file (its own split keeps digit runs together, so "10" is one token)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    corpus = CORPUS + ["for i in range(10): print(i * 12)", "In 2024 there were 10 cats and 100 mats."] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<|endoftext|>", "<|im_end|>")])
    tok.save(str(path))


@pytest.mark.parametrize("tokenizer_class,model_type", [("PreTrainedTokenizerFast", "llama"),
                                                        ("Qwen2Tokenizer", "qwen2"), ("GPT2Tokenizer", "llama")])
def test_split_special_tokens_encodes_special_tokens_written_in_text_as_text(tmp_path, tokenizer_class, model_type):
    """tokenizer_config.json's `split_special_tokens: true`: transformers encodes "<|im_end|>" in a prompt as the
    text's pieces, not the special id; specpipe ignored the setting."""
    byte_level_style(tmp_path / "tokenizer.json")
    config = {"tokenizer_class": tokenizer_class, "eos_token": "<|im_end|>", "split_special_tokens": True}
    hf, mine = hf_and_ours(tmp_path, config, model_type=model_type)
    special = mine.special_token_id("<|im_end|>")
    for text in ["call<|im_end|> done", "<|endoftext|>x <|im_end|>"]:
        ids = hf(text)["input_ids"]
        assert special not in ids and mine.encode(text) == ids, text
        assert mine.encode_plain(text) == hf(text, add_special_tokens=False)["input_ids"], text
        assert mine.decode(ids) == hf.decode(ids, skip_special_tokens=True) == text, text
    assert mine.decode([special]) == ""  # the id itself stays special


@pytest.mark.parametrize("model_type,tokenizer_class,rebuilt", [
    ("qwen2", "PreTrainedTokenizerFast", True),  # transformers 5 treats every qwen2 folder as Qwen2Tokenizer
    ("qwen2", "LlamaTokenizerFast", True),
    ("llama", "Qwen2Tokenizer", True),
    ("qwen3", "Qwen2TokenizerFast", True),
    ("qwen3", None, True),  # no class named: transformers builds the model type's Qwen2Tokenizer
    ("qwen3", "no tokenizer_config.json", True),
    ("qwen3", "PreTrainedTokenizerFast", False),
    ("llama", "PreTrainedTokenizerFast", False),
    ("llama", "LlamaTokenizerFast", False),  # a byte-level file under a Llama class is read as saved
    ("mistral", "Qwen2Tokenizer", False),
])
def test_qwen2_class_folders_encode_as_transformers(tmp_path, model_type, tokenizer_class, rebuilt):
    """transformers 5 re-splits a Qwen2Tokenizer folder's byte-level file with Qwen2's rule (each digit
    alone, NFC): "range(10)" then has "1" and "0" where the file's own split has "10"."""
    from transformers import AutoTokenizer

    from specpipe.models.hf.tokenizer import load_tokenizer
    from specpipe.models.llama import LlamaConfig

    byte_level_style(tmp_path / "tokenizer.json")
    if tokenizer_class != "no tokenizer_config.json":
        named = {"tokenizer_class": tokenizer_class} if tokenizer_class else {}
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(
            {**named, "eos_token": "<|im_end|>", "bos_token": None}))
    raw = {"model_type": model_type, "architectures": ["LlamaForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    cfg = LlamaConfig(vocab_size=512, hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
                      num_key_value_heads=1, intermediate_size=8)
    mine = load_tokenizer(tmp_path, cfg, raw)
    texts = ["for i in range(10): print(i * 12)", "In 2024 there were 10 cats.", " lead<|im_end|>tail", "é\u0301 ok"]
    for text in texts:
        ids = hf(text)["input_ids"]
        assert mine.encode(text) == ids, text
        assert mine.decode(ids) == hf.decode(ids, skip_special_tokens=True), text
    from tokenizers import Tokenizer

    as_saved = Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode("range(10)").ids
    assert (hf("range(10)")["input_ids"] != as_saved) == rebuilt  # the case is one where it matters


def test_a_broken_tokenizer_config_stops_the_load(tmp_path):
    """It decides the tokenizer class, legacy, special tokens and chat template: ignoring it changed prompt ids
    without a word (as transformers does, loading fails, here with the file named)."""
    from specpipe.models.hf.errors import CheckpointError
    from specpipe.models.hf.tokenizer import load_tokenizer
    from specpipe.models.llama import LlamaConfig

    llama2_style(tmp_path / "tokenizer.json")
    cfg = LlamaConfig(vocab_size=512, hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
                      num_key_value_heads=1, intermediate_size=8)
    for text, fragment in [('{"tokenizer_class": "LlamaTokenizerFast", "legacy": false,}', "not valid JSON"),
                           ("[1, 2]", "expected a JSON object at the top level, got list")]:
        (tmp_path / "tokenizer_config.json").write_text(text)
        with pytest.raises(CheckpointError, match=fragment) as e:
            load_tokenizer(tmp_path, cfg, {"model_type": "llama"})
        assert str(tmp_path / "tokenizer_config.json") in str(e.value)


def test_ids_the_library_cannot_take_decode_to_nothing(sp):
    """A prompt of negative or huge ids is refused per request, but its record is still written with the prompt
    decoded: tokenizers raised OverflowError there, which lost every completion of the run."""
    ids = sp.encode("The cat sat")
    assert sp.decode([-1, *ids, 2**40, sp.vocab_size]) == sp.decode(ids)
    assert output_text(sp, [-3, 2**33], ids) == sp.decode(ids)


def test_ids_above_the_token_count_still_decode(tmp_path):
    """A vocabulary with gaps in its ids has ids past get_vocab_size(): they are real tokens, not to be dropped."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    t = Tokenizer(models.WordLevel({"a": 0, "b": 1, "c": 5, "[UNK]": 2}, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.save(str(tmp_path / "gap.json"))
    tok = HFTokenizer(tmp_path / "gap.json")
    assert tok.decode([0, 1, 5]) == t.decode([0, 1, 5]) == "a b c" and tok.decode([-1, 5, 2**32]) == "c"
    assert tok.id_limit == 6  # ids decode to nothing from 6 on (stop strings' window), not from the count (4)


CLEAN_UP_CORPUS = CORPUS + ["Don't go! I'm here, isn't it? They're sure.", "It 's a test , isn 't it ?"] * 20
CLEAN_UP_TEXTS = ["Don 't , I 'm here . ok !", "isn 't it ? yes", "They 're 've 's n't", "a , b . c ! d ?", "The cat"]


def non_bpe_style(path: Path, kind: str) -> None:
    """A Unigram file (SentencePiece-like: Metaspace, </s> appended, T5/ALBERT style) or a WordPiece one (BERT
    style): models transformers' clean_up_tokenization applies to."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    if kind == "unigram":
        tok = Tokenizer(models.Unigram())
        tok.normalizer = normalizers.NFKC()
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
        tok.train_from_iterator(CLEAN_UP_CORPUS, trainers.UnigramTrainer(
            vocab_size=150, show_progress=False, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>"))
        tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    else:
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=True)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        tok.train_from_iterator(CLEAN_UP_CORPUS, trainers.WordPieceTrainer(
            vocab_size=200, show_progress=False, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"]))
        tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]",
                                                           special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.save(str(path))


def hf_and_ours(folder, tokenizer_config: dict, bos_token_id=None, model_type="llama"):
    """transformers' AutoTokenizer and specpipe's tokenizer for a Llama folder holding tokenizer.json and this
    tokenizer_config.json."""
    from transformers import AutoTokenizer

    from specpipe.models.hf.tokenizer import load_tokenizer
    from specpipe.models.llama import LlamaConfig

    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    raw = {"model_type": model_type, "architectures": ["LlamaForCausalLM"]}
    (folder / "config.json").write_text(json.dumps(raw))
    cfg = LlamaConfig(vocab_size=512, hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
                      num_key_value_heads=1, intermediate_size=8, bos_token_id=bos_token_id)
    return AutoTokenizer.from_pretrained(str(folder)), load_tokenizer(folder, cfg, raw)


@pytest.mark.parametrize("kind", ["unigram", "wordpiece", "bpe"])
@pytest.mark.parametrize("clean_up", [True, False, None])
def test_text_stays_the_tokenizers_own_and_streams_whole(tmp_path, kind, clean_up):
    """transformers' clean_up_tokenization_spaces rewrites " 'm" as "'m" across the prompt's end and across text a
    stream already sent (a prompt ending in "'" lost it, and the deltas stopped adding up), so specpipe does not
    apply it: encode as transformers, decode as transformers without the clean-up, and the streamed deltas add up
    to the completion's text, which follows the prompt's text exactly."""
    from types import SimpleNamespace

    from specpipe.api import _Deltas

    if kind == "bpe":
        llama2_style(tmp_path / "tokenizer.json")
    else:
        non_bpe_style(tmp_path / "tokenizer.json", kind)
    conf = {"tokenizer_class": "PreTrainedTokenizerFast"}
    if clean_up is not None:
        conf["clean_up_tokenization_spaces"] = clean_up
    hf, mine = hf_and_ours(tmp_path, conf)
    for text in CLEAN_UP_TEXTS:
        ids = hf(text)["input_ids"]
        assert mine.encode(text) == ids, text
        assert mine.decode(ids) == hf.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False), text
    checked = 0
    for head, tail in (("the cat said '", "hello ' to the mat ."), ("i do n", "'t , isn 't it ?"),
                       ("they", "'re here ' ' re . ok")):
        prompt = hf(head, add_special_tokens=False)["input_ids"]
        whole = hf(head + " " + tail, add_special_tokens=False)["input_ids"]
        if whole[:len(prompt)] != prompt:
            continue
        checked += 1
        out = whole[len(prompt):]
        text = output_text(mine, prompt, out)
        assert mine.decode(prompt) + text == mine.decode(whole), (head, text)
        events = []
        deltas = _Deltas(mine.decode, events.append)
        for k in range(1, len(out) + 1):
            deltas([SimpleNamespace(index=0, output_ids=out[:k], finished=k == len(out), prompt_ids=prompt,
                                    finish_reason="length" if k == len(out) else None, error=None)])
        assert "".join(e.text for e in events) == text, head
    assert checked >= 2


LLAMA3_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                r"""\s*[\r\n]+|\s+(?!\S)|\s+""")


@pytest.mark.parametrize("tokenizer_class,add_prefix_space", [
    ("GPT2Tokenizer", None), ("GPT2TokenizerFast", True), ("CodeGenTokenizer", False)])
def test_gpt2_class_folders_encode_as_transformers(tmp_path, tokenizer_class, add_prefix_space):
    """transformers 5 rebuilds a GPT2Tokenizer / CodeGenTokenizer folder as plain GPT-2 byte-level BPE: a
    Llama-3-style file's own Split regex (which keeps "(hello" and "'S" whole) is not applied, and
    `add_prefix_space` puts a space before the text. specpipe read the file as saved: "(hello)" and "HELLO'S"
    got other ids, and with add_prefix_space every prompt did."""
    from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors,
                            trainers)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    corpus = CORPUS + ["(hello) _cat [world] HELLO'S THEY'RE", "x=(cat+mat)/2; In 2024 there were 10 cats."] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=330, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<|bos|>", "<|eos|>")])
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", 330)])
    tok.save(str(tmp_path / "tokenizer.json"))
    conf = {"tokenizer_class": tokenizer_class, "bos_token": "<|bos|>", "eos_token": "<|eos|>"}
    if add_prefix_space is not None:
        conf["add_prefix_space"] = add_prefix_space
    hf, mine = hf_and_ours(tmp_path, conf, bos_token_id=330)
    texts = ["(hello)", "HELLO'S", "x=(cat+mat)/2", "The cat sat", " two  spaces\n\n", "In 2024, 12345 cats",
             "东京 😀 é\u0301", "<|bos|>hi<|eos|>", ""]
    for text in texts:
        ids = hf(text)["input_ids"]
        assert mine.encode(text) == ids, text
        assert mine.encode_plain(text) == hf(text, add_special_tokens=False)["input_ids"], text
        assert mine.decode(ids) == hf.decode(ids, skip_special_tokens=True), text
    as_saved = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert any(as_saved.encode(t).ids != hf(t)["input_ids"] for t in texts)  # the case is one where it matters
