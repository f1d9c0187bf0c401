"""Greedy speculative decoding must reproduce the target's own greedy decode token for token."""
import pytest

from specpipe.run import run
from specpipe.models.random_tiny import build_random_tiny
from helpers import compose, random_prompts

LENGTHS = [1, 2, 3, 5, 8, 13, 21, 34, 47, 64]


def prompts_for(seed):
    return random_prompts(seed, LENGTHS)


def decode(prompt_path, pair, *overrides):
    cfg = compose("model=random_tiny", "device.dtype=float64", f"workload.prompts_file={prompt_path}",
                  "workload.max_new_tokens=20", *overrides)
    out = run(cfg, quiet=True, pair=pair)
    return [r.output_ids for r in out["requests"]], out["metrics"]


_baseline = {}


def baseline(seed, batch, prompt_path, pair):
    key = (seed, batch)
    if key not in _baseline:
        _baseline[key] = decode(prompt_path, pair, "draft=none", f"workload.batch_size={batch}")[0]
    return _baseline[key]


def shapes():
    for k in (1, 2, 4):
        for s in (1, 3, 5):
            most = 1 + (s if k == 1 else k + (s - 1) * k * k)
            for n in sorted({most, max(2, most // 2)}):
                yield k, s, n


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_speculative_equals_target_greedy(seed, batch, prompts_file):
    path = prompts_file(prompts_for(seed))
    pair = build_random_tiny(seed=seed, dtype="float64")
    want = baseline(seed, batch, path, pair)
    assert all(len(w) == 20 for w in want)
    accepted_deep = 0
    for k, s, n in shapes():
        got, m = decode(path, pair, f"workload.batch_size={batch}", f"draft.topk={k}", f"draft.num_steps={s}",
                        f"draft.num_draft_tokens={n}", "speculation=static")  # (each shape verified whole)
        assert got == want, f"topk={k} num_steps={s} num_draft_tokens={n} differs from target greedy"
        assert m["kv_leaked_slots"] == 0
        accepted_deep += m["acceptance_rate_per_position"][-1] > 0
    assert accepted_deep > 0, "no configuration ever accepted a full-depth path: the test would not catch bugs there"


def test_stop_token_mid_path_matches_baseline(prompts_file):
    """A request whose EOS lands inside an accepted path stops there, exactly like plain decoding."""
    path = prompts_file(prompts_for(3))
    pair = build_random_tiny(seed=3, dtype="float64")
    free_run = baseline(3, 4, path, pair)
    counts = {}
    for out in free_run:
        for t in out[3:]:
            counts[t] = counts.get(t, 0) + 1
    pair.tokenizer.eos_token_id = max(counts, key=counts.get)  # a token the model does produce
    want, _ = decode(path, pair, "draft=none", "workload.batch_size=4")
    got, m = decode(path, pair, "workload.batch_size=4", "draft.topk=1", "draft.num_steps=5",
                    "draft.num_draft_tokens=6")
    assert got == want
    assert any(len(w) < 20 for w in want), "EOS never fired: pick another token"
    assert m["kv_leaked_slots"] == 0
    forced, _ = decode(path, pair, "workload.batch_size=4", "draft.topk=1", "draft.num_steps=5",
                       "draft.num_draft_tokens=6", "workload.ignore_eos=true")
    assert forced == free_run  # EOS ignored: the free-running outputs, full length


@pytest.mark.parametrize("drafter", [
    ["draft=ngram", "draft.topk=1", "draft.num_steps=4"],
    ["draft=ngram", "draft.topk=3", "draft.num_steps=3", "draft.num_draft_tokens=7", "draft.max_n=2"],
    ["draft=suffix", "draft.num_steps=4", "draft.num_draft_tokens=9", "draft.cache_tokens=64"],  # evicts
    ["draft=standalone", "draft.topk=1", "draft.num_steps=3"],
    ["draft=standalone", "draft.topk=2", "draft.num_steps=3", "draft.num_draft_tokens=6"],
])
def test_every_drafter_is_lossless(drafter, prompts_file):
    path = prompts_file(prompts_for(0))
    pair = build_random_tiny(seed=0, dtype="float64")
    want = baseline(0, 4, path, pair)
    got, m = decode(path, pair, "workload.batch_size=4", "speculation=static", *drafter)  # every tree verified
    assert got == want
    assert m["kv_leaked_slots"] == 0
    assert m["accept_length_mean"] > 1.0, "nothing accepted: the comparison would not exercise commits"


def test_shipped_tiny_pair_is_lossless(prompts_file):
    """The trained pair (model=tiny) through the same check: EAGLE trees and chains equal plain greedy."""
    from specpipe.models.hf.load import load_tiny

    pair = load_tiny(dtype="float64")
    path = prompts_file(["def fibonacci(n):\n    ", "class Stack:\n    def __init__(self):\n        ", "import os\n"])
    common = ["model=tiny", "device.dtype=float64", f"workload.prompts_file={path}", "workload.max_new_tokens=24",
              "workload.batch_size=3"]
    want = [r.output_ids for r in run(compose(*common, "draft=none"), quiet=True, pair=pair)["requests"]]
    for shape in (["draft.topk=1", "draft.num_steps=5"],
                  ["draft.topk=4", "draft.num_steps=4", "draft.num_draft_tokens=10"]):
        out = run(compose(*common, *shape, "speculation=static"), quiet=True, pair=pair)  # (every tree verified)
        assert [r.output_ids for r in out["requests"]] == want, shape
        assert out["metrics"]["accept_length_mean"] > 1.5  # a trained head really drafts


@pytest.mark.parametrize("alloc", [["allocator=token"], ["allocator=paged", "allocator.page_size=1"],
                                   ["allocator=paged", "allocator.page_size=16"]])
@pytest.mark.parametrize("topk", [1, 4])
def test_every_allocator_is_lossless_and_leak_free(alloc, topk, prompts_file):
    """allocator=swa needs a sliding-window model and allocator=hisparse a top-k sparse one: their matrices run in
    test_swa_integration.py and test_hisparse_attention.py."""
    path = prompts_file(prompts_for(1))
    pair = build_random_tiny(seed=1, dtype="float64")
    want = baseline(1, 4, path, pair)
    got, m = decode(path, pair, "workload.batch_size=4", f"draft.topk={topk}", "draft.num_steps=4", *alloc)
    assert got == want
    assert m["kv_leaked_slots"] == 0
