"""{"messages": [...]} prompts: rendered with the model folder's chat template exactly as transformers'
apply_chat_template renders and tokenizes them (no second BOS), and bad chats fail only their request."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from specpipe.decode.requests import make_requests
from specpipe.workload.chat_template import ChatTemplateError, load_chat_template
from specpipe.workload.tokenizer import HFTokenizer, encode_chat
from specpipe.workload.prompts import read_prompts_file

SPECIALS = ["<|bos|>", "<|eot|>", "<|start|>", "<|end|>", "<|im_start|>", "<|im_end|>"]

# Llama-3 style: BOS from the template, header tokens, trimmed blocks, a system default
LLAMA3 = (
    "{{ bos_token }}{% if messages[0]['role'] != 'system' %}"
    "{{ '<|start|>system<|end|>\n\nYou are helpful.<|eot|>' }}{% endif %}"
    "{% for message in messages %}\n"
    "    {{ '<|start|>' + message['role'] + '<|end|>\n\n' + message['content'] | trim + '<|eot|>' }}\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}{{ '<|start|>assistant<|end|>\n\n' }}{% endif %}")
# Qwen style: namespace, loop controls, tojson of non-ASCII text, raise_exception on a bad role order
QWEN = (
    "{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}\n"
    "  {% if m.role not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role ' + m.role) }}"
    "{% endif %}\n"
    "  {% if m.role == 'system' and not loop.first %}{% continue %}{% endif %}\n"
    "<|im_start|>{{ m.role }}\n{{ m.content }}{% if loop.index0 == ns.last_user %} {{ m.content | tojson }}"
    "{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# assistant turns wrapped in {% generation %} (transformers' assistant-mask tag)
TAGGED = ("{% for m in messages %}<|start|>{{ m.role }}<|end|>{% if m.role == 'assistant' %}{% generation %}"
          "{{ m.content }}<|eot|>{% endgeneration %}{% else %}{{ m.content }}<|eot|>{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}<|start|>assistant<|end|>{% endif %}")

CHATS = [
    [{"role": "user", "content": "  hello there  "}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and ümlaut ★?"}],
]


def byte_bpe_tokenizer(path: Path) -> None:
    """A byte-level BPE tokenizer.json (no merges) with chat special tokens and a BOS post-processor."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    bos = tok.token_to_id("<|bos|>")
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", bos)])
    tok.save(str(path))


def model_folder(tmp_path: Path, template, jinja_file: bool = False) -> Path:
    folder = tmp_path / "tok"
    folder.mkdir(parents=True)
    byte_bpe_tokenizer(folder / "tokenizer.json")
    config = {"bos_token": {"content": "<|bos|>", "special": True}, "eos_token": "<|eot|>"}
    if jinja_file:
        (folder / "chat_template.jinja").write_text(template)
    else:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def ours(folder: Path) -> HFTokenizer:
    tok = HFTokenizer(folder / "tokenizer.json")
    tok.chat_template = load_chat_template(folder)
    return tok


@pytest.mark.parametrize("jinja_file", [False, True], ids=["tokenizer_config", "chat_template.jinja"])
@pytest.mark.parametrize("template", [LLAMA3, QWEN, TAGGED], ids=["llama3", "qwen", "generation-tag"])
def test_render_and_ids_equal_transformers(tmp_path, template, jinja_file):
    transformers = pytest.importorskip("transformers")
    folder = model_folder(tmp_path, template, jinja_file)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), bos_token="<|bos|>",
                                              eos_token="<|eot|>", chat_template=template)
    tok = ours(folder)
    for chat in CHATS:
        text, ids = encode_chat(tok, chat)
        assert text == hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        ref = hf.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
        ref = ref["input_ids"] if isinstance(ref, dict) or hasattr(ref, "keys") else ref
        assert ids == list(ref)
    if template is LLAMA3:  # the template's own BOS only: encoding did not add a second one
        assert ids.count(tok._tok.token_to_id("<|bos|>")) == 1
        assert tok.encode("x")[0] == tok._tok.token_to_id("<|bos|>")  # plain prompts still get it


