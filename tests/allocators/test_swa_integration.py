"""allocator=swa for real: sliding layers keep K/V only in the window pool, and every commit frees
the window-pool pages of tokens that left the window; greedy output stays the target's own."""

import re

import numpy as np
import pytest
import torch

from specpipe.allocators.swa import SWAAllocator
from specpipe.run import run
from specpipe.errors import ConfigError
from specpipe.models.attention_batch import extend_batch
from specpipe.models.random_tiny import build_random_tiny
from specpipe.stages.prepare_decode import PrepareDecode, target_kv_layout
from specpipe.config.validate import validate
from helpers import compose, random_prompts, write_prompts

WINDOW = 16
NEW = 40
LENGTHS = [40, 47, 55, 64]
SWA_SLOTS = 320  # < the 366+ tokens the batch ends with: the run only fits if eviction works


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_prompts(tmp_path_factory.mktemp("swa") / "prompts.jsonl", random_prompts(7, LENGTHS))


def decode(path, layers, *overrides):
    cfg = compose("model=random_tiny", "device.dtype=float64", f"model.sliding_window={WINDOW}",
                  f"model.sliding_layers={layers}", f"workload.prompts_file={path}",
                  f"workload.max_new_tokens={NEW}", "workload.batch_size=4", *overrides)
    out = run(cfg, quiet=True)
    return [r.output_ids for r in out["requests"]], out["metrics"]


_baseline = {}


def baseline(path, layers):
    if layers not in _baseline:
        _baseline[layers] = decode(path, layers, "draft=none", "allocator=token")[0]
    return _baseline[layers]


@pytest.mark.parametrize("layers,topk,ps", [("alternate", 1, 1), ("alternate", 4, 1), ("alternate", 1, 16),
                                            ("alternate", 4, 16), ("all", 4, 1), ("all", 1, 16)])
def test_swa_greedy_is_lossless_and_evicts(path, layers, topk, ps):
    want = baseline(path, layers)
    got, m = decode(path, layers, "allocator=swa", f"allocator.window={WINDOW}", f"allocator.page_size={ps}",
                    f"allocator.swa_num_slots={SWA_SLOTS}", "allocator.debug=true", f"draft.topk={topk}")
    assert got == want
    assert m["swa_evicted_tokens"] > 0
    assert sum(LENGTHS) + sum(len(w) for w in want) > SWA_SLOTS  # without eviction the window pool overflows
    assert m["swa_window_peak_slots"] <= SWA_SLOTS
    assert m["kv_leaked_slots"] == 0 and m["kv_full_leaked_slots"] == 0 and m["kv_window_leaked_slots"] == 0
    # kv_pool_slots / kv_peak_slots describe the full pool (they took the smaller pool's size and subtracted
    # one pool's free count from the other's size: a peak that was neither pool's)
    # the full pool keeps every token of a request: its peak holds the longest request whole
    longest = max(n + len(w) for n, w in zip(LENGTHS, want))
    assert m["kv_pool_slots"] > SWA_SLOTS and longest <= m["kv_peak_slots"] <= m["kv_pool_slots"]


def test_swa_needs_a_sliding_model(path):
    cfg = compose("model=random_tiny", f"workload.prompts_file={path}", "allocator=swa", "allocator.window=16")
    with pytest.raises(ConfigError, match="no sliding-window layers.*model.sliding_window=64"):
        run(cfg, quiet=True)


def test_swa_window_smaller_than_model_window_is_an_error(path):
    with pytest.raises(ConfigError, match="allocator.window=8 is smaller than the model's sliding window of 16"):
        decode(path, "all", "allocator=swa", "allocator.window=8")


def test_swa_larger_allocator_window_is_fine(path):
    got, m = decode(path, "alternate", "draft=none", "allocator=swa", f"allocator.window={2 * WINDOW}")
    assert got == baseline(path, "alternate")
    assert m["kv_leaked_slots"] == 0 and m["kv_window_leaked_slots"] == 0


