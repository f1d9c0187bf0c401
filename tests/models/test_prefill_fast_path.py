"""Fresh prefill: dense layers attend causally over the forward's own K/V instead of the pool gather."""
import pytest
import torch

from specpipe.models import attention as attention_mod
from specpipe.models.attention_batch import extend_batch
from specpipe.models.random_tiny import build_random_tiny


def prefill(pair, lens, fresh, kv_dtype=None):
    target = pair.target
    target.setup_kv(512, kv_dtype)
    B, T = len(lens), max(lens)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 250, (B, T), generator=g)
    table = torch.arange(1, B * T + 1).view(B, T)  # slot 0 stays the padding sink
    lens_t = torch.tensor(lens)
    batch = extend_batch(table, torch.arange(B), torch.zeros_like(lens_t), lens_t, T, T)
    batch.fresh_causal = fresh
    with torch.no_grad():
        hidden = target(ids, batch)
    return hidden, torch.stack(target.kv.keys), torch.stack(target.kv.values)


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("kv_dtype", [None, torch.float32])
def test_fresh_causal_prefill_equals_the_masked_pool_path(window, kv_dtype, monkeypatch):
    """Same hidden states on every valid position and the same KV pool, for ragged (right-padded)
    prompts; sliding-window layers attend to their band of the fresh K/V, in query chunks (4 here, so bands
    cross chunk boundaries). The fast paths really run (counted)."""
    pair = build_random_tiny(seed=4, dtype="float64", sliding_window=window)
    lens = [7, 1, 12, 5]
    calls = []
    sdpa = attention_mod.F.scaled_dot_product_attention

    def spy(*a, **k):
        calls.append("causal" if k.get("is_causal") else tuple(a[1].shape[2:3]))
        return sdpa(*a, **k)

    want, wk, wv = prefill(pair, lens, fresh=False, kv_dtype=kv_dtype)
    monkeypatch.setattr(attention_mod.F, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(attention_mod, "BAND_CHUNK", 4)
    got, gk, gv = prefill(pair, lens, fresh=True, kv_dtype=kv_dtype)
    monkeypatch.undo()
    if window is None:  # dense layers take the causal kernel
        assert set(calls) == {"causal"}
    else:  # chunks of 4 queries, each over at most 4 + window - 1 keys: never the whole [T, T]
        assert "causal" not in calls and max(calls) <= (4 + window - 1,) and len(calls) % 3 == 0
    for b, n in enumerate(lens):
        torch.testing.assert_close(got[b, :n], want[b, :n], rtol=0, atol=1e-9)
    if window is None:
        assert torch.equal(gk, wk) and torch.equal(gv, wv)
    else:  # later layers' K/V follow hidden states that differ in the last bits (a band's own reduction order)
        torch.testing.assert_close(gk, wk, rtol=0, atol=1e-9)
        torch.testing.assert_close(gv, wv, rtol=0, atol=1e-9)


def test_a_fresh_dense_prefill_never_builds_the_mask():
    """A causal extend's [B, T, Lkv] mask is built only when a path reads it: a fresh prefill of dense layers
    (the causal kernel) never does, so a long prompt costs no T^2 bytes; the pool path builds the causal mask."""
    pair = build_random_tiny(seed=4, dtype="float64")
    target = pair.target
    target.setup_kv(512)
    lens = torch.tensor([7, 1, 12])
    table = torch.arange(1, 3 * 12 + 1).view(3, 12)
    batch = extend_batch(table, torch.arange(3), torch.zeros_like(lens), lens, 12, 16)
    batch.fresh_causal = True
    with torch.no_grad():
        target(torch.randint(0, 250, (3, 12)), batch)
    assert batch.mask is None
    mask = extend_batch(table, torch.arange(3), torch.zeros_like(lens), lens, 12, 16).attend_mask()
    q, k = torch.arange(12), torch.arange(16)
    want = ((k[None, None] <= q[None, :, None]) & (k[None, None] < lens[:, None, None])
            & (q[None, :, None] < lens[:, None, None]))
    assert torch.equal(mask, want)


@pytest.mark.parametrize("model", [dict(sparse_top_k=5, sparse_local=3), dict(sliding_window=3, sparse_top_k=4)],
                         ids=["sparse", "sparse+window"])
def test_long_masked_forwards_go_in_query_chunks(model, monkeypatch):
    """Sparse (and windowed) layers read the pool through per-query masks and selections: a long forward
    builds them BAND_CHUNK queries at a time, with the same hidden states and the same K/V."""
    pair = build_random_tiny(seed=5, dtype="float64", **model)
    lens = [7, 1, 12, 5]
    want, wk, wv = prefill(pair, lens, fresh=False)
    widths = []
    select = attention_mod.sparse_select

    def spy(q, *a):
        widths.append(q.shape[1])
        return select(q, *a)

    monkeypatch.setattr(attention_mod, "sparse_select", spy)
    monkeypatch.setattr(attention_mod, "BAND_CHUNK", 4)
    got, gk, gv = prefill(pair, lens, fresh=False)
    assert widths and max(widths) == 4 and sum(widths) == 12 * len(widths) // 3  # 12 queries in chunks of 4
    for b, n in enumerate(lens):
        torch.testing.assert_close(got[b, :n], want[b, :n], rtol=0, atol=1e-9)
    torch.testing.assert_close(gk, wk, rtol=0, atol=1e-9)
    torch.testing.assert_close(gv, wv, rtol=0, atol=1e-9)
