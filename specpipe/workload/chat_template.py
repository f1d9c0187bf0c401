"""Chat templates: `{"messages": [...]}` prompts rendered with the model folder's own Jinja template.

Instruct models (and the EAGLE heads trained on their conversations) expect their chat format; raw text
decodes, but drafts are accepted less often and answers differ from what users of the model see. The
template comes from `chat_template.jinja` or `tokenizer_config.json` ("chat_template", a string or a
list of named templates) and is rendered the way HF transformers' `apply_chat_template` renders it:
a sandboxed Jinja environment with trim_blocks and lstrip_blocks, loop controls, `raise_exception`,
`strftime_now` and a `tojson` filter that keeps non-ASCII text, and the special tokens (`bos_token`,
`eos_token`, ...) as strings. The rendered text already holds the special tokens, so it is encoded
without adding any (no second BOS). The sandbox also caps what one render may build and how long it may run
(`template_sandbox`): a template from a downloaded folder is code nobody reviewed.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

MAX_ERROR_CHARS = 500  # of a template's own words in an error (raise_exception's message, an exception's text)
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
    def __init__(self, source: Optional[str], special_tokens: Optional[dict] = None, origin: str = "chat template",
                 missing: str = ""):
        """`source` None: the folder has only other named templates (`tool_use`), and `missing` says why a chat
        without tools cannot be rendered."""
        import jinja2

        from specpipe.workload.template_sandbox import BoundedSandbox

        def raise_exception(message):
            raise ChatTemplateError(f"the chat template refused these messages: {_short(message)}")

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True,
                             extensions=["jinja2.ext.loopcontrols", _generation_tag()])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_source(source) if source is not None else None
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"{origin}: not a valid Jinja template ({e})") from None
        self.source = source
        self._env = env
        self.origin = origin
        self.missing = missing
        self.takes_content_parts = source is not None and _iterates_over_content(env, source)
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self.alternates: dict[str, "ChatTemplate"] = {}  # other named templates of the folder ("tool_use")

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: Optional[list] = None,
               documents: Optional[list] = None, **kwargs: Any) -> str:
        """The prompt text for `messages`, ending with the assistant's turn opener. `tools`, `documents` and
        `kwargs` (a line's "chat_template_kwargs", e.g. enable_thinking) reach the template as transformers
        passes them; with tools, a folder's "tool_use" template renders instead of the default one."""
        if tools is not None and "tool_use" in self.alternates:
            return self.alternates["tool_use"].render(messages, add_generation_prompt, tools, documents, **kwargs)
        if self._template is None:
            raise ChatTemplateError(self.missing)
        messages = [_as_transformers_passes_it(m) for m in messages]
        if not self.takes_content_parts:
            messages = [_joined_text(m) for m in messages]
        from specpipe.workload.template_sandbox import TemplateLimitError, render_bounded

        try:
            return render_bounded(self._env, self._template, {**self.special_tokens, **kwargs, "messages": messages,
                                  "add_generation_prompt": add_generation_prompt, "tools": tools,
                                  "documents": documents})
        except ChatTemplateError:
            raise
        except TemplateLimitError as e:
            raise ChatTemplateError(f"{self.origin} went past a limit on these messages: {e}") from None
        except Exception as e:  # whatever the template's code raises (1/0, a huge range(), deep recursion)
            raise ChatTemplateError(f"{self.origin} failed on these messages ({type(e).__name__}: "
                                    f"{_short(e)})") from None


def _short(what: Any) -> str:
    """A template's words for an error, cut to MAX_ERROR_CHARS (a message it built can be megabytes)."""
    text = str(what)
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + f"... ({len(text)} characters)"


def _iterates_over_content(env, source: str) -> bool:
    """Whether the template loops over a message's content (`for part in message['content']`, also through a
    slice, a filter, a `set` alias or a macro's parameter): it then takes OpenAI content-part lists as they are;
    other templates expect a string, as vLLM detects it."""
    from jinja2 import nodes

    def unwrap(n):
        while True:
            if isinstance(n, nodes.Filter) and n.node is not None:  # m.content | selectattr(...)
                n = n.node
            elif isinstance(n, nodes.Getitem) and isinstance(n.arg, nodes.Slice):  # m.content[1:]
                n = n.node
            else:
                return n

    def is_content(n, aliases) -> bool:
        n = unwrap(n)
        return (isinstance(n, nodes.Getattr) and n.attr == "content") or (
            isinstance(n, nodes.Getitem) and isinstance(n.arg, nodes.Const) and n.arg.value == "content") or (
            isinstance(n, nodes.Name) and n.name in aliases)

    tree = env.parse(source)
    macros = {m.name: [a.name for a in m.args] for m in tree.find_all(nodes.Macro)}
    aliases: set = set()
    for _ in range(3):  # aliases of aliases
        for a in tree.find_all(nodes.Assign):
            if isinstance(a.target, nodes.Name) and is_content(a.node, aliases):
                aliases.add(a.target.name)
        for call in tree.find_all(nodes.Call):
            params = macros.get(call.node.name, []) if isinstance(call.node, nodes.Name) else []
            aliases.update(p for p, arg in zip(params, call.args) if is_content(arg, aliases))
            aliases.update(kw.key for kw in call.kwargs if kw.key in params and is_content(kw.value, aliases))
    return any(is_content(loop.iter, aliases) for loop in tree.find_all(nodes.For))


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


# the special tokens of the classes transformers 5 builds folders as (LlamaTokenizer over a SentencePiece BPE file,
# Qwen2Tokenizer and GPT2Tokenizer over a byte-level one) when the folder names none: a template's {{ bos_token }}
# still renders them. A folder transformers reads as saved (TokenizersBackend) has no defaults.
CLASS_SPECIAL_TOKENS = {
    "LlamaTokenizer": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
    "Qwen2Tokenizer": {"unk_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"},
    "GPT2Tokenizer": {"unk_token": "<|endoftext|>", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"},
}


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ChatTemplateError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ChatTemplateError(f"{path}: expected a JSON object at the top level")
    return data


def _special_tokens(folder: Path, config: dict, tokenizer_class: Optional[str]) -> dict:
    """The special tokens as transformers 5 gives them to a template: tokenizer_config.json's; for a folder
    saved without "added_tokens_decoder" (older checkpoints), special_tokens_map.json's replace them; what
    neither names is the default of the class transformers builds (`tokenizer_class`: LlamaTokenizer's "<s>")."""
    special = {k: config[k] for k in SPECIAL_TOKENS if k in config}
    special_map = folder / "special_tokens_map.json"
    if "added_tokens_decoder" not in config and special_map.is_file():
        special.update({k: v for k, v in _read_json(special_map).items() if k in SPECIAL_TOKENS})
    defaults = CLASS_SPECIAL_TOKENS.get(tokenizer_class or "", {})
    return {k: _token_text(special[k]) if k in special else defaults.get(k) for k in SPECIAL_TOKENS}


def load_chat_template(folder: str | Path, tokenizer_class: Optional[str] = None) -> Optional[ChatTemplate]:
    """The folder's default chat template, or None; its `alternates` hold the folder's other named templates
    (`tool_use`). As transformers reads them: chat_template.jinja and additional_chat_templates/*.jinja when
    present, else tokenizer_config.json's "chat_template" (a string, or a list of named templates). Every file
    is read as UTF-8 (templates hold tokens like DeepSeek's "<｜User｜>"), whatever the locale. `tokenizer_class`:
    the class transformers builds the folder's tokenizer as (`tokenizer_class_built`), whose defaults fill the
    special tokens the folder does not name."""
    folder = Path(folder)
    config_file = folder / "tokenizer_config.json"
    config: dict = _read_json(config_file) if config_file.is_file() else {}
    special = _special_tokens(folder, config, tokenizer_class)
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
        named = {}
        for name, f in files.items():
            if f.is_file():
                try:
                    named[name] = (f.read_text(encoding="utf-8"), str(f))
                except (OSError, UnicodeDecodeError) as e:
                    raise ChatTemplateError(f"{f}: cannot be read as UTF-8 text ({e})") from None
        where = f"{folder}: chat_template.jinja and {extra_dir.name}/"
    if not named:
        return None
    if "default" in named:
        src, origin = named.pop("default")
        default = ChatTemplate(src, special, origin)
    else:  # only named ones (tool_use): chats with tools render; others cannot, as in transformers
        default = ChatTemplate(None, special, where, missing=(
            f"{where} holds only the templates {sorted(named)} and none named 'default' (the template for chats "
            f"without tools); give this chat \"tools\", or add a default template"))
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
