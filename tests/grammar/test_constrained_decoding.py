"""Constrained requests end to end: every drafter's greedy output equals plain constrained decoding (on the shipped
pair, and on an HF checkpoint with a trained BPE tokenizer, where plain constrained decoding also equals a
reference loop over transformers and llguidance), outputs follow their constraint, free requests beside them are
untouched, and grammar problems stay per request."""
import json
import re

import pytest
import torch

from specpipe import SpecPipe

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

PERSON = {"type": "object", "additionalProperties": False, "required": ["size", "ok", "name", "tags"],
          "properties": {"size": {"enum": ["S", "M", "L"]}, "ok": {"type": "boolean"},
                         "name": {"type": "string", "maxLength": 8},
                         "tags": {"type": "array", "items": {"enum": ["a", "bb"]}, "maxItems": 2}}}
ITEMS = [
    {"prompt": "Name: ", "regex": "[A-Z][a-z]{2,6}"},
    {"prompt": "def add(a, b):\n    return a + b\n", "response_format": {
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}},
    {"prompt": "import os\nimport sys\n"},  # free, beside the constrained ones
    {"prompt": "x = ", "grammar": 'start: num (" + " num)*\nnum: /[0-9]{1,3}/'},
    {"prompt": "{", "response_format": {"type": "json_object"}},
]
DRAFTS = [
    ("none, jump-forward", ["draft=none"]),
    ("ngram", ["draft=ngram", "speculation=static"]),  # (static: every draft verified, whatever the machine's timings)
    ("suffix", ["draft=suffix", "speculation=static"]),
    ("eagle tree", ["draft=eagle", "speculation=static"]),
    ("eagle chain, no jump-forward", ["draft=eagle", "draft.topk=1", "grammar.jump_forward=false",
                                      "speculation=static"]),
    ("eagle, speculation=cost", ["draft=eagle", "speculation=cost"]),
    ("ngram, compiled verify", ["draft=ngram", "compile.verify.target_forward=compile", "speculation=static"]),
]


def generate(*overrides, items=ITEMS, max_new_tokens=72):
    sp = SpecPipe("workload.batch_size=3", *overrides)
    return sp.generate(items, max_new_tokens=max_new_tokens), sp.metrics


@pytest.fixture(scope="module")
def plain():
    out, _ = generate("draft=none", "grammar.jump_forward=false")
    return out


def test_plain_constrained_outputs_follow_their_constraints(plain):
    regex, person, free, grammar, obj = plain
    assert re.fullmatch("[A-Z][a-z]{2,6}", regex.text) and regex.finish_reason == "stop"
    assert person.finish_reason == "stop"
    jsonschema.validate(json.loads(person.text), PERSON)
    assert re.fullmatch(r"[0-9]{1,3}( \+ [0-9]{1,3})*( \+? ?)?", grammar.text)  # (cut by the length limit)
    assert obj.finish_reason == "length" or isinstance(json.loads(obj.text), dict)
    unconstrained, _ = generate("draft=none", items=[dict(ITEMS[2])])
    assert free.output_ids == unconstrained[0].output_ids


@pytest.mark.parametrize("name,overrides", DRAFTS, ids=[d[0] for d in DRAFTS])
def test_every_drafter_commits_what_plain_constrained_decoding_commits(plain, name, overrides):
    out, m = generate(*overrides)
    assert [c.output_ids for c in out] == [c.output_ids for c in plain], name
    assert [c.finish_reason for c in out] == [c.finish_reason for c in plain]
    assert m["accept_length_mean"] > 1.1, "no draft (or forced token) accepted: the test would check nothing"


def test_the_counts_say_what_the_grammar_did(plain):
    out, _ = generate("draft=ngram")
    recs = [c.stats for c in out]
    person = recs[1]
    assert person["constraint"] == "json_schema:person"
    assert person["grammar_forced_tokens"] > 0  # `{"size": "` is forced
    assert person["grammar_pruned_tokens"] > 0  # the n-gram drafts code where JSON must go
    assert person["num_accepted_tokens"] >= person["unconstrained_accepted_tokens"] - person["grammar_forced_tokens"]
    assert "constraint" not in recs[2] and recs[2]["num_draft_tokens"] > 0
    none, _ = generate("draft=none")
    assert none[1].stats["grammar_forced_tokens"] > 0 and none[1].output_ids == plain[1].output_ids


def test_a_bad_constraint_fails_its_own_request_only(plain):
    items = [dict(ITEMS[0]), {"prompt": "a", "regex": "(ab"}, dict(ITEMS[2])]
    out, _ = generate("draft=ngram", items=items)
    assert out[1].finish_reason == "error" and "regex" in out[1].error
    assert out[0].output_ids == plain[0].output_ids and out[2].output_ids == plain[2].output_ids


def test_a_grammar_the_tokenizer_cannot_finish_ends_in_an_error_not_an_invalid_output():
    """A regex that needs a character the byte vocabulary's masks allow, then a run that a length limit cuts: the
    output is a prefix of a valid string, finish_reason says why."""
    out, _ = generate("draft=ngram", items=[{"prompt": "a", "regex": "[0-9]{40}"}], max_new_tokens=8)
    assert out[0].finish_reason == "length" and re.fullmatch("[0-9]{8}", out[0].text)


# ---- an HF checkpoint with a trained BPE tokenizer ---------------------------------------
CORPUS = ['{"name": "Ann", "age": 31, "city": "Paris"}', '{"name": "Bob", "age": 4, "city": "Rome"}',
          "the quick brown fox jumps over the lazy dog", "def add(a, b): return a + b"] * 20
