"""A prompt's output constraint: OpenAI's "response_format" (json_object / json_schema), a "regex" or a Lark
"grammar", read from its line (or API dict) into a `Constraint` the decode loop turns into token masks.

llguidance is the grammar engine (docs/structured.md says why): every kind becomes one llguidance grammar string,
checked when the prompt is read, so a bad schema, regex or grammar is that request's own error, never the run's.
llguidance is imported only once a prompt carries a constraint."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Optional

KINDS = ("json_object", "json_schema", "regex", "grammar")
FIELDS = ("response_format", "regex", "grammar")  # a prompt's fields that constrain its output (one at most)
RESPONSE_FORMATS = ("text", "json_object", "json_schema")  # OpenAI's response_format types
ANY_OBJECT = {"type": "object"}  # json_object's schema: any JSON object
JSON_SCHEMA_SHAPE = '{"type": "json_schema", "json_schema": {"name": "...", "schema": {...}, "strict": true}}'
# JSON as models write it, `{"a": 1, "b": [2, 3]}`, and no whitespace elsewhere: with free whitespace a small model
# pads forever (a schema's "x-guidance" may set other options)
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_ERROR = 400  # characters of the engine's message kept in a request's error


@dataclass(frozen=True, eq=False)
class Constraint:
    """kind: one of KINDS; source: the schema (a dict) for json_schema, the pattern or Lark text for regex / grammar,
    None for json_object; name: json_schema's "name" (OpenAI's label for it), "" when it has none.

    Equal and hashed by the schema's JSON text in its own key order, not by dict equality: a schema's
    "properties" order is the order its output writes them, so two schemas that differ only there are two
    grammars (a cache keyed on Constraints must not hand one the other's)."""
    kind: str
    source: Any = None
    name: str = ""

    def _key(self) -> tuple:
        return self.kind, _canonical(self.source), self.name

    def __eq__(self, other) -> bool:
        return isinstance(other, Constraint) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def grammar(self) -> str:
        """The llguidance grammar string (LLMatcher(tokenizer, grammar) takes it)."""
        return _grammar(self.kind, _canonical(self.source))

    def schema(self) -> Optional[dict]:
        """The JSON schema outputs follow (json_object's: any object), or None for regex / grammar."""
        return dict(ANY_OBJECT) if self.kind == "json_object" else self.source if self.kind == "json_schema" else None

    def describe(self) -> str:
        """A short label for metrics and logs: "json_object", "json_schema:<name>", "regex", "grammar"."""
        return f"json_schema:{self.name}" if self.kind == "json_schema" and self.name else self.kind


def _canonical(source) -> str:
    """The source as one string: the text itself, or a schema's JSON in its own key order (never sorted: that
    would reorder the output's properties); the cache key of a grammar, so a million lines of one schema check
    it once."""
    return source if isinstance(source, str) else json.dumps(source)


@lru_cache(maxsize=256)
def _grammar(kind: str, text: str) -> str:
    from llguidance import LLMatcher

    if kind == "regex":
        return LLMatcher.grammar_from_regex(text)
    if kind == "grammar":
        return LLMatcher.grammar_from_lark(text)
    return LLMatcher.grammar_from_json_schema(json.loads(text) if kind == "json_schema" else ANY_OBJECT,
                                              defaults=JSON_LAYOUT)


@lru_cache(maxsize=256)
def _problem(kind: str, text: str) -> str:
    """llguidance's complaint about a constraint ("" when it compiles); no tokenizer needed."""
    try:
        from llguidance import LLMatcher
    except ImportError:
        return "needs the llguidance package, which is not installed (pip install llguidance)"
    try:
        return LLMatcher.validate_grammar(_grammar(kind, text))
    except (ValueError, TypeError) as e:  # (grammar_from_json_schema refuses what is no JSON object)
        return str(e)


CARET = re.compile(r"^\s*[\^~-]+\s*$")  # an ascii-art marker line under the source
LISTING = re.compile(r"^\s*\d+ \| ")  # a source line llguidance quotes ("   2 | foo: bar")
PLACE = re.compile(r"^(?:at )?(\d+)\((\d+)\): ")  # "at 2(6): " -> line 2, column 6 of the grammar


def condense(message: str, kind: str) -> str:
    """llguidance's multi-line message (the source quoted, carets under the place) as one paragraph: the place as
    words, the carets and the quoted source dropped. A regex is compiled inside a one-line wrapper grammar, so the
    wrapper's place is dropped and the regex parser's own caret becomes "at character N" of the pattern."""
    lines = [line for line in message.splitlines() if line.strip()]
    where = ""
    for i, line in enumerate(lines):
        if CARET.match(line) and i > 0 and lines[i - 1] and not LISTING.match(lines[i - 1]):
            echo = lines[i - 1]  # the regex parser's echo of the pattern, the caret under the bad character
            where = f" (at character {len(line) - len(line.lstrip()) - (len(echo) - len(echo.lstrip())) + 1})"
            lines[i - 1] = ""
    kept = [line.strip() for line in lines if line and not CARET.match(line) and not LISTING.match(line)]
    text = " ".join(kept).replace("regex parse error: error: ", "regex parse error: ")
    if kind == "regex":
        error = next((line[len("error: "):] for line in kept if line.startswith("error: ")), None)
        text = error + where if error else PLACE.sub("", text)
    else:
        text = PLACE.sub(lambda m: f"at line {m[1]}, column {m[2]}: ", text)
    return text if len(text) <= MAX_ERROR else text[:MAX_ERROR - 3] + "..."


def _show(value) -> str:
    try:
        return json.dumps(value)[:60]
    except (TypeError, ValueError):
        return repr(value)[:60]


def _response_format(rf) -> tuple[Optional[Constraint], Optional[str]]:
    """OpenAI's response_format as a Constraint (None for "text"); or why it is not one."""
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        valid = ", ".join(map(json.dumps, RESPONSE_FORMATS))
        return None, f'"response_format" must be an object with a "type" ({valid}), got {_show(rf)}'
    t = rf["type"]
    if t not in RESPONSE_FORMATS:
        return None, (f'"response_format" type {_show(t)} is not one specpipe takes; valid: '
                      f'{", ".join(map(json.dumps, RESPONSE_FORMATS))} (for a regex or a Lark grammar, give the '
                      f'prompt a "regex" or "grammar" field)')
    if t == "text":
        return None, None
    if t == "json_object":
        return Constraint("json_object"), None
    js = rf.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
        got = _show(js) if not isinstance(js, dict) else f'"json_schema" without a "schema" object ({_show(js)})'
        return None, f'"response_format" of type "json_schema" must read {JSON_SCHEMA_SHAPE}, got {got}'
    name = js.get("name", "")
    if not isinstance(name, str) or len(name) > 64:
        return None, f'"response_format" json_schema "name" must be a string of 64 characters at most, got ' \
                     f'{_show(name)}'
    if js.get("strict") is not None and not isinstance(js["strict"], bool):
        return None, f'"response_format" json_schema "strict" must be true or false, got {_show(js["strict"])}'
    return Constraint("json_schema", js["schema"], name), None


WHAT = {"json_object": '"response_format" {{"type": "json_object"}} cannot be compiled',
        "json_schema": '"response_format" json_schema{} is not a schema specpipe can follow',
        "regex": '"regex"{} is not a valid regular expression', "grammar": '"grammar" is not a valid Lark grammar'}


def constraint_fields(d: dict, extra: dict) -> Optional[str]:
    """A prompt's "response_format", "regex" or "grammar" into extra["constraint"] (a Constraint; nothing for
    {"type": "text"} or null); why it is unusable (names the value and what is valid), checked by compiling it."""
    given = [k for k in FIELDS if d.get(k) is not None]
    if len(given) > 1:
        return f'has both "{given[0]}" and "{given[1]}"; give one constraint per prompt'
    if not given:
        return None
    key, value = given[0], d[given[0]]
    if key == "response_format":
        c, why = _response_format(value)
        if why or c is None:
            return why
    elif not isinstance(value, str):
        hint = (' (a {"type": ..., "value": ...} grammar is TGI\'s: give "response_format" or "regex" instead)'
                if isinstance(value, dict) and "value" in value else "")
        kind = "a regular expression" if key == "regex" else "a Lark grammar (docs/structured.md)"
        return f'"{key}" must be a string, {kind}, got {_show(value)}{hint}'
    else:
        c = Constraint(key, value)
    try:
        why = _problem(c.kind, _canonical(c.source))
    except (TypeError, ValueError) as e:  # an API dict's schema holding what JSON cannot write (a set, an object)
        why = f"not JSON: {e}"
    if why:
        shown = f" {_show(c.source)}" if c.kind == "regex" else f" {_show(c.name)}" if c.name else ""
        return f"{WHAT[c.kind].format(shown)}: {condense(why, c.kind)}"
    extra["constraint"] = c
    return None