def test_special_tokens_named_only_in_special_tokens_map(tmp_path):
    """Older checkpoints name bos/eos only in special_tokens_map.json; transformers reads it, so the template's
    {{ bos_token }} renders there as here, and tokenizer_config.json still wins where it names one."""
    transformers = pytest.importorskip("transformers")
    folder = model_folder(tmp_path, LLAMA3)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    del cfg["bos_token"]
    cfg["eos_token"] = "<|eot|>"
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    (folder / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<|bos|>", "eos_token": "<|start|>"}))
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    text, _ = encode_chat(ours(folder), CHATS[0])
    assert text.startswith("<|bos|>") and text == hf.apply_chat_template(CHATS[0], tokenize=False,
                                                                          add_generation_prompt=True)


def test_named_templates_pick_default(tmp_path):
    folder = model_folder(tmp_path, [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": QWEN}])
    assert encode_chat(ours(folder), CHATS[0])[0].startswith("<|im_start|>user\n")
    only_tools = ours(model_folder(tmp_path / "b", [{"name": "tool_use", "template": "TOOLS{{ tools | length }}"}]))
    assert encode_chat(only_tools, CHATS[0], tools=TOOLS)[0] == "TOOLS1"  # as transformers picks tool_use
    with pytest.raises(ChatTemplateError, match=r"holds only the templates \['tool_use'\] and none named 'default'"):
        encode_chat(only_tools, CHATS[0])  # a chat without tools: no template for it, as in transformers


def test_bad_chats_fail_only_their_request(tmp_path):
    folder = model_folder(tmp_path, QWEN)
    lines = [{"messages": CHATS[0]}, {"messages": [{"role": "tool", "content": "x"}]}, {"messages": []},
             {"messages": [{"role": "user", "content": ["parts"]}]}, {"prompt": "plain"},
             {"messages": CHATS[1], "seed": 5}]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    items = read_prompts_file(str(path))
    assert "non-empty list" in items[2]["error"]
    assert """"messages"[0]["content"][0] is 'parts'; this text-only pipeline takes""" in items[3]["error"]
    assert items[5]["seed"] == 5
    tok = ours(folder)
    reqs = make_requests(items, tok, 8, 4096, tok.vocab_size)
    assert [r.finish_reason for r in reqs] == [None, "error", "error", "error", None, None]
    assert "the chat template refused these messages: unknown role tool" in reqs[1].error
    assert reqs[0].prompt == encode_chat(tok, CHATS[0])[0] and reqs[0].prompt_ids == encode_chat(tok, CHATS[0])[1]
    assert reqs[4].prompt_ids == tok.encode("plain")

    plain = HFTokenizer(folder / "tokenizer.json")  # a folder without any chat template
    r = make_requests([items[0]], plain, 8, 4096, plain.vocab_size)[0]
    assert r.finish_reason == "error" and "has no chat template" in r.error


def test_a_chat_far_beyond_the_context_fails_before_it_is_tokenized(tmp_path, monkeypatch):
    # a plain prompt of that size was refused untokenized; a chat holding the same text was tokenized whole
    # first (a 20 MB message: 20 s and 3.6 GB before its refusal)
    tok = ours(model_folder(tmp_path, QWEN))
    monkeypatch.setattr(tok, "encode_plain", lambda text: pytest.fail(f"tokenized {len(text)} characters"))
    chat = {"messages": [{"role": "user", "content": "word " * 30000}], "where": "line 1"}
    r = make_requests([chat], tok, 8, 64, tok.vocab_size)[0]
    assert r.finish_reason == "error" and r.error.startswith(f"line 1: prompt of {len(r.prompt)} characters")
    assert "far more than the model's context of 64 tokens" in r.error and r.prompt.startswith("<|im_start|>user")


def test_a_broken_template_fails_messages_but_not_plain_prompts(tmp_path):
    from specpipe.models.hf.tokenizer import load_tokenizer
    from specpipe.models.llama import LlamaConfig

    folder = model_folder(tmp_path, "{% for m in messages %}{{ m.content }")  # unclosed expression
    cfg = LlamaConfig(vocab_size=300, hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
                      num_key_value_heads=1, intermediate_size=8)
    tok = load_tokenizer(folder, cfg, raw={})
    assert tok.chat_template is None and "not a valid Jinja template" in tok.chat_template_error
    reqs = make_requests([{"prompt": "", "messages": CHATS[0]}, {"prompt": "hi"}], tok, 4, 4096, 300)
    assert "tokenizer_config.json field 'chat_template': not a valid Jinja template" in reqs[0].error
    assert reqs[1].finish_reason is None


PARTS = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
         {"role": "user", "content": [{"type": "text", "text": "2+2?"}, {"type": "text", "text": "Show work."}]}]
# A multimodal-style template: it loops over content parts itself
PARTS_TEMPLATE = ("{% for m in messages %}<|start|>{{ m.role }}<|end|>{% if m.content is string %}{{ m.content }}"
                  "{% else %}{% for p in m['content'] | selectattr('type', 'equalto', 'text') %}[{{ p.text }}]"
                  "{% endfor %}{% endif %}<|eot|>{% endfor %}<|start|>assistant<|end|>")


def test_openai_content_parts(tmp_path):
    """Text parts reach a template that loops over them unchanged (as transformers passes them); a template
    that expects strings gets the parts joined by newlines (vLLM's "string" content format)."""
    transformers = pytest.importorskip("transformers")
    looping = ours(model_folder(tmp_path / "a", PARTS_TEMPLATE))
    assert looping.chat_template.takes_content_parts
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "a" / "tok" / "tokenizer.json"),
                                              bos_token="<|bos|>", eos_token="<|eot|>", chat_template=PARTS_TEMPLATE)
    text, _ = encode_chat(looping, PARTS)
    assert text == hf.apply_chat_template(PARTS, tokenize=False, add_generation_prompt=True)
    assert "[2+2?][Show work.]" in text

    strings = ours(model_folder(tmp_path / "b", QWEN))
    assert not strings.chat_template.takes_content_parts
    joined = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?\nShow work."}]
    assert encode_chat(strings, PARTS) == encode_chat(strings, joined)
    assert PARTS[1]["content"][0] == {"type": "text", "text": "2+2?"}  # the caller's messages are not changed

    path = tmp_path / "p.jsonl"
    bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]}]
    lines = [{"messages": PARTS}, {"messages": bad}, {"messages": [{"role": "user", "content": 5}]},
             {"messages": PARTS[:1] + [{"role": "assistant", "content": None, "tool_calls": []}]},
             {"messages": [{"role": "user", "content": [{"type": "text"}]}]}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    items = read_prompts_file(str(path))
    assert "error" not in items[0] and "error" not in items[3]
    assert """"messages"[0]["content"][0] is a part of type 'image_url'""" in items[1]["error"]
    assert "must be a string, a list of text parts" in items[2]["error"] and "got int" in items[2]["error"]
    assert """"messages"[0]["content"][0] is a text part without a string "text" field""" in items[4]["error"]

THINKING = ("{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>"
            "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
            "enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add ünits", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}}, "required": ["a"]}}}]


