"""Model-based random walk shared by the allocator tests.

Every operation runs on the real allocator and on the pure-Python model from
``specpipe.allocators.reference``; outputs must match exactly and, after every step, the free
list must equal the model's and the page sets must be conserved (kv_allocators.md §6).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from specpipe.allocators.reference import count_new_pages

SETTINGS = settings(max_examples=20, stateful_step_count=30, deadline=None,
                    suppress_health_check=list(HealthCheck))
PAGE_SIZES = (1, 2, 16, 64)


def t(xs, device="cpu") -> torch.Tensor:
    return torch.tensor(list(xs), dtype=torch.int64, device=device)


@dataclass
class Req:
    slots: list = field(default_factory=list)   # slot of each position
    evicted: int = 0                            # SWA: positions whose window slots are gone
    decoded: bool = False                       # HiSparse: has logical-only tokens


class AllocatorMachine(RuleBasedStateMachine):
    """Subclasses set ``page_size`` and ``make()`` -> (allocator, model)."""

    page_size = 1
    num_pages = 12
    device = "cpu"               # the allocator's (and so its kernels' inputs')
    group_defers = True          # free groups defer frees (HiSparse frees at once)

    def make(self):
        raise NotImplementedError

    def t(self, xs) -> torch.Tensor:
        return t(xs, self.device)

    def __init__(self):
        super().__init__()
        self.a, self.ref = self.make()
        self.reqs: list[Req] = []
        self.blocks: list[list[int]] = []
        self.pending: list[int] = []
        self.grouped = False

    @property
    def primary(self):
        return getattr(self.a, "primary", self.a)

    def _primary_ref(self):
        return getattr(self.ref, "p", self.ref)

    # ---- drawing helpers ---------------------------------------------------------------
    def _draw_reqs(self, data, ok=lambda r: True, new_max=2) -> list[Req]:
        cand = [r for r in self.reqs if ok(r)]
        picked = data.draw(st.lists(st.sampled_from(cand), unique_by=id, max_size=3)) if cand else []
        return picked + [Req() for _ in range(data.draw(st.integers(0, new_max)))]

    def _ext(self, data) -> int:
        ps = self.page_size
        return data.draw(st.one_of(st.integers(0, 3 * ps), st.sampled_from([ps, 2 * ps])))

    def _record(self, reqs, exts, out) -> None:
        i = 0
        for r, e in zip(reqs, exts):
            r.slots += out[i:i + e]
            i += e
            if r.slots and all(r is not q for q in self.reqs):
                self.reqs.append(r)

    def _lists(self):
        """The free-list tensors themselves: OOM must leave them untouched (not even re-sliced)."""
        return [x.free_pages for x in (self.primary, getattr(self.a, "peer", None)) if x is not None]

    def _compare(self, out, exp, before=None):
        if exp is None:
            assert out is None, "allocator succeeded where the model ran out"
            assert before is None or all(a is b for a, b in zip(before, self._lists()))
            return None
        assert out is not None, "allocator ran out where the model did not"
        got = out.tolist()
        assert got == exp
        return got

    def extendable(self, r: Req) -> bool:
        return True

    # ---- rules -------------------------------------------------------------------------
    @rule(data=st.data())
    def extend(self, data):
        reqs = self._draw_reqs(data, self.extendable)
        exts = [self._ext(data) for _ in reqs]
        pre = [len(r.slots) for r in reqs]
        seq = [p + e for p, e in zip(pre, exts)]
        last = [r.slots[-1] if r.slots else -1 for r in reqs]
        n = count_new_pages(pre, seq, self.page_size) if data.draw(st.booleans()) else None
        tokens = sum(exts) if data.draw(st.booleans()) else None
        before = self._lists()
        out = self.a.alloc_extend(self.t(pre), self.t(seq), self.t(last), num_new_pages=n, extend_num_tokens=tokens)
        got = self._compare(out, self.ref.alloc_extend(pre, seq, last), before)
        if got is not None:
            self._record(reqs, exts, got)

    @rule(data=st.data())
    def decode(self, data):
        reqs = self._draw_reqs(data, new_max=1)
        seq = [len(r.slots) + 1 for r in reqs]
        last = [r.slots[-1] if r.slots else -1 for r in reqs]
        kw = {}
        if "num_new_pages" in self.a.capabilities and data.draw(st.booleans()):
            kw["num_new_pages"] = count_new_pages([s - 1 for s in seq], seq, self.page_size)
        before = self._lists()
        out = self.a.alloc_decode(self.t(seq), self.t(last), **kw)
        got = self._compare(out, self.ref.alloc_decode(seq, last), before)
        if got is not None:
            self.after_decode(reqs)
            self._record(reqs, [1] * len(reqs), got)

    def after_decode(self, reqs) -> None:
        pass

    @rule(pages=st.integers(1, 4))
    def alloc_block(self, pages):
        n = pages * self.page_size
        before = self._lists()
        got = self._compare(self.a.alloc(n), self.ref.alloc(n), before)
        if got is not None:
            self.blocks.append(got)

    def _free(self, slots, by_page_start: bool = False, **how) -> None:
        if not slots:
            return
        if by_page_start:  # whole pages named by their first slots: the same free list as freeing every slot
            self.a.free_page_starts(self.t(slots[::self.page_size]), **how)
        else:
            self.a.free(self.t(slots))
        self.ref.free(slots)
        if self.grouped and self.group_defers:
            self.pending += slots

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def free_tail(self, data):
        """Frees a request from a page boundary on (whole, exclusively owned pages)."""
        r = data.draw(st.sampled_from(self.reqs))
        keep = data.draw(st.integers(0, (len(r.slots) - 1) // self.page_size)) * self.page_size
        by_page_start = "free_page_starts" in self.a.capabilities and data.draw(st.booleans())
        self.free_positions(r, keep, by_page_start)
        r.slots = r.slots[:keep]
        r.evicted = min(r.evicted, keep)
        if not r.slots:
            self.release(r)
            self.reqs.remove(r)

    def free_positions(self, r: Req, keep: int, by_page_start: bool) -> None:
        """Frees r's positions from `keep` (page-aligned) on."""
        self._free(r.slots[keep:], by_page_start)

    def release(self, r: Req) -> None:
        """Hook: a request is gone (HiSparse returns its hot buffer)."""

    @precondition(lambda self: self.blocks)
    @rule(data=st.data())
    def free_block(self, data):
        self._free(self.blocks.pop(data.draw(st.integers(0, len(self.blocks) - 1))))

    @precondition(lambda self: not self.grouped)
    @rule()
    def group_begin(self):
        self.a.free_group_begin()
        if self.group_defers:
            self.ref.free_group_begin()
        self.grouped = True

    @precondition(lambda self: self.grouped)
    @rule()
    def group_end(self):
        self.a.free_group_end()
        if self.group_defers:
            self.ref.free_group_end()
        self.grouped, self.pending = False, []

    @rule(data=st.data(), steps=st.integers(1, 5))
    def scratch(self, data, steps):
        """EAGLE v1 draft slots: backup -> extend -> restore is the identity on the free set."""
        before = self.primary.free_pages.tolist()
        state, ref_state = self.a.backup_state(), self.ref.backup_state()
        reqs = self._draw_reqs(data, self.extendable, new_max=0)
        pre = [len(r.slots) for r in reqs]
        last = [r.slots[-1] if r.slots else -1 for r in reqs]
        seq = [p + steps for p in pre]
        out = self.a.alloc_extend(self.t(pre), self.t(seq), self.t(last), count_new_pages(pre, seq, self.page_size))
        self._compare(out, self.ref.alloc_extend(pre, seq, last))
        self.a.restore_state(state)
        self.ref.restore_state(ref_state)
        assert self.primary.free_pages.tolist() == before

    @precondition(lambda self: not self.grouped)
    @rule()
    def clear(self):
        self.a.clear()
        self.ref.clear()
        self.reqs, self.blocks, self.pending = [], [], []

    # ---- invariants --------------------------------------------------------------------
    def live_slots(self) -> list[int]:
        return [s for r in self.reqs for s in r.slots] + [s for b in self.blocks for s in b]

    @invariant()
    def conservation(self):
        ps, prim = self.page_size, self.primary
        free = prim.free_pages.tolist()
        assert free == self._primary_ref().free_pages, "free list differs from the model"
        live = {s // ps for s in self.live_slots()}
        pending = {s // ps for s in self.pending}
        assert len(set(free)) == len(free), "a page is free twice"
        assert not (live & set(free)) and not (pending & set(free)) and not (live & pending)
        assert live | pending | set(free) == set(range(1, prim.num_pages + 1))
        assert self.a.available() == self.ref.available()

    @invariant()
    def alignment(self):
        ps = self.page_size
        for r in self.reqs:
            assert 0 not in r.slots
            assert all(s % ps == pos % ps for pos, s in enumerate(r.slots))
            pages = [s // ps for s in r.slots]
            assert all(pages[i] == pages[i - 1] for i in range(1, len(pages)) if i % ps), \
                "positions of one logical page span two physical pages"
