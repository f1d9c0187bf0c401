"""Top-k sparse attention (model.sparse_top_k) and allocator=hisparse hot-buffer accounting."""

import pytest
import torch

from specpipe.run import run
from specpipe.models.attention import sparse_select
from specpipe.models.attention_batch import extend_batch
from specpipe.models.random_tiny import build_random_tiny
from helpers import compose, random_prompts, write_prompts

NEW = 40
LENGTHS = [40, 47, 55, 64]
SPARSE = ("model.sparse_top_k=4", "model.sparse_local=8", "speculation=static")  # (runs compared step for step)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_prompts(tmp_path_factory.mktemp("hisparse") / "prompts.jsonl", random_prompts(11, LENGTHS))


def decode(path, *overrides):
    cfg = compose("model=random_tiny", "device.dtype=float64", f"workload.prompts_file={path}",
                  f"workload.max_new_tokens={NEW}", "workload.batch_size=4", *overrides)
    out = run(cfg, quiet=True)
    return [r.output_ids for r in out["requests"]], out["metrics"]


_cache = {}


def plain(path, *model):
    if model not in _cache:
        _cache[model] = decode(path, "draft=none", "allocator=token", *model)[0]
    return _cache[model]


def test_select_keeps_recent_and_at_most_top_k_older():
    g = torch.Generator().manual_seed(0)
    B, Q, H, Hkv, D, Lkv = 2, 3, 4, 2, 8, 40
    q, keys = torch.randn(B, Q, H, D, generator=g), torch.randn(B, Lkv, Hkv, D, generator=g)
    kv_pos = torch.arange(Lkv).expand(B, Lkv)
    pos = torch.tensor([[30, 31, 32], [20, 21, 22]])
    mask = kv_pos[:, None, :] <= pos[:, :, None]
    sel = sparse_select(q, keys, mask, pos, kv_pos, top_k=5, local=4)
    recent = (pos[:, :, None] - kv_pos[:, None, :] < 4) & mask
    assert bool((sel <= mask).all()) and bool((sel >= recent).all())
    assert ((sel & ~recent).sum(-1) == 5).all()
    visible = int(mask.sum(-1).max())  # top_k covering every visible key (but < Lkv): exactly the mask
    assert torch.equal(sparse_select(q, keys, mask, pos, kv_pos, top_k=visible, local=4), mask)


def test_large_top_k_equals_dense_exactly():
    dense = build_random_tiny(dtype="float64").target
    sparse = build_random_tiny(dtype="float64", sparse_top_k=60).target  # >= visible keys, < padded Lkv
    ids = torch.randint(0, 250, (2, 50), generator=torch.Generator().manual_seed(1))
    table = torch.arange(1, 2 * 64 + 1).view(2, 64)
    rows, lens = torch.arange(2), torch.tensor([50, 37])
    outs = []
    for model in (dense, sparse):
        model.setup_kv(2 * 64 + 1)
        with torch.no_grad():
            h = model(ids, extend_batch(table, rows, lens * 0, lens, 50, 64))
            step = model(ids[:, :1], extend_batch(table, rows, lens, torch.ones_like(lens), 1, 64))
        outs.append((h, step))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_large_top_k_run_equals_dense_run(path):
    assert plain(path, "model.sparse_top_k=100000") == plain(path)


