"""SWA allocator: model walk with window eviction, mapping invariants, no leak on failure."""
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from specpipe.allocators import SWAAllocator
from specpipe.allocators.reference import RefAllocator, RefPaired

from .machine import PAGE_SIZES, SETTINGS, AllocatorMachine, t


class PairedInvariants(AllocatorMachine):
    """Mapping == model, peer pool conserved, one primary page <-> one peer page."""

    def peer_live(self) -> set:
        return {v // self.page_size for v in self.ref.mapping.values()}

    @invariant()
    def mapping_matches_model(self):
        real = self.a.mapping.tolist()
        assert real[-1] == -1 and len(real) == self.a.pool_slots + 1
        model = [0] * (len(real) - 1)
        for k, v in self.ref.mapping.items():
            model[k] = v
        assert real[:-1] == model

    @invariant()
    def peer_conservation(self):
        ps, peer = self.page_size, self.a.peer
        free = peer.free_pages.tolist()
        assert free == self.ref.q.free_pages
        live = self.peer_live()
        assert not live & set(free) and len(set(free)) == len(free)
        assert live | set(free) == set(range(1, peer.num_pages + 1))
        assert peer.available() <= peer.size
        pairs = {(k // ps, v // ps) for k, v in self.ref.mapping.items()}
        assert len({p for p, _ in pairs}) == len(pairs) == len({q for _, q in pairs})
        assert all(k % ps == v % ps for k, v in self.ref.mapping.items())


def _walk(ps, window):
    class SWAMachine(PairedInvariants):
        page_size = ps

        def make(self):
            n, m = self.num_pages * ps, 9 * ps          # the window pool is smaller
            return (SWAAllocator(n, ps, window=window, swa_num_slots=m, debug=True),
                    RefPaired(RefAllocator(n, ps), RefAllocator(m, ps)))

        @precondition(lambda self: self.reqs)
        @rule(data=st.data())
        def evict(self, data):
            r = data.draw(st.sampled_from(self.reqs))
            n = len(r.slots)
            new = self.a.evict_outside_window(t(r.slots)[None], t([n]), t([r.evicted]))
            old = -(-r.evicted // ps) * ps
            cut = max(n - window - ps, 0) // ps * ps
            if cut > old:
                self.ref.free_peer(r.slots[old:cut])
                r.evicted = cut
            assert new.tolist() == [r.evicted]

        @precondition(lambda self: self.reqs)
        @rule(data=st.data())
        def evict_by_page(self, data):
            """The decode loop's form: the host names each page that left the window by its first slot."""
            r = data.draw(st.sampled_from(self.reqs))
            old = -(-r.evicted // ps) * ps
            cut = max(len(r.slots) - window - ps, 0) // ps * ps
            if cut > old:
                self.a.free_swa_page_starts(t(r.slots[old:cut:ps]))
                self.ref.free_peer(r.slots[old:cut])
                r.evicted = cut

        def free_positions(self, r, keep, by_page_start):
            if not by_page_start:
                return super().free_positions(r, keep, by_page_start)
            split = max(keep, -(-r.evicted // ps) * ps)  # evicted positions hold no window page
            for part, window in ((r.slots[keep:split], False), (r.slots[split:], True)):  # two frees, in order
                if part:
                    self.a.free_page_starts(t(part[::ps]), window=window)
                    self.ref.free(part)
            if self.grouped and self.group_defers:
                self.pending += r.slots[keep:]

        @invariant()
        def window_slots(self):
            for r in self.reqs:
                mapped = self.a.translate(t(r.slots)).tolist()
                assert all(m == 0 for m in mapped[:r.evicted])
                assert all(m > 0 and m % ps == p % ps
                           for p, m in enumerate(mapped) if p >= r.evicted)

    case = SWAMachine.TestCase
    case.settings = SETTINGS
    return case


for _ps in PAGE_SIZES:
    globals()[f"TestSWAWalkPs{_ps}"] = _walk(_ps, window=max(_ps, 3))


def test_mapping_offsets_and_translate_minus_one():
    a = SWAAllocator(64, 4, window=4, swa_num_slots=32)
    assert "window_evict" in a.capabilities
    assert (a.pool_slots, a.swa_pool_slots) == (68, 36)
    assert a.translate(t([-1])).tolist() == [-1]
    full = a.alloc_extend(t([0]), t([6]), t([-1]))
    swa = a.translate(full)
    assert ((full % 4) == (swa % 4)).all() and (swa > 0).all()
    d = a.alloc_decode(t([7]), full[-1:])
    assert a.translate(d).tolist() == [swa[-1].item() + 1]


def test_decode_failure_leaks_nothing():
    a = SWAAllocator(64, 4, window=4, swa_num_slots=8)          # 2 window pages, 16 full
    a.alloc_extend(t([0, 0]), t([4, 4]), t([-1, -1]))           # window pool now empty
    full_before, swa_before = a.full.free_pages, a.swa.free_pages
    assert a.alloc_decode(t([5, 5]), t([4, 8])) is None         # both need a page
    assert a.full.free_pages is full_before and a.swa.free_pages is swa_before


@pytest.mark.parametrize("ps", [1, 4])
def test_evict_then_free_restores_both_pools(ps):
    a = SWAAllocator(128, ps, window=8)
    row = a.alloc_extend(t([0]), t([30]), t([-1]))
    ev = a.evict_outside_window(row[None], t([30]), t([0]))
    cut = (30 - 8 - ps) // ps * ps
    assert ev.tolist() == [cut]
    assert a.swa_available() == 128 - (-(-30 // ps) * ps) + cut
    assert (a.translate(row[:cut]) == 0).all() and (a.translate(row[cut:]) > 0).all()
    a.free_swa(row[:cut])                                        # idempotent
    a.free(row)
    assert a.full_available() == a.swa_available() == 128


def test_evict_respects_protected_prefix_and_page_floor():
    a = SWAAllocator(256, 4, window=8)
    row = a.alloc_extend(t([0]), t([30]), t([-1]))
    ev = a.evict_outside_window(row[None], t([30]), t([0]), protected_lens=t([6]))
    assert ev.tolist() == [16]                                    # freed [8, 16) only
    assert a.translate(row).ne(0).tolist() == [True] * 8 + [False] * 8 + [True] * 14


def test_grouped_free_defers_both_pools():
    a = SWAAllocator(64, 4, window=4)
    x = a.alloc(8)
    a.free_group_begin()
    a.free(x)
    assert a.available() == 56
    a.free_group_end()
    assert a.available() == 64 and (a.translate(x) == 0).all()


def test_restore_unmaps_scratch_pages():
    a = SWAAllocator(64, 4, window=4)
    row = a.alloc_extend(t([0]), t([5]), t([-1]))
    state = a.backup_state()
    draft = a.alloc_extend(t([5]), t([11]), row[-1:])
    a.restore_state(state)
    assert (a.translate(draft[3:]) == 0).all()                 # fresh pages handed back
    assert (a.translate(draft[:3]) > 0).all()                  # slots of the kept page stay
    assert a.available() == 64 - 8
