"""Sampling under a constraint is lossless in distribution: every drafter commits the constrained target's law.

A tiny random float64 model over the 6 letters a..f (the letter tokenizer, which llguidance reads through
`ByteVocabulary`) decodes 3 tokens under a regex for thousands of requests, each with its own seed. The exact law
masks the target's logits at each prefix to the tokens the regex still allows there, then applies temperature and
top-p (the order the pipeline uses), and multiplies along the path; the allowed sets come from Python's `re`, not from
llguidance, so the grammar engine is checked too. The regex has path-dependent masks and tokens it forces in the
middle and at the end, so pruning, the masked and renormalised draft rows of rejection sampling and jump-forward's
forced chains (on and off) are all in play. alpha = 1e-4 per chi-square test, as in tests/decode.
"""

import itertools
import json
import re

import pytest
import torch

import specpipe.models.random_tiny as rt
from helpers import chi2_pvalue, letter_model_run
from specpipe.grammar.tree import TreeGrammar
from specpipe.stages.verify_sampling import process_logits

pytest.importorskip("llguidance")

V, T_NEW, ALPHA, N = 6, 3, 1e-4, 3000
TEMP, TOP_P = 0.7, 0.9
PROMPT = "acdbfcceb"  # (the n-gram drafter finds earlier continuations of "a", "b" and "c" here)
# after "a": b or c, then d..f; after "b": d..f, then c (forced); after "c" or "d": e (forced), then a..c. Any
# letters may follow, so the 3-token budget ends every request ("length"), not the grammar (letters have no EOS)
REGEX = "(a[bc][d-f]|b[d-f]c|[cd]e[a-c])[a-f]*"


def allowed_after(prefix: tuple) -> list:
    """The tokens the regex allows after `prefix` (token ids): those some full match continues with."""
    words = ["".join(chr(97 + t) for t in w) for w in itertools.product(range(V), repeat=T_NEW)]
    matches = [w for w in words if re.fullmatch(REGEX, w)]
    head = "".join(chr(97 + t) for t in prefix)
    return sorted({ord(w[len(prefix)]) - 97 for w in matches if w.startswith(head)})


@pytest.fixture(scope="module")
def pair():
    return rt.build_random_tiny(vocab_size=V, init_std=1.0, seed=0, dtype="float64")


@pytest.fixture(scope="module")
def exact(pair):
    """P(t1, t2, t3 | prompt, regex): at each prefix, logits outside the allowed tokens at -inf, then
    temperature/top-p, by enumerating every allowed prefix."""
    base = pair.tokenizer.encode(PROMPT)
    one = torch.ones(1, dtype=torch.float64)

    def probs(prefix):
        with torch.no_grad():
            logits = pair.target.logits(pair.target(torch.tensor([base + list(prefix)]))[:, -1:])  # [1, 1, V]
        keep = torch.zeros(V, dtype=torch.bool)
        keep[allowed_after(tuple(prefix))] = True
        logits = logits.masked_fill(~keep, float("-inf"))
        return process_logits(logits, one * TEMP, one * TOP_P, torch.zeros(1, dtype=torch.long))[0, 0]

    law = torch.zeros((V,) * T_NEW, dtype=torch.float64)
    p1 = probs(())
    for a in range(V):
        if p1[a] == 0:
            continue
        p2 = probs((a,))
        for b in range(V):
            if p2[b] > 0:
                law[a, b] = p1[a] * p2[b] * probs((a, b))
    assert law.sum().sub(1).abs() < 1e-6 and (law > 0).sum() >= 8  # a law with room to be wrong in
    return law.flatten()


def sample(pair, tmp_path, n, *overrides, regex=REGEX):
    """Counts [V**3] of the committed 3-token outputs of n seeded constrained requests, and the run's metrics."""
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": PROMPT, "seed": i, "regex": regex}) + "\n" for i in range(n)))
    out = letter_model_run(pair, path, T_NEW, TEMP, TOP_P, "speculation=static", *overrides)  # (drafts every step)
    counts = torch.zeros(V ** T_NEW, dtype=torch.float64)
    for r in out["requests"]:
        assert r.finish_reason == "length", (r.finish_reason, r.error)
        a, b, c = r.output_ids
        counts[(a * V + b) * V + c] += 1
    return counts, out["metrics"], out["requests"]