def test_tools_and_chat_template_kwargs_reach_the_template(tmp_path):
    """A line's "tools" and "chat_template_kwargs" (Qwen3's enable_thinking) render as transformers'
    apply_chat_template(messages, tools=..., **kwargs) renders them; they belong to chats only."""
    transformers = pytest.importorskip("transformers")
    folder = model_folder(tmp_path, THINKING)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), bos_token="<|bos|>",
                                              eos_token="<|eot|>", chat_template=THINKING)
    lines = [{"messages": CHATS[0], "tools": TOOLS, "chat_template_kwargs": {"enable_thinking": False}},
             {"messages": CHATS[0]}, {"prompt": "x", "tools": TOOLS},
             {"messages": CHATS[0], "chat_template_kwargs": ["enable_thinking"]},
             {"messages": CHATS[0], "chat_template_kwargs": {"messages": []}}, {"messages": CHATS[0], "tools": "add"}]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    items = read_prompts_file(str(path))
    tok = ours(folder)
    reqs = make_requests(items, tok, 8, 4096, tok.vocab_size)
    want = hf.apply_chat_template(CHATS[0], tools=TOOLS, enable_thinking=False, tokenize=False,
                                  add_generation_prompt=True)
    assert reqs[0].prompt == want and "<think>\n\n</think>" in want and '"Add ünits"' in want
    assert reqs[1].prompt == hf.apply_chat_template(CHATS[0], tokenize=False, add_generation_prompt=True)
    assert "<tools>" not in reqs[1].prompt and "<think>" not in reqs[1].prompt
    assert '"tools" goes with "messages"' in reqs[2].error
    assert '"chat_template_kwargs" must be an object' in reqs[3].error
    assert """"chat_template_kwargs" may not set 'messages'""" in reqs[4].error
    assert '"tools" must be a list of tool objects' in reqs[5].error


# Llama-3.1 style: tool calls tested with `in`; a reasoning field; documents (Granite style)
OPENAI_DUMP = ("{% for m in messages %}<|start|>{{ m.role }}<|end|>{% if 'tool_calls' in m %}"
               "CALLS{{ m.tool_calls | length }}"
               "{% else %}{{ m.content }}{% endif %}{% if m.reasoning_content %}"
               "[{{ m.reasoning_content }}|{{ m.thinking }}]"
               "{% endif %}<|eot|>{% endfor %}{% if documents %}{% for d in documents %}<doc>{{ d.text }}</doc>"
               "{% endfor %}{% endif %}<|start|>assistant<|end|>")


