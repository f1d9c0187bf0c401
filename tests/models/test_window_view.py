"""Sliding-window layers gather only the key columns their window reaches (AttentionBatch.window_view)."""
import pytest
import torch

from specpipe.models import attention as attention_mod
from specpipe.models.attention_batch import AttentionBatch, extend_batch
from specpipe.models.random_tiny import build_random_tiny

WINDOW = 4


def tree_batch(table, L, parents):
    """A verify-like batch: row b's context [0, L_b) then a tree of N nodes at columns L_b + j, node j at
    position L_b + depth_j, seeing the context and its ancestors (the layout SpecPipeline.verify_batch builds)."""
    B, N = len(L), len(parents)
    depth, anc = [0] * N, torch.eye(N, dtype=torch.bool)
    for j, p in enumerate(parents):
        if p >= 0:
            depth[j], anc[j] = depth[p] + 1, anc[p] | anc[j]
    depth = torch.tensor(depth)
    Lv = int(L.max()) + N
    c = torch.arange(Lv)
    j = (c[None, :] - L[:, None]).clamp(0, N - 1)
    in_tree = (c[None, :] >= L[:, None]) & (c[None, :] < L[:, None] + N)
    mask = (c[None, :] < L[:, None])[:, None, :] | (anc[:, j].permute(1, 0, 2) & in_tree[:, None, :])
    kv_pos = torch.where(in_tree, L[:, None] + depth[j], c[None, :].expand(B, Lv))
    kv_slots = torch.where((c[None, :] < L[:, None] + N), table[:, :Lv], 0)
    out = table.gather(1, L[:, None] + torch.arange(N))
    return AttentionBatch(L[:, None] + depth[None, :], out, kv_slots, mask, kv_pos, table_columns=True)


def run(target, ids, batch, narrow, monkeypatch, widths):
    sdpa = attention_mod.F.scaled_dot_product_attention

    def spy(*a, **k):
        widths.append(a[1].shape[2])
        return sdpa(*a, **k)

    with monkeypatch.context() as m:
        m.setattr(attention_mod.F, "scaled_dot_product_attention", spy)
        if not narrow:
            m.setattr(AttentionBatch, "window_view", lambda self, window: self)
        with torch.no_grad():
            return target(ids, batch)


@pytest.mark.parametrize("layers", ["all", "alternate"])
@pytest.mark.parametrize("kind", ["extend", "tree"])
def test_window_view_gives_the_full_width_result_from_window_plus_q_columns(kind, layers, monkeypatch):
    """Same hidden states (float64) as attending over every column, on ragged rows that have cached
    context; the windowed layers' attention reads window - 1 + Q key columns, the full layers all of them."""
    pair = build_random_tiny(seed=3, dtype="float64", num_layers=2, sliding_window=WINDOW, sliding_layers=layers)
    target = pair.target
    target.setup_kv(1024)
    B, C = 3, 64
    table = torch.arange(1, B * C + 1).view(B, C)
    ctx = torch.tensor([17, 9, 30])
    g = torch.Generator().manual_seed(1)
    pre = extend_batch(table, torch.arange(B), torch.zeros(B, dtype=torch.long), ctx, int(ctx.max()), int(ctx.max()))
    with torch.no_grad():  # cached context: the masked pool path over a full-width prefill
        target(torch.randint(0, 250, (B, int(ctx.max())), generator=g), pre)
    if kind == "extend":
        lens = torch.tensor([5, 2, 6])
        Q, Lkv = int(lens.max()), int((ctx + lens).max())
        batch = lambda: extend_batch(table, torch.arange(B), ctx, lens, Q, Lkv)  # noqa: E731
        valid = torch.arange(Q)[None, :] < lens[:, None]
    else:
        parents = [-1, 0, 0, 1, 1, 3, 2]
        Q, Lkv = len(parents), int(ctx.max()) + len(parents)
        batch = lambda: tree_batch(table, ctx, parents)  # noqa: E731
        valid = torch.ones(B, Q, dtype=torch.bool)
    ids = torch.randint(0, 250, (B, Q), generator=g)
    full_w, narrow_w = [], []
    want = run(target, ids, batch(), False, monkeypatch, full_w)
    got = run(target, ids, batch(), True, monkeypatch, narrow_w)
    torch.testing.assert_close(got[valid], want[valid], rtol=0, atol=1e-10)
    windowed = target.window_layers()
    assert full_w == [Lkv] * 2
    assert narrow_w == [WINDOW - 1 + Q if i in windowed else Lkv for i in range(2)]


def test_window_view_is_the_batch_itself_when_not_narrower_or_not_table_columns():
    table = torch.arange(1, 33).view(2, 16)
    lens = torch.tensor([3, 4])
    b = extend_batch(table, torch.arange(2), torch.tensor([2, 1]), lens, 4, 6)
    assert b.window_view(3) is b  # 3 - 1 + 4 >= 6 columns
    narrow = extend_batch(table, torch.arange(2), torch.tensor([10, 8]), lens, 4, 14)
    v = narrow.window_view(3)
    assert v is not narrow and v is narrow.window_view(3) and v.kv_slots.shape == (2, 6)
    # row 0's first query sits at 10: columns 8..13; row 1's at 8: columns 6..11
    assert torch.equal(v.kv_positions, torch.stack([torch.arange(8, 14), torch.arange(6, 12)]))
    # row 1 holds 12 tokens: columns >= 12 are not valid keys, so they read the padding slot
    assert torch.equal(v.kv_slots[1], torch.tensor([7, 8, 9, 10, 11, 12]) + 16)
    assert torch.equal(v.attend_mask(), narrow.attend_mask().gather(
        2, v.kv_positions[:, None, :].expand(-1, 4, -1)))
    plain = AttentionBatch(narrow.positions, narrow.out_slots, narrow.kv_slots, None, narrow.kv_positions,
                           causal=narrow.causal)
    assert plain.window_view(3) is plain