JUMP, NO_JUMP = "grammar.jump_forward=true", "grammar.jump_forward=false"
SHAPES = [
    ("none, plain constrained decoding", ["draft=none", NO_JUMP]),
    ("none, forced chains verified through the speculative loop", ["draft=none", JUMP]),
    ("eagle tree", ["draft.topk=2", "draft.num_steps=2", "draft.num_draft_tokens=5", NO_JUMP]),
    ("eagle tree, jump-forward", ["draft.topk=2", "draft.num_steps=2", "draft.num_draft_tokens=5", JUMP]),
    ("eagle chain, jump-forward", ["draft.topk=1", "draft.num_steps=2", JUMP]),
    ("ngram", ["draft=ngram", "draft.num_steps=2", NO_JUMP]),
    ("ngram, jump-forward", ["draft=ngram", "draft.num_steps=2", JUMP]),
    ("standalone chain, rejection sampling", ["draft=standalone", "draft.topk=1", "draft.num_steps=2", NO_JUMP]),
    ("standalone chain, rejection sampling, jump-forward (one-hot rows on forced children)",
     ["draft=standalone", "draft.topk=1", "draft.num_steps=2", JUMP]),
]


@pytest.mark.parametrize("name,overrides", SHAPES, ids=[s[0] for s in SHAPES])
def test_constrained_sampling_matches_the_constrained_target_law(pair, exact, tmp_path, name, overrides):
    counts, m, reqs = sample(pair, tmp_path, N, *overrides)
    speculates = "draft=none" not in overrides or JUMP in overrides
    if speculates:
        assert m["accept_length_mean"] > 1.05, "no draft was ever accepted: the test would not exercise acceptance"
    if JUMP in overrides:  # b.. and c../d.. force a token: the forced chains were drafted
        assert sum(r.grammar_forced_tokens for r in reqs) > N // 4
    elif "draft=none" not in overrides:
        assert sum(r.grammar_forced_tokens for r in reqs) == 0
        assert sum(r.grammar_pruned_tokens for r in reqs) > 0, "no draft was pruned: masking the drafts is untested"
    p = chi2_pvalue(counts, exact)
    assert p > ALPHA, f"{name}: p={p:.2e}"


def test_unmasked_draft_rows_in_rejection_sampling_are_caught(pair, exact, tmp_path, monkeypatch):
    """Rejection sampling against the drafter's raw rows (not restricted to what the grammar allows) over-accepts
    the drafts that survived pruning: the law moves, and the chi-square test sees it (p ~ 1e-12 here). Run without
    jump-forward: with it, most drafts whose rows matter sit under forced tokens, and the shift is too small."""
    def unmasked(self, draft_probs, tokens, parent, old, outs):
        idx = torch.from_numpy(old.clip(min=0))
        return draft_probs.gather(1, idx[:, :, None].expand(-1, -1, draft_probs.shape[-1]))  # [B, Nv, V]

    monkeypatch.setattr(TreeGrammar, "relay_draft_probs", unmasked)
    counts, _, _ = sample(pair, tmp_path, N, "draft=standalone", "draft.topk=1", "draft.num_steps=2", NO_JUMP)
    assert chi2_pvalue(counts, exact) < ALPHA


def test_constrained_sampled_text_depends_on_the_seed_only_not_the_drafter():
    """Target-only verification draws each position's token with plain constrained decoding's coin (masked
    logits): EAGLE trees and chains, n-gram and suffix drafting, with jump-forward on or off, commit exactly the
    tokens draft=none samples under a JSON schema. On the shipped pair, where drafts are accepted."""
    from specpipe import SpecPipe
    from specpipe.workload.prompts import load_prompts

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "kind": {"enum": ["cat", "dog", "fish"]},
                                               "age": {"type": "integer"}},
              "required": ["name", "kind", "age"], "additionalProperties": False}
    rf = {"type": "json_schema", "json_schema": {"name": "pet", "schema": schema}}
    items = [{**it, "seed": 40 + i, "response_format": rf} for i, it in enumerate(load_prompts(None, "heldout", 4))]
    sampling = dict(max_new_tokens=28, temperature=0.7, top_k=40)
    want = [c.output_ids for c in SpecPipe("draft=none", NO_JUMP).generate(items, **sampling)]
    assert len({tuple(w) for w in want}) > 1  # (sampled text, not one forced string)
    for extra in (["draft=none", JUMP], ["draft.topk=4", "draft.num_steps=3", JUMP],
                  ["draft.topk=4", "draft.num_steps=3", NO_JUMP, "workload.batch_size=3"],
                  ["draft.topk=1", "draft.num_steps=4", "workload.batch_size=1", JUMP],
                  ["draft=ngram", "workload.batch_size=2", NO_JUMP], ["draft=suffix", JUMP]):
        sp = SpecPipe(*extra, *(["speculation=static"] if "draft=none" not in extra else []))  # (AL checked)
        got = sp.generate(items, **sampling)
        assert [c.output_ids for c in got] == want, extra
        assert sp.metrics["accept_length_mean"] > 1.2, extra
        assert sum(c.stats["grammar_forced_tokens"] for c in got) > 0 if JUMP in extra else \
            sum(c.stats["grammar_pruned_tokens"] for c in got) > 0, extra