HF_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
             "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "maximum": 99}}}


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A random Llama checkpoint whose tokenizer.json is a byte-level BPE trained here (multi-byte tokens, so masks
    act on real token boundaries)."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = tmp_path_factory.mktemp("hf")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=320, special_tokens=["<eos>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(folder / "tokenizer.json"))
    V = tok.get_vocab_size()
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512,
                                   eos_token_id=0, bos_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval().double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, dtype=p.dtype) / p.shape[-1] ** 0.5)
    model.save_pretrained(folder)
    return folder, model, V


def reference(model, folder, prompt_ids, grammar: str, max_new: int) -> list:
    """Plain constrained greedy decoding outside specpipe: transformers' forward, llguidance's masks built from the
    tokenizer file directly."""
    from llguidance import LLMatcher, LLTokenizer

    lltok = LLTokenizer((folder / "tokenizer.json").read_text(), eos_token=0)
    m = LLMatcher(lltok, grammar)
    ids, out = list(prompt_ids), []
    for _ in range(max_new):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        bits = torch.frombuffer(bytearray(m.compute_bitmask()), dtype=torch.int32)
        allow = ((bits[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).reshape(-1)[: logits.shape[0]].bool()
        t = int(logits.masked_fill(~allow, float("-inf")).argmax())
        out.append(t)
        if t == 0:
            break
        assert m.consume_token(t)
        ids.append(t)
    return out


def eagle_head(folder):
    """A random EAGLE head for the checkpoint, saved beside it (its fc passes the target's features through, so some
    drafts are accepted)."""
    import copy

    from specpipe.models.eagle import EagleHead
    from specpipe.models.hf.load import load_target
    from specpipe.models.hf.save import save_eagle

    target = load_target(folder, dtype="float64")
    head = EagleHead(copy.deepcopy(target.config), target).double()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) / p.shape[-1] ** 0.5)
        h = target.config.hidden_size
        head.fc.weight[:, :h] += torch.eye(h, dtype=head.fc.weight.dtype)
    return save_eagle(head, folder.with_name(folder.name + "_eagle"))


def test_hf_checkpoint_with_a_bpe_tokenizer_matches_a_reference_and_every_drafter(hf_folder):
    from llguidance import LLMatcher
    from tokenizers import Tokenizer

    from specpipe.workload.constraints import Constraint

    folder, model, V = hf_folder
    items = [{"prompt": "Give JSON: ", "response_format": {"type": "json_schema",
                                                           "json_schema": {"name": "p", "schema": HF_SCHEMA}}},
             {"prompt": "the quick ", "regex": "(brown|lazy) (fox|dog)s?"},
             {"prompt": "def add(a, b):"}]
    base = ["model=hf", f"model.path={folder}", "device.dtype=float64"]
    want, _ = generate(*base, "draft=none", "grammar.jump_forward=false", items=items, max_new_tokens=40)
    for it, c in zip(items[:2], want[:2]):
        g = Constraint("json_schema", HF_SCHEMA) if "response_format" in it else Constraint("regex", it["regex"])
        prompt_ids = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(it["prompt"]).ids
        assert c.output_ids == reference(model, folder, prompt_ids, g.grammar(), 40)
        assert LLMatcher.validate_grammar(g.grammar()) == ""
    jsonschema.validate(json.loads(want[0].text), HF_SCHEMA)
    head = eagle_head(folder)
    for extra in (["draft=none"], ["draft=ngram"], ["draft=suffix"], ["draft=standalone", f"draft.path={folder}"],
                  ["draft=eagle", f"draft.path={head}"]):
        pin = ["speculation=static"] if extra != ["draft=none"] else []  # (every draft verified: AL checked below)
        got, m = generate(*base, *extra, *pin, items=items, max_new_tokens=40)
        assert [c.output_ids for c in got] == [c.output_ids for c in want], extra
        if "draft=standalone" in extra:  # the target drafting for itself: every draft the grammar allows is accepted
            assert m["accept_length_mean"] > 2


def test_a_token_the_grammar_refuses_ends_the_request_in_an_error_keeping_the_valid_output(monkeypatch):
    """Should a committed token break the grammar (here: masks switched off, so the target picks freely), the
    request fails with the reason and keeps only the output the grammar accepts; nothing invalid passes as valid."""
    import specpipe.decode.speculative as speculative

    monkeypatch.setattr(speculative, "apply", lambda logits, allowed: logits)
    out, _ = generate("draft=ngram", items=[{"prompt": "Name: ", "regex": "[A-Z][a-z]{2,6}"}])
    c = out[0]
    assert c.finish_reason == "error" and "dead end" in c.error
    assert re.fullmatch("[A-Z][a-z]{0,6}", c.text)  # a valid prefix, possibly empty


def test_a_complete_grammar_stops_a_request_that_ignores_eos(plain):
    out, _ = generate("draft=ngram", "workload.ignore_eos=true", items=[dict(ITEMS[0])])
    assert out[0].finish_reason == "stop" and out[0].text == plain[0].text


def test_the_kv_pool_holds_draft_none_forced_chains():
    """draft=none verifies forced chains of up to grammar.max_forced_tokens + 1 nodes: the pool sized for the run
    (allocator.num_slots=null) leaves room for them, as for a drafter's tree."""
    for jump in ("true", "false"):
        out, _ = generate("draft=none", f"grammar.jump_forward={jump}", "workload.batch_size=1",
                          items=[{"prompt": "Name: ", "regex": "[A-Z][a-z]{3}"}], max_new_tokens=4)
        assert out[0].finish_reason == "length" and out[0].error is None, (jump, out[0].error)
