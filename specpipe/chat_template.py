"""Chat templates: `{"messages": [...]}` prompts rendered with the model folder's own Jinja template.

Instruct models (and the EAGLE heads trained on their conversations) expect their chat format; raw text
decodes, but drafts are accepted less often and answers differ from what users of the model see. The
template comes from `chat_template.jinja` or `tokenizer_config.json` ("chat_template", a string or a
list of named templates) and is rendered the way HF transformers' `apply_chat_template` renders it:
a sandboxed Jinja environment with trim_blocks and lstrip_blocks, loop controls, `raise_exception`,
`strftime_now` and a `tojson` filter that keeps non-ASCII text, and the special tokens (`bos_token`,
`eos_token`, ...) as strings. The rendered text already holds the special tokens, so it is encoded
without adding any (no second BOS).
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """A template that cannot be compiled or that refuses the messages (its raise_exception)."""


def _token_text(value: Any) -> Optional[str]:
    """A special token in tokenizer_config.json: a string, or an AddedToken dict with "content"."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _generation_tag():
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant text for training masks with it):
    renders its body unchanged."""
    from jinja2.ext import Extension

    class GenerationTag(Extension):
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    return GenerationTag


class ChatTemplate:
    def __init__(self, source: str, special_tokens: Optional[dict] = None, origin: str = "chat template"):
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise ChatTemplateError(f"the chat template refused these messages: {message}")

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols", _generation_tag()])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"{origin}: not a valid Jinja template ({e})") from None
        self.source = source
        self.origin = origin
        self.takes_content_parts = _iterates_over_content(env, source)
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self.alternates: dict[str, "ChatTemplate"] = {}  # other named templates of the folder ("tool_use")

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: Optional[list] = None,
               documents: Optional[list] = None, **kwargs: Any) -> str:
        """The prompt text for `messages`, ending with the assistant's turn opener. `tools`, `documents` and
        `kwargs` (a line's "chat_template_kwargs", e.g. enable_thinking) reach the template as transformers
        passes them; with tools, a folder's "tool_use" template renders instead of the default one."""
        import jinja2

        if tools is not None and "tool_use" in self.alternates:
            return self.alternates["tool_use"].render(messages, add_generation_prompt, tools, documents, **kwargs)
        messages = [_as_transformers_passes_it(m) for m in messages]
        if not self.takes_content_parts:
            messages = [_joined_text(m) for m in messages]
        try:
            return self._template.render(**{**self.special_tokens, **kwargs}, messages=messages,
                                         add_generation_prompt=add_generation_prompt, tools=tools,
                                         documents=documents)
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            raise ChatTemplateError(f"{self.origin} failed on these messages ({type(e).__name__}: {e})") from None


def _iterates_over_content(env, source: str) -> bool:
    """Whether the template loops over a message's content (`for part in message['content']`): it then takes
    OpenAI content-part lists as they are; other templates expect a string, as vLLM detects it."""
    from jinja2 import nodes

    for loop in env.parse(source).find_all(nodes.For):
        it = loop.iter
        while isinstance(it, nodes.Filter) and it.node is not None:  # for p in m.content | selectattr(...)
            it = it.node
        if isinstance(it, nodes.Getattr) and it.attr == "content":
            return True
        if isinstance(it, nodes.Getitem) and isinstance(it.arg, nodes.Const) and it.arg.value == "content":
            return True
    return False


REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # names of a turn's reasoning; the first is standard


def _as_transformers_passes_it(message: dict) -> dict:
    """transformers 5 drops keys whose value is None (OpenAI dumps hold "tool_calls": null, which templates
    test with `in`) and fills "reasoning_content" and "thinking" from whichever reasoning field is set."""
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in REASONING_FIELDS if k in message), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _joined_text(message: dict) -> dict:
    """A message whose content is a list of text parts, as one string (parts joined by newlines, as vLLM does)."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    return {**message, "content": "\n".join(part["text"] for part in content)}


def load_chat_template(folder: str | Path) -> Optional[ChatTemplate]:
    """The folder's default chat template, or None; its `alternates` hold the folder's other named templates
    (`tool_use`). As transformers reads them: chat_template.jinja and additional_chat_templates/*.jinja when
    present, else tokenizer_config.json's "chat_template" (a string, or a list of named templates)."""
    folder = Path(folder)
    config_file = folder / "tokenizer_config.json"
    config: dict = {}
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ChatTemplateError(f"{config_file}: not valid JSON ({e})") from None
        if not isinstance(config, dict):
            raise ChatTemplateError(f"{config_file}: expected a JSON object at the top level")
    special = {k: _token_text(config.get(k)) for k in SPECIAL_TOKENS}
    special_map = folder / "special_tokens_map.json"  # older checkpoints name them only there (transformers reads both)
    if any(v is None for v in special.values()) and special_map.is_file():
        try:
            mapped = json.loads(special_map.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ChatTemplateError(f"{special_map}: not valid JSON ({e})") from None
        if isinstance(mapped, dict):
            special = {k: v if v is not None else _token_text(mapped.get(k)) for k, v in special.items()}
    named: dict[str, tuple[str, str]] = {}  # name -> (source, origin)
    source = config.get("chat_template")
    if isinstance(source, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        for t in source:
            if isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str):
                named[t["name"]] = (t["template"], f"{config_file} field 'chat_template' ({t['name']})")
    elif isinstance(source, str):
        named["default"] = (source, f"{config_file} field 'chat_template'")
    elif source is not None:
        raise ChatTemplateError(f"{config_file}: field 'chat_template' must be a string or a list of named "
                                f"templates, got {type(source).__name__}")
    files = {"default": folder / "chat_template.jinja"}  # template files win over the config, as in transformers
    extra_dir = folder / "additional_chat_templates"
    if extra_dir.is_dir():
        files.update({f.stem: f for f in sorted(extra_dir.glob("*.jinja"))})
    where = f"{config_file}: field 'chat_template'"
    if any(f.is_file() for f in files.values()):
        named = {name: (f.read_text(), str(f)) for name, f in files.items() if f.is_file()}
        where = f"{folder}: chat_template.jinja and {extra_dir.name}/"
    if not named:
        return None
    if "default" not in named:
        raise ChatTemplateError(f"{where} lists templates {sorted(named)} but none named 'default' (the "
                                f"template for chats without tools)")
    src, origin = named.pop("default")
    default = ChatTemplate(src, special, origin)
    default.alternates = {name: ChatTemplate(text, special, where) for name, (text, where) in named.items()}
    return default


def check_messages(messages: Any) -> Optional[str]:
    """Why `messages` is not an OpenAI-style chat, or None. A message is {"role": str, "content": ...} where
    content is a string, a list of text parts ({"type": "text", "text": str}) or null (an assistant turn
    that only calls tools); other keys (name, tool_calls, ...) go to the template as they are."""
    if not isinstance(messages, list) or not messages:
        return '"messages" must be a non-empty list of {"role": ..., "content": ...} objects'
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return f'"messages"[{i}] must be an object with a string "role"'
        content = m.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            return (f'"messages"[{i}]["content"] must be a string, a list of text parts '
                    f'([{{"type": "text", "text": ...}}]) or null, got {type(content).__name__}')
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and not isinstance(part.get("text"), str):
                return f'"messages"[{i}]["content"][{j}] is a text part without a string "text" field'
            if kind != "text":
                what = f"a part of type {kind!r}" if isinstance(kind, str) else repr(part)[:60]
                return (f'"messages"[{i}]["content"][{j}] is {what}; this text-only pipeline takes '
                        f'{{"type": "text", "text": "..."}} parts')
    return None


CHAT_FIELDS = ("tools", "documents", "chat_template_kwargs")  # a chat line's extras, passed to the template


def check_chat_options(obj: dict) -> Optional[str]:
    """Why a chat line's "tools" (OpenAI's list of tool objects), "documents" (for RAG templates) or
    "chat_template_kwargs" (extra template variables, e.g. Qwen3's {"enable_thinking": false}) are unusable,
    or None."""
    for key, example in (("tools", "tool objects ({\"type\": \"function\", \"function\": {...}})"),
                         ("documents", "objects (e.g. {\"title\": ..., \"text\": ...})")):
        v = obj.get(key)
        if v is not None and (not isinstance(v, list) or not all(isinstance(x, dict) for x in v)):
            return f'"{key}" must be a list of {example}'
    kwargs = obj.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        return '"chat_template_kwargs" must be an object of template variables, e.g. {"enable_thinking": false}'
    reserved = sorted(set(kwargs or {}) & {"messages", "tools", "documents", "add_generation_prompt"})
    if reserved:
        return f'"chat_template_kwargs" may not set {reserved[0]!r} (give "messages", "tools", "documents" as fields)'
    return None