def test_swa_keeps_the_models_window_when_allocator_window_is_null(path):
    """allocator.window defaulted to 256 whatever the model: a window-16 model kept 256 tokens per request in the
    window pool (nothing was ever evicted here), and a model whose window is above 256 (Mistral-7B-v0.1: 4096) was
    refused until the user found the setting."""
    got, m = decode(path, "alternate", "allocator=swa", f"allocator.swa_num_slots={SWA_SLOTS}", "allocator.debug=true")
    assert got == baseline(path, "alternate")
    assert m["swa_evicted_tokens"] > 0 and m["config"]["allocator"]["window"] is None  # as given; 16 ran
    assert m["swa_window"] == WINDOW and m["swa_window_pool_slots"] == SWA_SLOTS
    cfg = compose("model=random_tiny", "device.dtype=float64", "model.sliding_window=300",
                  f"workload.prompts_file={path}", "workload.max_new_tokens=8", "workload.batch_size=4",
                  "allocator=swa", "draft.topk=2")
    want = run(compose("model=random_tiny", "device.dtype=float64", "model.sliding_window=300",
                       f"workload.prompts_file={path}", "workload.max_new_tokens=8", "draft=none"), quiet=True)
    assert [r.output_ids for r in run(cfg, quiet=True)["requests"]] == [r.output_ids for r in want["requests"]]
    with pytest.raises(ConfigError, match=r"allocator.swa_num_slots=17 is smaller than one request needs in the "
                                          r"window pool \(\d+ slots: the last 16 tokens, the model's sliding window,"):
        decode(path, "alternate", "allocator=swa", "allocator.swa_num_slots=17")
    # a model window shorter than a speculative step: every problem at once, and fixes that can be applied
    short = ("model=random_tiny", "model.sliding_window=3", f"workload.prompts_file={path}", "allocator=swa",
             "draft.num_steps=3")
    with pytest.raises(ConfigError) as e:
        run(compose(*short, "allocator.swa_num_slots=1"), quiet=True)
    assert "2 problems" in str(e.value) and "allocator.swa_num_slots=1 is smaller" in str(e.value), str(e.value)
    assert re.search(r"the model's sliding window of 3 tokens \(which allocator.window=null takes\) is shorter than "
                     r"one speculative step needs .*; use allocator.window>=4 .*, or draft.num_steps<=2", str(e.value))
    assert run(compose(*short, "allocator.window=4", "workload.num_prompts=1", "workload.max_new_tokens=4"),
               quiet=True)["metrics"]["swa_window"] == 4  # the fix it names works
    with pytest.raises(ConfigError, match=r"use allocator.window>=2 .*, or draft=none"):  # not draft.num_steps<=0
        run(compose("model=random_tiny", "model.sliding_window=1", f"workload.prompts_file={path}", "allocator=swa",
                    "draft.num_steps=1", "draft.topk=1", "draft.num_draft_tokens=2"), quiet=True)


def test_a_model_window_beyond_the_context_asks_for_no_more_window_pool_than_the_context(path):
    """No request holds more than the model's context, so the window pool's minimum is the context's when the
    sliding window is longer (a 4096-window model served at 2048 tokens was refused a window pool of 2100)."""
    cfg = compose("model=random_tiny", "model.sliding_window=5000", f"workload.prompts_file={path}", "allocator=swa",
                  "allocator.swa_num_slots=2100", "workload.max_new_tokens=8", "workload.batch_size=1")
    m = run(cfg, quiet=True)["metrics"]
    assert m["swa_window"] == 5000 and m["num_errors"] == 0


