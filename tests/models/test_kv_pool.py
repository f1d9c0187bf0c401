"""KVPool: one tensor pair per layer (never views of one stacked tensor), and `move` over every layer."""
import pytest
import torch

from specpipe.models.attention import KVPool


def test_every_layer_owns_its_storage():
    # a compiled forward that writes a view of a shared base is functionalized into whole-base copies
    # (per layer, per call: ~10x slower than eager on CPU), so no two layers may share a storage
    pool = KVPool(4, 64, 2, 8, torch.float32, window_slots=16, window_layers=[1, 3])
    ptrs = [t.untyped_storage().data_ptr() for i in range(4) for t in pool.layer(i)]
    assert len(set(ptrs)) == 8
    assert all(t._base is None for i in range(4) for t in pool.layer(i))
    assert [pool.layer(i)[0].shape[0] for i in range(4)] == [64, 16, 64, 16]
    assert pool.num_slots == 64 and pool.window_slots == 16 and pool.has_window


def test_move_copies_every_layer_and_uses_window_slots_for_window_layers():
    pool = KVPool(3, 32, 1, 2, torch.float64, window_slots=8, window_layers=[1])
    for i in range(3):
        k, v = pool.layer(i)
        k.copy_(torch.arange(k.numel(), dtype=torch.float64).view_as(k) + 100 * i)
        v.copy_(-k)
    before = [tuple(t.clone() for t in pool.layer(i)) for i in range(3)]
    tgt, src = torch.tensor([5, 6]), torch.tensor([20, 9])
    wtgt, wsrc = torch.tensor([1, 2]), torch.tensor([7, 4])
    pool.move(tgt, src, wtgt, wsrc)
    for i, (t, s) in enumerate([(tgt, src), (wtgt, wsrc), (tgt, src)]):
        for new, old in zip(pool.layer(i), before[i]):
            assert torch.equal(new[t], old[s])
            keep = torch.ones(new.shape[0], dtype=torch.bool)
            keep[t] = False
            assert torch.equal(new[keep], old[keep])
    with pytest.raises(ValueError, match="window_tgt"):
        pool.move(tgt, src)


def test_a_compiled_forward_writes_only_the_slots_it_names():
    """Slot 0 (padding rows write it; masked columns read it) is zeroed each layer. Written as `ks[0].zero_()`, a
    compiled forward turned it into a select_scatter over the whole pool tensor, written back per layer and call:
    a 100k-slot pool cost ~3 ms a tensor on CPU. Through an index (index_fill_) inductor updates the slot in place."""
    from torch._dynamo.backends.common import aot_autograd

    from specpipe.models.attention_batch import AttentionBatch
    from specpipe.models.random_tiny import build_random_tiny
    from specpipe.stages.verify import Verify

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm

    target = build_random_tiny(seed=0, dtype="float32", max_position=64).target
    target.setup_kv(32)
    B, L, Q = 1, 4, 3
    table = torch.arange(L + Q)[None] + 1
    table[0, -1] = 0  # a padding query writes slot 0
    batch = AttentionBatch(torch.arange(L, L + Q)[None], table[:, L:].contiguous(), table,
                           torch.ones(B, Q, L + Q, dtype=torch.bool), torch.arange(L + Q)[None])
    forward = torch.compile(Verify(target, 1).target_forward, backend=aot_autograd(fw_compiler=keep), dynamic=True)
    with torch.inference_mode():
        forward(torch.tensor([[1, 2, 3]]), batch)
    ops = {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}
    assert graphs and "aten.index_copy.default" in ops
    assert not {o for o in ops if "select_scatter" in o or "slice_scatter" in o}, ops
    for i in range(len(target.kv.keys)):
        k, v = target.kv.layer(i)
        assert not k[0].any() and not v[0].any() and k[1:L + Q - 1].abs().sum() > 0
