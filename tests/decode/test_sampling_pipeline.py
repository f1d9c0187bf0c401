"""Speculative sampling through the whole pipeline is distributed exactly as sampling from the target.

A tiny random model over a 6-token vocabulary decodes 3 tokens for thousands of requests (each
with its own seed); the joint law of the 3 tokens is compared with the exact target law
(computed by enumeration) by a chi-square test. alpha = 1e-4 per test: with the 9 tests here,
the false-alarm rate of the file is below 0.1 %. A deliberately wrong verifier is caught.
"""

import pytest
import torch

import specpipe.models.random_tiny as rt
from helpers import chi2_pvalue, letter_model_run
from specpipe.stages.verify_sampling import VerifySampling, process_logits

V, T_NEW, ALPHA, PROMPT = 6, 3, 1e-4, "abcabcab"
TEMP, TOP_P = 0.7, 0.9


@pytest.fixture(scope="module")
def pair():
    return rt.build_random_tiny(vocab_size=V, init_std=1.0, seed=0, dtype="float64")


@pytest.fixture(scope="module")
def exact(pair):
    """P(t1, t2, t3 | prompt) under temperature/top-p, by enumerating every prefix."""
    base = pair.tokenizer.encode(PROMPT)
    one = torch.ones(1, dtype=torch.float64)

    def probs(ids):
        with torch.no_grad():
            logits = pair.target.logits(pair.target(torch.tensor([ids]))[:, -1:])
        return process_logits(logits, one * TEMP, one * TOP_P, torch.zeros(1, dtype=torch.long))[0, 0]

    law = torch.zeros((V,) * T_NEW, dtype=torch.float64)
    p1 = probs(base)
    for a in range(V):
        if p1[a] == 0:
            continue
        p2 = probs(base + [a])
        for b in range(V):
            if p2[b] > 0:
                law[a, b] = p1[a] * p2[b] * probs(base + [a, b])
    return law.flatten()


def sample(pair, tmp_path, n, *overrides):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(f'{{"prompt": "{PROMPT}", "seed": {i}}}\n' for i in range(n)))
    out = letter_model_run(pair, path, T_NEW, TEMP, TOP_P, *overrides)
    counts = torch.zeros(V ** T_NEW, dtype=torch.float64)
    for r in out["requests"]:
        a, b, c = r.output_ids
        counts[(a * V + b) * V + c] += 1
    return counts, out["metrics"]


SHAPES = [
    ("eagle tree", ["draft.topk=2", "draft.num_steps=2", "draft.num_draft_tokens=5"]),
    ("eagle chain", ["draft.topk=1", "draft.num_steps=2"]),
    ("ngram", ["draft=ngram", "draft.num_steps=2"]),
    ("suffix: drafts from earlier requests' sampled outputs", ["draft=suffix", "draft.num_steps=2",
                                                               "draft.num_draft_tokens=5"]),
    ("standalone chain, rejection sampling", ["draft=standalone", "draft.topk=1", "draft.num_steps=2"]),
    ("standalone tree", ["draft=standalone", "draft.topk=2", "draft.num_steps=2", "draft.num_draft_tokens=5"]),
    # trimmed trees: which nodes are verified depends on the draft alone, so the law is unchanged
    ("standalone chain trimmed by speculation=cost", ["draft=standalone", "draft.topk=1", "draft.num_steps=2",
                                                       "speculation=cost"]),
    ("eagle tree trimmed by speculation=adaptive", ["draft.topk=2", "draft.num_steps=2", "draft.num_draft_tokens=5",
                                                    "speculation=adaptive"]),
]


@pytest.mark.parametrize("name,overrides", SHAPES, ids=[s[0] for s in SHAPES])
def test_speculative_sampling_matches_target_law(pair, exact, tmp_path, name, overrides):
    counts, m = sample(pair, tmp_path, 3000, "speculation=static", *overrides)  # (unless a case names its policy)
    assert m["accept_length_mean"] > 1.05, "no draft was ever accepted: the test would not exercise acceptance"
    p = chi2_pvalue(counts, exact)
    assert p > ALPHA, f"{name}: p={p:.2e}"


def test_wrong_verifier_is_caught(pair, exact, tmp_path, monkeypatch):
    original = VerifySampling.sample

    def bonus_from_p(self, probs, tokens, parent, seed, counter):  # ignores the residual
        acc, count, commit = original(self, probs, tokens, parent, seed, counter)
        redraw = probs[:, 0].multinomial(1, generator=torch.Generator().manual_seed(1))[:, 0]
        commit[:, 0] = torch.where(count == 0, redraw, commit[:, 0])
        return acc, count, commit

    monkeypatch.setattr(VerifySampling, "sample", bonus_from_p)
    counts, _ = sample(pair, tmp_path, 3000, "draft.topk=1", "draft.num_steps=2")
    assert chi2_pvalue(counts, exact) < ALPHA


def test_sampling_is_deterministic_given_seeds(pair, tmp_path):
    a, _ = sample(pair, tmp_path, 200, "draft.topk=2", "draft.num_steps=2")
    b, _ = sample(pair, tmp_path, 200, "draft.topk=2", "draft.num_steps=2", "workload.batch_size=7")
    assert torch.equal(a, b)  # batch composition does not change any request's tokens


def test_sampled_text_depends_on_the_seed_only_not_the_drafter():
    """Target-only verification draws each position's token with plain decoding's coin: EAGLE trees and chains,
    n-gram and suffix drafting (whose cross-request cache and neighbours change the trees) commit exactly the
    tokens draft=none samples, at any batch size; only the number of rounds differs. On the shipped pair, where
    drafts are accepted."""
    from specpipe import SpecPipe
    from specpipe.workload.prompts import load_prompts

    items = [{**it, "seed": 40 + i} for i, it in enumerate(load_prompts(None, "heldout", 8))]
    sampling = dict(max_new_tokens=32, temperature=0.7, top_k=40)
    want = [c.output_ids for c in SpecPipe("draft=none").generate(items, **sampling)]
    for extra in (["draft.topk=4", "draft.num_steps=3"], ["draft.topk=1", "draft.num_steps=4", "workload.batch_size=1"],
                  ["draft=ngram", "workload.batch_size=2"], ["draft=suffix", "workload.batch_size=3"]):
        sp = SpecPipe(*extra, "speculation=static")  # (every draft verified: the AL below is the drafter's)
        assert [c.output_ids for c in sp.generate(items, **sampling)] == want, extra
        assert sp.metrics["accept_length_mean"] > 1.2, extra