def test_sliding_layers_read_only_the_window_pool():
    """Window storage is sized swa_pool_slots; every window slot the row does not own (evicted,
    free, the padding sink) is filled with garbage before each step and the logits do not move."""
    window, prompt, steps = 8, 40, 16
    pair = build_random_tiny(dtype="float64", sliding_window=window, sliding_layers="alternate")
    target = pair.target
    alloc = SWAAllocator(256, 1, window=window, swa_num_slots=48, debug=True)  # 48 < 56 tokens decoded
    kv = target.setup_kv(alloc.pool_slots, **target_kv_layout(pair, alloc))
    assert kv.windowed == [True, False]
    assert kv.layer(0)[0].shape[0] == alloc.swa_pool_slots  # layer 0 slides: window pool only
    assert kv.layer(1)[0].shape[0] == alloc.pool_slots  # layer 1 is full
    prep = PrepareDecode(alloc, 1, 128, torch.device("cpu"))
    row = np.asarray([prep.acquire_row()])
    row_t = torch.from_numpy(row)
    tokens = torch.randint(0, 250, (prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    assert prep.reserve(row, np.asarray([prompt]))
    n = torch.tensor([prompt])
    with torch.no_grad():
        h = target(torch.tensor([tokens]), prep.decorate(extend_batch(prep.table, row_t, n * 0, n, prompt, 48)))
        prep.commit(row, np.asarray([prompt]))
        prep.after_commit(row)
        assert prep.evicted[row[0]] == prompt - window - 1
        nxt = int(target.logits(h[0, -1]).argmax())
        for _ in range(steps):
            tokens.append(nxt)
            assert prep.reserve(row, np.ones(1, dtype=np.int64))
            L = prep.seq_len[row]
            owned = alloc.translate(prep.table[row[0], : prep.alloc_len[row[0]]])
            garbage = torch.ones(alloc.swa_pool_slots, dtype=torch.bool)
            garbage[owned[owned > 0]] = False
            kv.layer(0)[0][garbage], kv.layer(0)[1][garbage] = 1e3, -1e3
            L_t = torch.from_numpy(L)
            batch = prep.decorate(extend_batch(prep.table, row_t, L_t, torch.ones_like(L_t), 1, 64))
            got = target.logits(target(torch.tensor([[nxt]]), batch)[0, -1])
            ref = target.logits(target(torch.tensor([tokens]))[0, -1])  # full causal forward, no pool
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-9)
            nxt = int(got.argmax())
            prep.commit(row, L + 1)
            prep.after_commit(row)
            assert alloc.swa.size - alloc.swa_available() <= window + 2  # bounded: window + ps + newest
    prep.release_rows(row.tolist())
    assert alloc.swa_available() == alloc.swa.size and alloc.full_available() == alloc.full.size


@pytest.mark.parametrize("draft,ps,slots", [("none", 1, 96), ("eagle", 1, 96), ("eagle", 16, 192), ("ngram", 4, 96)])
def test_a_prompt_longer_than_the_window_pool_is_prefilled_in_chunks(tmp_path, draft, ps, slots):
    """Sliding layers keep only the window, so a prefill run in chunks frees what left the window between them:
    prompts longer than the whole window pool decode to the target's own greedy output."""
    prompts = write_prompts(tmp_path / "long.jsonl", random_prompts(3, [200, 150, 9]))
    want = decode(prompts, "alternate", "draft=none", "allocator=token")[0]
    got, m = decode(prompts, "alternate", f"draft={draft}", "allocator=swa", f"allocator.window={WINDOW}",
                    f"allocator.page_size={ps}", f"allocator.swa_num_slots={slots}", "allocator.debug=true")
    assert got == want and m["num_errors"] == 0
    assert m["swa_window_peak_slots"] <= slots < 200
    assert m["kv_leaked_slots"] == 0 and m["kv_window_leaked_slots"] == 0
    # reported: the longest prompt ran in chunks, each chunk at most what the pool holds, in several forwards
    assert m["swa_chunked_prefills"] >= 1 and m["swa_prefill_chunk_forwards"] > 200 // slots
    assert 0 < m["swa_prefill_chunk_min_tokens"] <= slots
    if draft == "none":  # a pool that holds the prompts whole prefills in one forward and reports nothing
        m = decode(prompts, "alternate", "draft=none", "allocator=swa", f"allocator.window={WINDOW}",
                   "allocator.swa_num_slots=1024")[1]
        assert m["swa_chunked_prefills"] == 0 and m["swa_prefill_chunk_min_tokens"] is None


@pytest.mark.parametrize("draft", ["none", "eagle"])
def test_a_retracted_request_resumes_though_its_context_outgrew_the_window_pool(tmp_path, draft):
    """A retraction re-prefills prompt + output, which the window pool held only a window of: the request
    resumes (chunked) instead of failing, and both requests still decode the target's greedy output."""
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt_ids": [5]}\n{"prompt_ids": [%s]}\n' % ", ".join(["7"] * 33))
    over = ("workload.ignore_eos=true", "workload.batch_size=2", "workload.max_new_tokens=50")
    want = decode(str(path), "all", "draft=none", "allocator=token", *over)[0]
    got, m = decode(str(path), "all", f"draft={draft}", "allocator=swa", f"allocator.window={WINDOW}",
                    "allocator.page_size=4", "allocator.num_slots=120", "allocator.swa_num_slots=64",
                    "allocator.debug=true", *over)
    assert got == want and m["num_errors"] == 0 and m["retractions"] >= (draft == "none")
    assert m["kv_leaked_slots"] == 0 and m["kv_window_leaked_slots"] == 0


def test_a_request_the_full_pool_cannot_hold_names_num_slots(tmp_path):
    """The full pool holds every token: when it is the short one the error names allocator.num_slots (not the
    window pool, which chunks), and the size it names is enough."""
    prompts = write_prompts(tmp_path / "long.jsonl", random_prompts(3, [200]))

    def one(slots):
        cfg = compose("model=random_tiny", "device.dtype=float64", f"model.sliding_window={WINDOW}",
                      f"workload.prompts_file={prompts}", f"workload.max_new_tokens={NEW}", "draft=none",
                      "allocator=swa", f"allocator.window={WINDOW}", f"allocator.num_slots={slots}",
                      "allocator.swa_num_slots=64")
        return run(cfg, quiet=True)["requests"][0]

    r = one(128)
    assert r.finish_reason == "error" and "the full pool (128 slots)" in r.error
    assert "raise allocator.num_slots to at least" in r.error and "swa_num_slots" not in r.error
    assert one(int(r.error.split("at least ")[1].split()[0])).finish_reason in ("length", "stop")


@pytest.mark.parametrize("ps,topk", [(1, 4), (16, 1)])
def test_the_smallest_window_pool_validation_accepts_serves_a_short_request(tmp_path, ps, topk):
    """allocator.swa_num_slots below what one request holds in the window pool (its last window tokens plus a
    step's draft and verify space) is a config error naming that size; that size itself runs a short request
    (a 3-token prompt, longer output than the window) to the end, evicting as it goes."""
    prompts = tmp_path / "short.jsonl"
    prompts.write_text('{"prompt_ids": [5, 6, 7]}\n')
    base = ["model=random_tiny", "device.dtype=float64", f"model.sliding_window={WINDOW}",
            f"workload.prompts_file={prompts}",
            "workload.max_new_tokens=64", "workload.ignore_eos=true", "allocator=swa", f"allocator.window={WINDOW}",
            f"allocator.page_size={ps}", f"draft.topk={topk}"]
    with pytest.raises(ConfigError, match="smaller than one request needs in the window pool") as e:
        validate(compose(*base, "allocator.swa_num_slots=8"))
    need = int(str(e.value).split("swa_num_slots>=")[1].split()[0])
    with pytest.raises(ConfigError, match=f"swa_num_slots>={need}($|\\D)"):
        validate(compose(*base, f"allocator.swa_num_slots={need - 1}"))
    out = run(compose(*base, f"allocator.swa_num_slots={need}"), quiet=True)
    r = out["requests"][0]
    assert r.finish_reason == "length" and len(r.output_ids) == 64
    assert out["metrics"]["swa_evicted_tokens"] > 0 and out["metrics"]["swa_window_peak_slots"] <= need


@pytest.mark.parametrize("draft,ps", [("none", 1), ("eagle", 4), ("ngram", 16)])
def test_the_smallest_valid_window_pool_runs_prompts_of_any_length(tmp_path, draft, ps):
    """The minimum swa_num_slots validation names holds a chunked prefill: prompts around and far past the window
    run at it even when max_new_tokens is below the window (it once sized the pool from max_new_tokens alone)."""
    window, new = 32, 8
    path = tmp_path / "p.jsonl"
    path.write_text("".join('{"prompt_ids": [%s]}\n' % ", ".join(str(10 + i % 200) for i in range(n))
                            for n in (window - 1, window, 2 * window, 5 * window + 3)))
    over = ["model=random_tiny", "device.dtype=float64", f"model.sliding_window={window}", f"draft={draft}",
            "allocator=swa", f"allocator.window={window}", f"allocator.page_size={ps}",
            f"workload.max_new_tokens={new}", f"workload.prompts_file={path}"]
    with pytest.raises(ConfigError, match="use allocator.swa_num_slots>=") as e:
        validate(compose(*over, "allocator.swa_num_slots=1"))
    least = int(str(e.value).split("swa_num_slots>=")[1].split()[0].rstrip(".;,)"))
    out = run(compose(*over, f"allocator.swa_num_slots={least}", "allocator.debug=true"), quiet=True)
    assert [r.finish_reason for r in out["requests"]] == ["length"] * 4, [r.error for r in out["requests"]]
    base = run(compose(*over[:-6], "draft=none", f"workload.max_new_tokens={new}", f"workload.prompts_file={path}"),
               quiet=True)
    assert [r.output_ids for r in out["requests"]] == [r.output_ids for r in base["requests"]]


def test_a_null_window_pool_holds_windows_and_a_prefill_chunk_not_whole_contexts(tmp_path):
    """swa_num_slots=null made the window pool as large as the full pool, so allocator=swa saved no memory. It is
    now sized for batch_size rows of a window, one step's space and a 2048-token prefill chunk: long prompts
    prefill in chunks and decode to the target's own greedy output with a smaller KV cache."""
    from specpipe.allocators.swa import SWA_PREFILL_TOKENS
    from specpipe.config.validate import one_request_slots

    prompts = write_prompts(tmp_path / "long.jsonl", random_prompts(5, [4500, 3000, 30]))
    over = ("model.max_position=8192", "workload.max_new_tokens=12", "workload.batch_size=2")
    want, base = decode(prompts, "alternate", "draft=none", "allocator=token", *over)
    cfg_over = (*over, "allocator=swa", "allocator.page_size=16", "allocator.debug=true")
    got, m = decode(prompts, "alternate", "draft=eagle", *cfg_over)
    assert got == want and m["num_errors"] == 0
    row = 16 + SWA_PREFILL_TOKENS + one_request_slots(compose("model=random_tiny", "draft=eagle", *cfg_over),
                                                      new_tokens=0)
    assert m["swa_window_pool_slots"] == 2 * row < m["kv_pool_slots"] // 2  # not the full pool's size
    assert m["swa_chunked_prefills"] >= 1 and m["swa_window_peak_slots"] <= 2 * row
    assert m["kv_leaked_slots"] == 0 and m["kv_window_leaked_slots"] == 0
    # one of the target's two layers slides: its K/V shrinks from the full pool's ~9100 slots to ~4200
    got, m = decode(prompts, "alternate", "draft=none", *cfg_over)
    assert got == want and m["kv_cache_bytes"] < 0.8 * base["kv_cache_bytes"]
    # never more than the full pool: short requests' window pool is the full pool's size, as before
    few = write_prompts(tmp_path / "short.jsonl", random_prompts(6, [30, 50]))
    short = decode(few, "alternate", "draft=none", "allocator=swa", *over[1:])[1]
    assert short["swa_window_pool_slots"] == short["kv_pool_slots"]
    # an explicit num_slots sizes the full pool only
    big = decode(few, "alternate", "draft=none", "allocator=swa", "allocator.num_slots=50000", *over[1:])[1]
    assert big["kv_pool_slots"] == 50000 and big["swa_window_pool_slots"] < 5000


def test_explicit_window_beyond_the_context_sizes_the_pool_by_the_context(path):
    """allocator.window larger than the model's context keeps at most the context per request, so swa_num_slots only
    needs the context plus a step (what window=null and the default already assume); it was refused, asking for
    window + a step slots (100004 for window=100000 on a 2048-token model)."""
    from specpipe.config.validate import window_row_slots

    over = ("allocator=swa", "allocator.window=100000", "draft=none")
    need = window_row_slots(compose("model=random_tiny", *over), 100000, 2048)
    got, m = decode(path, "alternate", *over, f"allocator.swa_num_slots={need}", "allocator.debug=true")
    assert got == baseline(path, "alternate")
    assert m["swa_window_pool_slots"] == need and m["kv_window_leaked_slots"] == 0
    with pytest.raises(ConfigError, match=f"allocator.swa_num_slots={need - 1} is smaller than one request needs"):
        decode(path, "alternate", *over, f"allocator.swa_num_slots={need - 1}")