@pytest.mark.parametrize("topk,ps", [(1, 1), (4, 1), (4, 16)])
def test_hisparse_greedy_is_lossless_and_counts_fetches(path, topk, ps):
    want = plain(path, *SPARSE)
    assert want != plain(path), "top_k=4 never changed the output: the test would not see sparsity"
    got, m = decode(path, *SPARSE, "allocator=hisparse", f"allocator.page_size={ps}", "allocator.debug=true",
                    f"draft.topk={topk}")
    assert got == want
    assert 0 < m["hisparse_hit_rate"] <= 1 and m["hisparse_bytes_moved"] > 0
    token_bytes = 2 * 2 * 16 * 8  # K+V, 2 kv heads, head_dim 16, float64
    misses = round(m["hisparse_fetches"] * (1 - m["hisparse_hit_rate"]))
    assert m["hisparse_bytes_moved"] == misses * token_bytes
    assert m["kv_leaked_slots"] == 0


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_a_prompt_past_the_device_pool_runs_whichever_request_comes_first(tmp_path, order):
    """The host pool bounds a request, the device pool only its hot buffer: sized from the model up front, the
    buffers exist for the first admission too (it was bounded by num_slots, so a 20-token prompt failed at
    num_slots=16 when it came first and ran when it came second)."""
    prompts = [[5], list(range(10, 30))]
    path = tmp_path / "p.jsonl"
    path.write_text("".join('{"prompt_ids": %s}\n' % prompts[i] for i in order))
    over = ["model=random_tiny", "device.dtype=float64", "model.sparse_top_k=4", "model.sparse_local=4",
            "draft=none", "workload.max_new_tokens=8", "workload.batch_size=1", f"workload.prompts_file={path}"]
    want = run(compose(*over, "allocator=token"), quiet=True)["requests"]
    got = run(compose(*over, "allocator=hisparse", "allocator.host_to_device_ratio=4", "allocator.num_slots=16",
                      "allocator.debug=true"), quiet=True)
    assert [r.finish_reason for r in got["requests"]] == ["length", "length"]
    assert [r.output_ids for r in got["requests"]] == [r.output_ids for r in want]
    assert got["metrics"]["kv_leaked_slots"] == 0


@pytest.mark.parametrize("ps", [1, 16])
def test_kv_peak_counts_logical_use_and_the_device_pool_has_its_own(path, ps):
    """Every live token holds a logical id, so the run's KV peak is the logical pool's (it was the smaller
    pool's, min(logical, device), and read half the token allocator's peak for the same run); the device
    pool's peak is reported apart and never exceeds that pool."""
    alloc = "allocator=token" if ps == 1 else "allocator=paged"
    _, ref = decode(path, *SPARSE, alloc, f"allocator.page_size={ps}", "allocator.num_slots=1024")
    _, m = decode(path, *SPARSE, "allocator=hisparse", f"allocator.page_size={ps}", "allocator.num_slots=256",
                  "allocator.host_to_device_ratio=4")
    assert m["kv_pool_slots"] == ref["kv_pool_slots"] == 1024
    assert m["kv_peak_slots"] == ref["kv_peak_slots"] > 256
    assert 0 < m["hisparse_device_peak_slots"] <= m["hisparse_device_pool_slots"] == 256


@pytest.mark.parametrize("ratio", [2, 4])
def test_null_num_slots_sizes_the_logical_pool_for_the_workload(path, ratio):
    """num_slots=null gave the *device* pool the whole workload (allocator=token's pool) and the logical pool, which
    the KV cache is sized by, ratio x that: kv_cache_bytes was ratio x allocator=token's, and the device pool's peak
    (hot buffers) a fraction of its size. The logical pool now holds the workload and the device pool 1/ratio of it."""
    want, ref = decode(path, *SPARSE, "draft=none", "allocator=token")
    got, m = decode(path, *SPARSE, "draft=none", "allocator=hisparse", f"allocator.host_to_device_ratio={ratio}")
    assert got == want and m["retractions"] == 0 and m["kv_leaked_slots"] == 0
    buffers = 4 * 4 * (4 + 8)  # batch_size x 4 x (top_k + local): the device pool's floor
    assert m["hisparse_device_pool_slots"] == max(-(-ref["kv_pool_slots"] // ratio), buffers)
    assert m["kv_pool_slots"] == ratio * m["hisparse_device_pool_slots"] >= ref["kv_pool_slots"]
    assert m["kv_cache_bytes"] < ratio * ref["kv_cache_bytes"]  # was exactly ratio x
    assert m["hisparse_device_peak_slots"] <= m["hisparse_device_pool_slots"]


def test_explicit_num_slots_is_checked_against_the_logical_pool():
    """A request needs room in the logical pool (num_slots x host_to_device_ratio), not num_slots device slots."""
    from specpipe.config.validate import validate

    validate(compose("model=random_tiny", "model.sparse_top_k=8", "allocator=hisparse", "draft=none",
                     "workload.max_new_tokens=120", "allocator.num_slots=100", "allocator.host_to_device_ratio=4"))