def test_messages_reach_the_template_as_transformers_passes_them(tmp_path):
    """None-valued keys dropped ("tool_calls": null from OpenAI dumps), "reasoning" aliased to reasoning_content
    and thinking, documents passed: the text equals apply_chat_template's."""
    transformers = pytest.importorskip("transformers")
    folder = model_folder(tmp_path, OPENAI_DUMP)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), bos_token="<|bos|>",
                                              eos_token="<|eot|>", chat_template=OPENAI_DUMP)
    chat = [{"role": "user", "content": "hi", "tool_calls": None},
            {"role": "assistant", "content": "ok", "reasoning": "because", "name": None},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}, {"id": "2"}]}]
    docs = [{"title": "a", "text": "Doc one."}]
    text, _ = encode_chat(ours(folder), chat, documents=docs)
    assert text == hf.apply_chat_template(chat, documents=docs, tokenize=False, add_generation_prompt=True)
    assert "hi<|eot|>" in text and "[because|because]" in text and "CALLS2" in text and "<doc>Doc one.</doc>" in text


def test_tools_pick_the_tool_use_template(tmp_path):
    """A folder with a "tool_use" template (a named list in tokenizer_config.json, or
    additional_chat_templates/tool_use.jinja) renders chats with tools through it, as transformers does."""
    transformers = pytest.importorskip("transformers")
    tool_use = "TOOLS{{ tools | length }}|" + QWEN
    folder = model_folder(tmp_path, [{"name": "default", "template": QWEN}, {"name": "tool_use", "template": tool_use}])
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), bos_token="<|bos|>",
                                              eos_token="<|eot|>",
                                              chat_template={"default": QWEN, "tool_use": tool_use})
    tok = ours(folder)
    for tools in (None, TOOLS):
        got = encode_chat(tok, CHATS[1], tools=tools)[0]
        assert got == hf.apply_chat_template(CHATS[1], tools=tools, tokenize=False, add_generation_prompt=True)
        assert got.startswith("TOOLS1|") == (tools is not None)
    files = model_folder(tmp_path / "files", QWEN, jinja_file=True)
    (files / "additional_chat_templates").mkdir()
    (files / "additional_chat_templates" / "tool_use.jinja").write_text(tool_use)
    assert encode_chat(ours(files), CHATS[1], tools=TOOLS)[0] == encode_chat(tok, CHATS[1], tools=TOOLS)[0]
    assert encode_chat(ours(files), CHATS[1])[0] == encode_chat(tok, CHATS[1])[0]


@pytest.mark.parametrize("body", ["{{ 1 // 0 }}", "{% for i in range(10**6) %}{% endfor %}",
                                  "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"],
                         ids=["zero-division", "huge-range", "recursion"])
def test_a_template_whose_code_fails_fails_only_its_chat(tmp_path, body):
    """Whatever a template's code raises while rendering (not only Jinja's own errors) is that chat's error;
    it stopped the whole run, plain prompts and other chats included."""
    template = "{% if messages[0].content == 'boom' %}" + body + "{% endif %}" + QWEN
    tok = ours(model_folder(tmp_path, template))
    items = [{"messages": [{"role": "user", "content": "boom"}]}, {"messages": CHATS[0]}, {"prompt": "plain"}]
    reqs = make_requests(items, tok, 8, 4096, tok.vocab_size)
    assert [r.finish_reason for r in reqs] == ["error", None, None]
    assert "failed on these messages" in reqs[0].error


PART_LOOPS = {  # templates that loop over a message's parts, though not as `for p in message.content`
    "macro": ("{% macro show(content) %}{% if content is string %}{{ content }}{% else %}{% for p in content %}"
              "[{{ p.text }}]{% endfor %}{% endif %}{% endmacro %}"
              "{% for m in messages %}<|start|>{{ m.role }}<|end|>{{ show(m.content) }}<|eot|>{% endfor %}"),
    "alias": ("{% for m in messages %}{% set c = m['content'] %}<|start|>{{ m.role }}<|end|>{% if c is string %}"
              "{{ c }}{% else %}{% for p in c %}{{ p.text }}{% if not loop.last %} | {% endif %}{% endfor %}"
              "{% endif %}<|eot|>{% endfor %}"),
    "slice": ("{% for m in messages %}<|start|>{{ m.role }}<|end|>{% if m.content is string %}{{ m.content }}"
              "{% else %}{% for p in m.content[0:] %}({{ p.text }}){% endfor %}{% endif %}<|eot|>{% endfor %}"),
}


