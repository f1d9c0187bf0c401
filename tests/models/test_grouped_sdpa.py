"""Pool attention packs each KV group's query heads into one head's queries (grouped_sdpa)."""
import pytest
import torch

from specpipe.models import attention as attention_mod
from specpipe.models.attention import grouped_sdpa
from specpipe.models.attention_batch import sdpa_mask


def reference(q, k, v, mask):
    """Per-head softmax attention in float64, query head h reading KV head h // G (HF's repeat_kv)."""
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    s = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    return s.masked_fill(~mask, float("-inf")).softmax(-1) @ v


@pytest.mark.parametrize("H,Hkv", [(4, 4), (4, 2), (8, 2), (6, 3)])
@pytest.mark.parametrize("Q", [1, 5])
@pytest.mark.parametrize("packed", [True, False])
def test_grouped_sdpa_is_per_head_attention(H, Hkv, Q, packed, monkeypatch):
    if packed:
        monkeypatch.setattr(attention_mod, "PACK_MIN_KV", 0)
    g = torch.Generator().manual_seed(H * 10 + Hkv + Q)
    B, L, D = 3, 37, 16
    q = torch.randn(B, Q, H, D, generator=g, dtype=torch.float64).transpose(1, 2)  # as the layer's views
    k = torch.randn(B, L, Hkv, D, generator=g, dtype=torch.float64).transpose(1, 2)
    v = torch.randn(B, L, Hkv, D, generator=g, dtype=torch.float64).transpose(1, 2)
    raw = torch.rand(B, Q, L, generator=g) > 0.4
    raw[0, 0] = False  # a padding query: sdpa_mask lets it see column 0
    mask = sdpa_mask(raw)
    got = grouped_sdpa(q, k, v, mask)
    assert got.shape == (B, H, Q, D)
    torch.testing.assert_close(got, reference(q, k, v, mask), rtol=0, atol=1e-12)


def gqa_target_with_prompt(seed: int, **shape):
    """A float64 random tiny target with 4 query heads over 2 KV heads, 9 prompt tokens already in its KV pool
    (slots 1..9 of a 32-column table); returns (target, table)."""
    from specpipe.models.attention_batch import extend_batch
    from specpipe.models.random_tiny import build_random_tiny

    target = build_random_tiny(seed=seed, dtype="float64", num_heads=4, num_kv_heads=2, **shape).target
    target.setup_kv(64)
    table = torch.arange(1, 33).view(1, 32)
    with torch.no_grad():
        target(torch.randint(0, 250, (1, 9)), extend_batch(table, torch.arange(1), torch.tensor([0]),
                                                           torch.tensor([9]), 9, 9))
    return target, table


@pytest.mark.parametrize("packed", [True, False])
def test_the_pool_path_of_a_gqa_layer_packs_its_heads(monkeypatch, packed):
    """A GQA model's extend over a cached context reads K/V as [B, Hkv, L, D] with G*Q queries per head, once
    the K/V is large enough for packing to pay (forced here); below that, SDPA's own enable_gqa."""
    from specpipe.models.attention_batch import extend_batch

    target, table = gqa_target_with_prompt(seed=1)
    calls = []
    sdpa = attention_mod.F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        calls.append((tuple(q.shape), tuple(k.shape), kw.get("enable_gqa", False)))
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(attention_mod.F, "scaled_dot_product_attention", spy)
    if packed:
        monkeypatch.setattr(attention_mod, "PACK_MIN_KV", 0)
    with torch.no_grad():
        target(torch.randint(0, 250, (1, 3)), extend_batch(table, torch.arange(1), torch.tensor([9]),
                                                           torch.tensor([3]), 3, 12))
    D = target.config.head_dim
    want = ((1, 2, 6, D), (1, 2, 12, D), False) if packed else ((1, 4, 3, D), (1, 2, 12, D), True)
    assert calls and all(c == want for c in calls)


def test_a_forward_packs_and_converts_its_mask_once_for_every_layer(monkeypatch):
    """The packed, additive mask is built once per forward and read by every layer: built per layer, a compiled
    forward recomputed the whole mask, its gathers included, inside each layer's kernel. The output is the
    unpacked path's (per-head attention under the boolean mask)."""
    from specpipe.models.attention_batch import extend_batch

    target, table = gqa_target_with_prompt(seed=2, num_layers=3)
    masks = []
    sdpa = attention_mod.F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        masks.append(kw["attn_mask"])
        return sdpa(q, k, v, **kw)

    tokens = torch.randint(0, 250, (1, 4))

    def forward():
        with torch.no_grad():  # the same extend twice: its K/V write is idempotent
            return target(tokens, extend_batch(table, torch.arange(1), torch.tensor([9]), torch.tensor([4]), 4, 13))

    plain = forward()
    monkeypatch.setattr(attention_mod.F, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(attention_mod, "PACK_MIN_KV", 0)
    packed = forward()
    assert len(masks) == 3 and all(m is masks[0] for m in masks), "one mask object for the forward's 3 layers"
    assert masks[0].dtype == torch.float64 and masks[0].shape == (1, 1, 2 * 4, 13)
    assert set(masks[0].unique().tolist()) == {0.0, float("-inf")}
    torch.testing.assert_close(packed, plain, rtol=0, atol=1e-12)
