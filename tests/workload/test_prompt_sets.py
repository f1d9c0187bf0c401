"""The built-in prompt sets: `chat` and `code` are chats (for models with a chat template) that go through the
model's template, a model without one fails each of their requests naming the set, and an unknown name's error
lists them all."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from helpers import compose
from specpipe.config.validate import validate
from specpipe.decode.requests import make_requests
from specpipe.errors import ConfigError
from specpipe.workload.chat_template import load_chat_template
from specpipe.workload.prompts import load_prompts
from specpipe.workload.tokenizer import ByteTokenizer, HFTokenizer

REAL = Path.home() / ".cache" / "specpipe" / "SmolLM2-135M-Instruct-float32"  # scripts/get_real_model.py builds it
# SmolLM2-Instruct's template (ChatML with a default system turn)
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
FENCE = re.compile(r"```(\w+)\n(.*?)```", re.S)


def contents(name: str) -> list[str]:
    return [it["messages"][0]["content"] for it in load_prompts(None, name, None)]


@pytest.mark.parametrize("name", ["chat", "code"])
def test_chat_sets_are_24_distinct_one_turn_chats(name):
    items = load_prompts(None, name, None)
    assert len(items) == 24 and not any("error" in it for it in items)
    for n, it in enumerate(items, 1):
        assert it["where"] == f"workload.prompt_set={name}, prompt {n}"
        assert [m["role"] for m in it["messages"]] == ["user"] and it["messages"][0]["content"].strip()
    assert len(set(contents(name))) == 24
    assert load_prompts(None, name, 3) == items[:3]


def test_most_code_requests_carry_10_to_40_lines_of_code_in_several_languages():
    blocks = [FENCE.findall(c) for c in contents("code")]
    sized = [b for b in blocks if b and all(10 <= len(code.splitlines()) <= 40 for _, code in b)]
    assert len(sized) >= 16
    assert {"python", "javascript", "sql", "bash"} <= {lang for b in blocks for lang, _ in b}
    assert sum(not b for b in blocks) >= 3  # a few "write a function that ..." from scratch


def test_code_prefixes_are_plain_prompts():
    items = load_prompts(None, "code_prefixes", None)
    assert len(items) == 12 and items[0] == {"prompt": "def fibonacci(n):\n    "}


def chatml_tokenizer(folder: Path) -> HFTokenizer:
    """A byte-level BPE tokenizer (no merges) with ChatML's special tokens and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    folder.mkdir()
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))},
                               merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": CHATML}))
    ours = HFTokenizer(folder / "tokenizer.json", eos_token_id=tok.token_to_id("<|im_end|>"))
    ours.chat_template = load_chat_template(folder)
    return ours


@pytest.mark.parametrize("name", ["chat", "code"])
def test_every_prompt_renders_through_the_models_chat_template(tmp_path, name):
    tok = chatml_tokenizer(tmp_path / "tok")
    items = load_prompts(None, name, None)
    reqs = make_requests(items, tok, max_new_tokens=8, max_position=8192, vocab_size=tok.vocab_size)
    start = tok.special_token_id("<|im_start|>")
    opener = [start, *tok.encode_plain("assistant\n")]
    for r, it in zip(reqs, items):
        assert r.error is None, r.error
        assert r.prompt.startswith("<|im_start|>system\n") and it["messages"][0]["content"] in r.prompt
        assert r.prompt_ids[:1] == [start] and r.prompt_ids[-len(opener):] == opener  # the template's tokens


def test_a_model_without_a_chat_template_fails_each_chat_naming_the_set():
    tok = ByteTokenizer()  # the shipped pair's: no template
    tok.chat_template = None
    reqs = make_requests(load_prompts(None, "code", 2), tok, max_new_tokens=8, max_position=4096, vocab_size=258)
    for n, r in enumerate(reqs, 1):
        assert r.error.startswith(f"workload.prompt_set=code, prompt {n}: the chat cannot be turned into a prompt")
        assert "no chat template" in r.error


@pytest.mark.skipif(not (REAL / "tokenizer_config.json").is_file(), reason=f"{REAL} not built (make real-model)")
def test_specpipe_renders_the_sets_as_transformers_on_the_real_model():
    transformers = pytest.importorskip("transformers")
    from specpipe.models.hf.config import parse_config, read_config
    from specpipe.models.hf.tokenizer import load_tokenizer

    ours = load_tokenizer(REAL, parse_config(read_config(REAL), REAL / "config.json"))
    theirs = transformers.AutoTokenizer.from_pretrained(str(REAL))
    for name in ("chat", "code"):
        items = load_prompts(None, name, None)
        reqs = make_requests(items, ours, max_new_tokens=8, max_position=8192, vocab_size=ours.vocab_size)
        for r, it in zip(reqs, items):
            want = theirs.apply_chat_template(it["messages"], add_generation_prompt=True, tokenize=True,
                                              return_dict=False)
            assert r.error is None and r.prompt_ids == list(want), it["where"]


def test_an_unknown_set_is_refused_naming_every_set():
    with pytest.raises(ConfigError) as e:
        validate(compose("workload.prompt_set=poems"))
    msg = str(e.value)
    assert "workload.prompt_set='poems' is unknown" in msg
    for name in ("heldout:", "chat:", "code:", "code_prefixes:"):
        assert name in msg
    for name in ("chat", "code", "code_prefixes"):
        validate(compose(f"workload.prompt_set={name}"))  # accepted
