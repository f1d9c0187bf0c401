"""A prompt's "response_format" / "regex" / "grammar" becomes its Request's Constraint, compiled by llguidance when
the prompt is read: a bad one is that prompt's own one-paragraph error naming the value, never the run's, and
the other prompts are untouched."""
import json

import pytest

from specpipe.api import prompt_item
from specpipe.decode.requests import make_requests
from specpipe.workload.constraints import Constraint, constraint_fields
from specpipe.workload.prompts import near_miss, read_prompts_file, respelt
from specpipe.workload.tokenizer import ByteTokenizer

llguidance = pytest.importorskip("llguidance")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def parsed(d: dict):
    extra = {}
    why = constraint_fields(d, extra)
    return why, extra.get("constraint")


def accepts(c: Constraint, text: str) -> bool:
    """Whether the constraint's grammar takes `text` as a whole output (byte by byte, then EOS)."""
    tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(ByteVocab()))
    m = llguidance.LLMatcher(tok, c.grammar())
    assert not m.is_error(), m.get_error()
    return m.consume_tokens(list(text.encode())) and m.is_accepting()


class ByteVocab:
    """Bytes 0-255, bos 256, eos 257: the shipped pair's vocabulary, as llguidance's TokenizerWrapper reads it."""
    eos_token_id, bos_token_id, special_token_ids = 257, 256, [256, 257]
    tokens = [bytes([b]) for b in range(256)] + [b"<bos>", b"<eos>"]

    def __call__(self, s):
        return list(s.encode() if isinstance(s, str) else s)


@pytest.mark.parametrize("d, kind, label, good, bad", [
    ({"response_format": {"type": "json_object"}}, "json_object", "json_object", '{"a": [1, 2]}', "[1, 2]"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA,
                                                                  "strict": True}}},
     "json_schema", "json_schema:person", '{"name": "Ada", "age": 36}', '{"name": "Ada"}'),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "json_schema", "json_schema", '{"name": "Ada", "age": 36}', '{"name": "Ada", "age": "x"}'),
    ({"regex": r"\d{4}-\d{2}-\d{2}"}, "regex", "regex", "2024-01-31", "2024-1-31"),
    ({"grammar": 'start: "yes" | "no" | NUM\nNUM: /[0-9]+/'}, "grammar", "grammar", "42", "maybe"),
])
def test_each_shape_parses_into_a_constraint_that_compiles(d, kind, label, good, bad):
    why, c = parsed(d)
    assert why is None and c.kind == kind and c.describe() == label
    assert accepts(c, good) and not accepts(c, bad)


def test_text_and_null_are_no_constraint():
    assert parsed({"response_format": {"type": "text"}}) == (None, None)
    assert parsed({"response_format": None, "regex": None, "grammar": None}) == (None, None)


def test_json_schema_keeps_its_schema_and_is_hashable():
    _, c = parsed({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}})
    assert c.schema() == SCHEMA and c.source == SCHEMA
    assert hash(c) == hash(Constraint("json_schema", json.loads(json.dumps(SCHEMA)), "p"))
    # the properties' order is the output's: a schema that lists them the other way is another grammar
    swapped = {**SCHEMA, "properties": dict(reversed(SCHEMA["properties"].items()))}
    other = Constraint("json_schema", swapped, "p")
    assert other != c and accepts(c, '{"name": "Ada", "age": 36}') and accepts(other, '{"age": 36, "name": "Ada"}')
    assert parsed({"response_format": {"type": "json_object"}})[1].schema() == {"type": "object"}


@pytest.mark.parametrize("d, words", [
    ({"response_format": "json_object"}, ['"response_format" must be an object', '"json_object"']),
    ({"response_format": {"type": "xml"}}, ['"xml"', '"json_schema"', '"regex"']),
    ({"response_format": {"type": "json_schema"}}, ['"json_schema": {"name": "...", "schema": {...}']),
    ({"response_format": {"type": "json_schema", "json_schema": SCHEMA}}, ['without a "schema" object']),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": "yes"}}},
     ['"strict"', '"yes"']),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "nope"}}}},
     ['json_schema "t" is not a schema', "nope"]),
    ({"regex": 5}, ['"regex" must be a string', "got 5"]),
    ({"regex": "(ab"}, ['"regex" "(ab" is not a valid regular expression', "unclosed group", "character 1"]),
    ({"grammar": 'start: foo\nfoo: "a" bar'}, ['"grammar" is not a valid Lark grammar', "line 2, column 6",
                                               '"bar"']),
    ({"grammar": {"type": "json", "value": {}}}, ['"grammar" must be a string', "TGI"]),
    ({"regex": "a+", "grammar": 'start: "a"'}, ['both "regex" and "grammar"']),
    ({"response_format": {"type": "json_object"}, "regex": "a"}, ['both "response_format" and "regex"']),
])
def test_a_bad_constraint_is_one_paragraph_naming_the_value(d, words):
    why, c = parsed(d)
    assert c is None and why and "\n" not in why and "^" not in why
    for w in words:
        assert w in why, (w, why)


def test_a_bad_constraint_fails_only_its_own_line(tmp_path):
    path = tmp_path / "p.jsonl"
    lines = [{"prompt": "a", "regex": "[0-9]+"}, {"prompt": "b", "regex": "(ab"}, {"prompt": "c"},
             {"prompt": "d", "response_format": {"type": "json_object"}, "speculate": False}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    items = read_prompts_file(str(path))
    assert items[1]["error"].startswith('line 2: "regex" "(ab" is not a valid regular expression: unclosed group')
    assert items[1]["prompt"] == "b"
    assert [it.get("constraint") for it in items[::2]] == [Constraint("regex", "[0-9]+"), None]
    assert items[3]["constraint"] == Constraint("json_object") and items[3]["speculate"] is False
    tok = ByteTokenizer()
    reqs = make_requests(items, tok, 8, 64, tok.vocab_size)
    assert [r.finish_reason for r in reqs] == [None, "error", None, None]
    assert [r.constraint for r in reqs] == [Constraint("regex", "[0-9]+"), None, None, Constraint("json_object")]


def test_an_api_dict_prompt_carries_its_constraint_to_the_request():
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    items = [prompt_item({"prompt": "x", "response_format": rf}, 0), prompt_item("y", 1),
             prompt_item({"prompt": "z", "grammar": "start: ("}, 2)]
    tok = ByteTokenizer()
    reqs = make_requests(items, tok, 8, 64, tok.vocab_size)
    assert reqs[0].constraint == Constraint("json_schema", SCHEMA, "person") and reqs[0].finish_reason is None
    assert reqs[1].constraint is None and reqs[1].finish_reason is None
    assert reqs[2].finish_reason == "error" and reqs[2].error.startswith('prompt 2: "grammar" is not a valid Lark')


def test_field_spellings_and_other_engines_fields():
    assert respelt("Regex") == "regex" and respelt("Response-Format") == "response_format"
    assert near_miss("grammer", {}) == "grammar"
    item = prompt_item({"prompt": "x", "Regex": "a"}, 0)
    assert 'write it "regex"' in item["error"]
    item = prompt_item({"prompt": "x", "guided_json": SCHEMA}, 0)
    assert '"guided_json"' in item["error"] and '"response_format"' in item["error"]
    assert "error" not in prompt_item({"prompt": "x", "guided_regex": None}, 0)