@pytest.mark.parametrize("name", sorted(PART_LOOPS))
def test_content_parts_reach_templates_that_loop_over_them_through_a_macro_alias_or_slice(tmp_path, name):
    transformers = pytest.importorskip("transformers")
    template = PART_LOOPS[name] + "<|start|>assistant<|end|>"
    folder = model_folder(tmp_path, template)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), bos_token="<|bos|>",
                                              eos_token="<|eot|>", chat_template=template)
    text, _ = encode_chat(ours(folder), PARTS)
    assert text == hf.apply_chat_template(PARTS, tokenize=False, add_generation_prompt=True)
    assert "2+2?" in text and "Show work." in text and "2+2?\nShow work." not in text  # not joined first


SHOW_SPECIALS = "{{ bos_token }}|{{ eos_token }}|{{ unk_token }}|{{ pad_token }}|{{ messages[0].content }}"


@pytest.mark.parametrize("case", ["llama-class-defaults", "qwen2-class-defaults", "byte-level-llama-class-no-defaults",
                                  "map-overrides-config", "added-tokens-decoder-ignores-map"])
def test_special_tokens_reach_the_template_as_transformers_gives_them(tmp_path, case):
    """A template's {{ bos_token }} and the others: the defaults of the class transformers builds the tokenizer as
    when the folder names none (a Llama-2 template lost its "<s>"; none for a file it reads as saved), and
    special_tokens_map.json over tokenizer_config.json in a folder saved without added_tokens_decoder
    (transformers' legacy path), not in one saved with it."""
    transformers = pytest.importorskip("transformers")
    from test_tokenizer import llama2_style

    from specpipe.models.hf.tokenizer import load_tokenizer
    from specpipe.models.llama import LlamaConfig

    folder = tmp_path / "tok"
    folder.mkdir()
    config: dict = {"chat_template": SHOW_SPECIALS}
    raw = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    if case == "llama-class-defaults":
        llama2_style(folder / "tokenizer.json")
        config["tokenizer_class"] = "LlamaTokenizerFast"
    else:
        byte_bpe_tokenizer(folder / "tokenizer.json")
    if case == "qwen2-class-defaults":
        config.update(tokenizer_class="Qwen2TokenizerFast", eos_token="<|im_end|>")
        raw["model_type"] = "qwen2"
    elif case == "byte-level-llama-class-no-defaults":
        config["tokenizer_class"] = "LlamaTokenizerFast"  # transformers reads a byte-level file as saved
    elif case != "llama-class-defaults":
        config.update(bos_token="<|bos|>", eos_token="<|eot|>")
        (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|end|>"}))
        if case == "added-tokens-decoder-ignores-map":
            config["added_tokens_decoder"] = {}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "config.json").write_text(json.dumps(raw))
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    cfg = LlamaConfig(vocab_size=600, hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
                      num_key_value_heads=1, intermediate_size=8)
    tok = load_tokenizer(folder, cfg, raw)
    chat = [{"role": "user", "content": "hi"}]
    text, _ = encode_chat(tok, chat)
    assert text == hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    expected = {"llama-class-defaults": "<s>|</s>|<unk>||hi", "qwen2-class-defaults": "|<|im_end|>|<|endoftext|>|"
                "<|endoftext|>|hi", "byte-level-llama-class-no-defaults": "||||hi",
                "map-overrides-config": "<|bos|>|<|end|>|||hi",
                "added-tokens-decoder-ignores-map": "<|bos|>|<|eot|>|||hi"}[case]
    assert text == expected


def test_templates_with_non_ascii_text_load_in_any_locale(tmp_path):
    """Templates and tokenizer configs are UTF-8 (DeepSeek's "<｜User｜>"); under LC_ALL=C every chat failed, or
    the model load crashed when the template was chat_template.jinja."""
    import os
    import subprocess
    import sys

    template = "{% for m in messages %}<｜User｜>{{ m.content }}{% endfor %}<｜Assistant｜>"
    for jinja_file in (False, True):
        folder = model_folder(tmp_path / str(jinja_file), template, jinja_file)
        code = ("import sys; from specpipe.workload.chat_template import load_chat_template; "
                "t = load_chat_template(sys.argv[1]); "
                "print(ascii(t.render([{'role': 'user', 'content': 'hi'}])))")
        env = dict(os.environ, LC_ALL="C", LANG="C", PYTHONUTF8="0", PYTHONIOENCODING="ascii")
        p = subprocess.run([sys.executable, "-c", code, str(folder)], env=env, capture_output=True, text=True,
                           timeout=120)
        assert p.returncode == 0, p.stderr[-2000:]
        assert p.stdout.strip() == ascii("<｜User｜>hi<｜Assistant｜>")
