"""The cross-request cache (draft=suffix): its eviction, and n-gram drafting over corpus + own context."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specpipe.drafters import NgramDrafter, pack_histories
from specpipe.drafters.ngram_trie import SEP
from specpipe.drafters.suffix_cache import SuffixCache
from trie_votes import linked_paths, voted_trie


def cache_of(texts, capacity=1000):
    c = SuffixCache(capacity)
    for t in texts:
        c.add(t)
    return c


def propose(hist, corpus, num_steps=3, topk=1, n=None, min_n=1, max_n=3):
    ctx, lens = pack_histories([hist])
    corpus_t = None if corpus is None else cache_of(corpus).tokens
    t = NgramDrafter(num_steps, topk, n, min_n, max_n).propose(ctx, lens, torch.as_tensor([len(hist) - 1]), corpus_t)
    return t.tokens[0].tolist(), t.parent[0].tolist()


def test_cache_keeps_whole_newest_texts_within_capacity():
    c = cache_of([[1, 2, 3], [4, 5], [6, 7, 8, 9]], capacity=9)
    assert c.tokens.tolist() == [4, 5, SEP, 6, 7, 8, 9, SEP]  # [1 2 3 SEP] dropped whole, not cut
    c.add([10])
    assert c.tokens.tolist() == [4, 5, SEP, 6, 7, 8, 9, SEP, 10, SEP][-len(c):] and len(c) <= 9
    assert c.tokens.tolist() == [6, 7, 8, 9, SEP, 10, SEP]
    c.add(list(range(20, 40)))  # longer than the cache: its newest capacity-1 tokens, alone
    assert c.tokens.tolist() == list(range(32, 40)) + [SEP]
    c.add([])
    assert len(c) == 9 and c.texts_added == 5
    assert len(cache_of([[1, 2]], capacity=1)) == 0  # no room for a token and its separator
    with pytest.raises(ValueError, match="capacity"):
        SuffixCache(-1)


def test_continuation_only_in_the_cache_is_drafted():
    assert propose([5, 6], None) == ([6, 6, 6, 6], [-1, -1, -1, -1])  # nothing to match in its own context
    assert propose([5, 6], [[1, 5, 6, 7, 8, 9]]) == ([6, 7, 8, 9], [-1, 0, 1, 2])


def test_continuations_and_matches_stop_at_text_boundaries():
    # the continuation of "5 6" ends with its text: 7, and no token of the next text
    assert propose([5, 6], [[5, 6, 7], [8, 9]], num_steps=4, n=5) == ([6, 7, 6, 6, 6], [-1, 0, -1, -1, -1])
    # "5 | 6 7": the 2-gram "5 6" spans two texts, so it is no match; "6" -> 7 (n=1) in the cache ties with
    # "6" -> 9 in the request's own context, which is more recent and wins
    assert propose([3, 6, 9, 5, 6], [[4, 5], [6, 7]], num_steps=1)[0] == [6, 9]
    # a longer match in the cache beats a shorter one in the request's own context
    assert propose([3, 6, 9, 5, 6], [[5, 6, 7]], num_steps=1)[0] == [6, 7]
    # among texts, the newest wins ties
    assert propose([5, 6], [[5, 6, 1], [5, 6, 2]], num_steps=1)[0] == [6, 2]


def brute_matches(corpus, hist, min_n, max_n):
    """(n, global position, text, c) for each continuation start c of each text (corpus texts oldest first,
    then the request's own history) whose longest match text[c-n:c] == hist[-n:] has min_n <= n <= max_n."""
    out, offset = [], 0
    texts = [(t, False) for t in corpus] + [(hist, True)]
    for text, own in texts:
        for c in range(1, len(text)):
            n = max((n for n in range(1, max_n + 1) if c >= n and text[c - n:c] == hist[len(hist) - n:]), default=0)
            if n >= min_n:
                out.append((n, offset + c, text, c))
        offset += len(text) + 1
    return sorted(out, key=lambda m: (-m[0], -m[1]))  # longest n, then most recent


@settings(max_examples=150, deadline=None)
@given(hist=st.lists(st.integers(0, 3), min_size=1, max_size=20),
       corpus=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=8), max_size=4),
       k=st.integers(1, 3), s=st.integers(1, 4), min_n=st.integers(1, 2), extra=st.integers(0, 2),
       cut=st.integers(0, 12))
def test_property_drafts_follow_matches_in_the_cache_and_the_context(hist, corpus, k, s, min_n, extra, cut):
    max_n = min_n + extra
    n_nodes = 2 + cut % (k * s)
    tokens, parent = propose(hist, corpus, num_steps=s, topk=k, n=n_nodes, min_n=min_n, max_n=max_n)
    ranked = brute_matches(corpus, hist, min_n, max_n)
    assert tokens[0] == hist[-1] and all(t >= 0 for t in tokens)  # never a separator
    if k == 1:  # a chain: the best match's continuation
        want = ranked[0][2][ranked[0][3]:ranked[0][3] + min(s, n_nodes - 1)] if ranked else []
        assert tokens[1:1 + len(want)] == want and parent[1:1 + len(want)] == list(range(len(want)))
        assert all(p == -1 for p in parent[1 + len(want):])
        return
    best = voted_trie([(n, text[c:]) for n, _, text, c in ranked], k, s, n_nodes)
    got = linked_paths(tokens, parent, n_nodes)
    assert got == best, (hist, corpus, got, best)


