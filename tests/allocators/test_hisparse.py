"""HiSparse allocator: model walk (prefill, logical decode, hot buffers), rollback, LRU buffer."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from specpipe.allocators import HiSparseAllocator, HotBuffer
from specpipe.allocators.reference import RefAllocator, RefPaired

from .machine import PAGE_SIZES, SETTINGS, t
from .test_swa import PairedInvariants


class RefHiSparse(RefPaired):
    """Decode is logical only; frees never defer."""

    def alloc_decode(self, seq_lens, last_loc):
        return self.p.alloc_decode(seq_lens, last_loc)

    def alloc_device_buffer(self, ids, need):
        ps = self.page_size
        dev = [d for d in (self.mapping.get(s, 0) for s in ids) if d > 0]
        tail = (-len(dev)) % ps
        fresh = max(need - len(dev) - tail, 0)
        if fresh > self.q.available():
            return None
        for page in {s // ps for s in ids}:
            for s in range(page * ps, (page + 1) * ps):
                self.mapping.pop(s, None)
        if len(dev) >= need:
            self.q.free(dev[need:])
            return dev[:need]
        dev += [dev[-1] + 1 + k for k in range(tail)] + (self.q.alloc(fresh) if fresh else [])
        return dev[:need]


def _walk(ps):
    class HiSparseMachine(PairedInvariants):
        page_size = ps
        group_defers = False

        def make(self):
            n = 6 * ps                                   # logical space: 12 pages
            self.buffers = {}
            return (HiSparseAllocator(n, ps, host_to_device_ratio=2, debug=True),
                    RefHiSparse(RefAllocator(2 * n, ps), RefAllocator(n, ps)))

        def extendable(self, r):
            return not r.decoded

        def after_decode(self, reqs):
            for r in reqs:
                r.decoded = True

        def peer_live(self):
            bufs = {s // ps for b in self.buffers.values() for s in b}
            return super().peer_live() | bufs

        def release(self, r):
            buf = self.buffers.pop(id(r), [])
            if buf:
                self.a.free_device(t(buf))
                self.ref.q.free(buf)

        @precondition(lambda self: self.reqs)
        @rule(data=st.data())
        def buffer(self, data):
            r = data.draw(st.sampled_from(self.reqs))
            need = data.draw(st.integers(0, 3)) * ps
            got = self.a.alloc_device_buffer(t(r.slots), need)
            exp = self.ref.alloc_device_buffer(r.slots, need)
            assert (got is None) == (exp is None)
            if got is not None:
                assert got.tolist() == exp
                self.buffers.setdefault(id(r), []).extend(exp)
                r.decoded = True

        @rule()
        def clear(self):
            super().clear()
            self.buffers = {}

    case = HiSparseMachine.TestCase
    case.settings = SETTINGS
    return case


for _ps in PAGE_SIZES:
    globals()[f"TestHiSparseWalkPs{_ps}"] = _walk(_ps)


def test_alloc_rolls_back_logical_ids_when_the_device_is_full():
    a = HiSparseAllocator(8, 1, host_to_device_ratio=4)
    assert a.alloc(8) is not None
    state = a.logical.free_pages
    assert a.alloc(1) is None
    assert torch.equal(a.logical.free_pages, state) and a.logical.available() == 24


def test_decode_is_logical_only_and_extend_maps_prefill():
    a = HiSparseAllocator(32, 4)
    ids = a.alloc_extend(t([0]), t([6]), t([-1]))
    dev = a.translate(ids)
    assert (dev > 0).all() and ((dev % 4) == (ids % 4)).all()
    d = a.alloc_decode(t([7]), ids[-1:])
    assert a.translate(d).tolist() == [0] and a.devpool.available() == 24


@pytest.mark.parametrize("need,freed,fresh", [(4, 4, 0), (8, 0, 0), (16, 0, 8)])
def test_device_buffer_keep_free_and_grow(need, freed, fresh):
    a = HiSparseAllocator(32, 4)
    ids = a.alloc_extend(t([0]), t([6]), t([-1]))            # 2 device pages, 6 slots used
    dev = a.translate(ids)
    buf = a.alloc_device_buffer(ids, need)
    assert buf.numel() == need and (a.translate(ids) == 0).all()
    assert buf[:min(need, 6)].tolist() == dev[:min(need, 6)].tolist()
    assert a.devpool.available() == 24 + freed - fresh
    a.free(ids)
    a.free_device(buf)
    assert a.devpool.available() == 32 and a.logical.available() == 64


def test_group_ops_are_noops_and_free_is_immediate():
    a = HiSparseAllocator(16, 1)
    x = a.alloc(4)
    a.free_group_begin()
    a.free(x)
    assert a.available() == 16 and (a.translate(x) == 0).all()
    a.free_group_end()
    a.free_hisparse(x)                                        # idempotent
    assert a.devpool.available() == 16


def test_hot_buffer_lru_counts_hits_misses_and_bytes():
    loads = []
    hb = HotBuffer(t([40, 41, 42]), bytes_per_token=10, load=lambda i, s: loads.append((i.tolist(), s.tolist())))
    assert hb.fetch(t([7, 8])).tolist() == [42, 41]
    assert hb.fetch(t([8, 9])).tolist() == [41, 40]            # 7 is now least recent
    assert hb.fetch(t([10, 9])).tolist() == [42, 40]           # evicts 7, not 8 or 9
    assert (hb.hits, hb.misses, hb.bytes_moved) == (2, 4, 40)
    assert loads[-1] == ([10], [42])
    with pytest.raises(ValueError):
        hb.fetch(t([1, 2, 3, 4]))
    assert hb.fetch(t([11, 11, 9])).tolist() == [41, 41, 40]   # a duplicate is loaded once
    assert (hb.misses, loads[-1]) == (5, ([11], [41]))


@given(st.lists(st.lists(st.integers(0, 30), unique=True, min_size=1, max_size=6), max_size=20))
def test_hot_buffer_matches_an_lru_model(steps):
    hb = HotBuffer(torch.arange(100, 106))
    model, hits = [], 0                          # least recent first; a call's hits, then misses
    for ids in steps:
        slots = hb.fetch(t(ids)).tolist()
        hit = [i for i in ids if i in model]
        hits += len(hit)
        model = [m for m in model if m not in ids]
        model = model[max(len(model) + len(ids) - 6, 0):] + hit + [i for i in ids if i not in hit]
        assert len(set(slots)) == len(slots) and hb.hits == hits
        assert list(hb.lru) == model


def test_a_leak_in_the_logical_pool_is_counted():
    """kv_leaked_slots counts every pool: min(logical, device) sizes hid logical ids never freed."""
    from specpipe.allocators import HiSparseAllocator
    from specpipe.outputs.summary import leaked_slots

    a = HiSparseAllocator(16, 1, host_to_device_ratio=4)
    ids = a.logical.alloc(8)  # logical ids only, never freed
    assert a.size - a.available() == 0 and leaked_slots(a) == 8
    a.logical.free(ids)
    assert leaked_slots(a) == 0