def test_repeated_requests_draft_from_earlier_outputs(prompts_file):
    """Served requests that repeat one another: with the cache, later ones draft whole continuations."""
    from helpers import compose, random_prompts
    from specpipe.run import run
    from specpipe.models.random_tiny import build_random_tiny

    pair = build_random_tiny(seed=0, dtype="float64")
    path = prompts_file(random_prompts(5, [30, 40]) * 3)
    common = ["model=random_tiny", "device.dtype=float64", f"workload.prompts_file={path}",
              "workload.max_new_tokens=24", "workload.batch_size=1", "draft=suffix"]
    plain = [r.output_ids for r in run(compose(*common[:-1], "draft=none"), quiet=True, pair=pair)["requests"]]
    common.append("speculation=static")  # the whole tree each round: acceptance is the cache's, not the timings'

    off = run(compose(*common, "draft.cache_tokens=0"), quiet=True, pair=pair)
    on = run(compose(*common), quiet=True, pair=pair)
    assert [r.output_ids for r in on["requests"]] == [r.output_ids for r in off["requests"]] == plain
    al_off, al_on = off["metrics"]["accept_length_mean"], on["metrics"]["accept_length_mean"]
    assert al_on > al_off + 1.0, (al_on, al_off)
    assert on["metrics"]["kv_leaked_slots"] == 0
    assert on["metrics"]["draft_cache"]["texts_added"] == 6 and "draft_cache" not in off["metrics"]


@pytest.mark.parametrize("cache_prompts", [False, True])
def test_finished_requests_feed_the_cache_errors_do_not(cache_prompts):
    from specpipe.decode.request import Request
    from specpipe.drafters.ngram import NgramProposer

    prop = NgramProposer(4, 3, 9, 1, 3, max_requests=2, max_context=32, device="cpu", cache_tokens=100,
                         cache_prompts=cache_prompts)
    ok = Request(0, "x", [1, 2, 3], max_new_tokens=4, output_ids=[7, 8], finish_reason="length")
    bad = Request(1, "y", [4, 5], max_new_tokens=4, output_ids=[9], finish_reason="error", error="NaN")
    prop.finish([ok, bad])
    want = ([1, 2, 3] if cache_prompts else []) + [7, 8, SEP]
    assert prop.cache.tokens.tolist() == want
    assert NgramProposer(4, 3, 9, 1, 3, 2, 32, "cpu").cache is None  # cache_tokens=0: prompt lookup only


def test_running_corpus_holds_the_other_requests_newest_tokens():
    from specpipe.drafters.ngram import NgramProposer

    prop = NgramProposer(4, 3, 9, 1, 3, max_requests=3, max_context=16, device="cpu", running_tokens=12)
    ctx = torch.tensor([[10, 11, 12, 13, 14, 15, 0],
                        [20, 21, 22, 0, 0, 0, 0],
                        [30, 31, 32, 33, 34, 35, 36]])
    L = np.array([5, 2, 6])  # the root of row b sits at L[b]: histories of 6, 3 and 7 tokens
    rows = prop.running_corpus(ctx, L, None).tolist()
    # each request contributes its newest 12 // 3 = 4 tokens (all 3 of row 1), then SEP; its own part is blanked
    h0, h1, h2 = [12, 13, 14, 15, SEP], [20, 21, 22, SEP], [33, 34, 35, 36, SEP]
    blank = lambda h: [SEP] * len(h)  # noqa: E731
    assert rows == [blank(h0) + h1 + h2, h0 + blank(h1) + h2, h0 + h1 + blank(h2)]
    cache = torch.tensor([7, 8, SEP], dtype=torch.int32)
    with_cache = prop.running_corpus(ctx, L, cache)
    assert with_cache[:, :3].tolist() == [[7, 8, SEP]] * 3 and with_cache[:, 3:].tolist() == rows


def test_requests_decoded_together_draft_from_one_another(tmp_path):
    """B's prompt already holds the continuation A is about to generate: with running_tokens, A drafts it."""
    import json

    from helpers import compose, random_prompts
    from specpipe.run import run
    from specpipe.models.random_tiny import build_random_tiny

    pair = build_random_tiny(seed=0, dtype="float64")
    base = ["model=random_tiny", "device.dtype=float64", "workload.max_new_tokens=24"]

    def write(prompts_ids):
        path = tmp_path / f"p{len(list(tmp_path.iterdir()))}.jsonl"
        path.write_text("".join(json.dumps({"prompt_ids": ids}) + "\n" for ids in prompts_ids))
        return f"workload.prompts_file={path}"

    P = [pair.tokenizer.encode(t) for t in random_prompts(5, [30, 40])]
    first = run(compose(*base, write(P), "draft=none"), quiet=True, pair=pair)["requests"]
    # A_i = P_i (it will generate G_i); B_i = P_i + G_i, a request already "ahead" of A_i
    prompts = P + [p + r.output_ids for p, r in zip(P, first)]
    common = [*base, write(prompts), "workload.batch_size=4", "draft=suffix", "draft.cache_tokens=0"]
    plain = [r.output_ids for r in run(compose(*common[:-2], "draft=none"), quiet=True, pair=pair)["requests"]]
    off = run(compose(*common, "draft.running_tokens=0"), quiet=True, pair=pair)
    on = run(compose(*common, "draft.running_tokens=4096"), quiet=True, pair=pair)
    assert [r.output_ids for r in on["requests"]] == [r.output_ids for r in off["requests"]] == plain
    assert [r.output_ids for r in on["requests"][:2]] == [r.output_ids for r in first]
    al_off, al_on = off["metrics"]["accept_length_mean"], on["metrics"]["accept_length_mean"]
    assert al_on > al_off + 0.5, (al_on, al_off)
    assert on["metrics"]["kv_leaked_slots"] == 0
