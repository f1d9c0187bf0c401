"""Slow pure-Python reference allocator: the test oracle for the fast kernels and allocators.

Everything is plain ints and lists, written position by position straight from the rules in
kv_allocators.md §1, so that it is obviously right rather than fast.
"""
from __future__ import annotations

from typing import Optional, Sequence


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def count_new_pages(prefix_lens: Sequence[int], seq_lens: Sequence[int], page_size: int) -> int:
    """Σ ceil(seq/ps) - ceil(pre/ps): pages an extend takes from the free list."""
    return sum(ceil_div(s, page_size) - ceil_div(p, page_size) for p, s in zip(prefix_lens, seq_lens))


def ref_alloc_extend(prefix_lens: Sequence[int], seq_lens: Sequence[int], last_loc: Sequence[int],
                     free_pages: Sequence[int], page_size: int) -> tuple[list[int], int]:
    """(slots request-major, pages consumed). Reads free_pages from the front, never mutates it."""
    ps, out, used = page_size, [], 0
    for pre, seq, last in zip(prefix_lens, seq_lens, last_loc):
        page = None
        for pos in range(pre, seq):
            if pos < ceil_div(pre, ps) * ps:      # still inside the request's partial last page
                out.append(last + 1 + (pos - pre))
                continue
            if pos % ps == 0:                     # first token of a fresh page
                page = free_pages[used]
                used += 1
            out.append(page * ps + pos % ps)
    return out, used


def ref_alloc_decode(seq_lens: Sequence[int], last_loc: Sequence[int], free_pages: Sequence[int],
                     page_size: int) -> tuple[list[int], int]:
    """Decode = an extend of one token per request."""
    return ref_alloc_extend([s - 1 for s in seq_lens], seq_lens, last_loc, free_pages, page_size)


class RefAllocator:
    """List model of the paged allocator (``append_frees=True`` models the token allocator).

    Paged frees prepend the sorted distinct pages (reused first); token frees append the ids in
    the given order (reused last). OOM returns None and changes nothing.
    """

    def __init__(self, num_slots: int, page_size: int = 1, append_frees: bool = False):
        self.page_size = page_size
        self.num_pages = num_slots // page_size
        self.append_frees = append_frees
        self.clear()

    def clear(self) -> None:
        self.free_pages = list(range(1, self.num_pages + 1))
        self.group: Optional[list] = None

    def available(self) -> int:
        return len(self.free_pages) * self.page_size

    def backup_state(self) -> list:
        return list(self.free_pages)

    def restore_state(self, state: list) -> None:
        self.free_pages = list(state)

    def alloc(self, n: int) -> Optional[list[int]]:
        ps = self.page_size
        assert n % ps == 0
        if n // ps > len(self.free_pages):
            return None
        pages, self.free_pages = self.free_pages[:n // ps], self.free_pages[n // ps:]
        return [p * ps + o for p in pages for o in range(ps)]

    def alloc_extend(self, prefix_lens, seq_lens, last_loc) -> Optional[list[int]]:
        if count_new_pages(prefix_lens, seq_lens, self.page_size) > len(self.free_pages):
            return None
        out, used = ref_alloc_extend(prefix_lens, seq_lens, last_loc, self.free_pages, self.page_size)
        self.free_pages = self.free_pages[used:]
        return out

    def alloc_decode(self, seq_lens, last_loc) -> Optional[list[int]]:
        return self.alloc_extend([s - 1 for s in seq_lens], seq_lens, last_loc)

    def free(self, slots: Sequence[int]) -> None:
        if not len(slots):
            return
        if self.group is not None:
            self.group.extend(slots)
            return
        if self.append_frees:
            self.free_pages = self.free_pages + list(slots)
        else:
            self.free_pages = sorted({s // self.page_size for s in slots}) + self.free_pages

    def free_group_begin(self) -> None:
        assert self.group is None
        self.group = []

    def free_group_end(self) -> None:
        group, self.group = self.group, None
        self.free(group)


class RefPaired:
    """Model of the paired allocators (SWA full -> window, HiSparse logical -> device).

    ``mapping`` is a dict primary slot -> peer slot; absent means 0. Capacity is checked on both
    sides before either allocates; a peer free releases whole pages and forgets their slots.
    """

    def __init__(self, primary: RefAllocator, peer: RefAllocator):
        self.p, self.q = primary, peer
        self.page_size = primary.page_size
        self.mapping: dict[int, int] = {}
        self.group: Optional[list] = None

    def available(self) -> int:
        return min(self.p.available(), self.q.available())

    def clear(self) -> None:
        self.p.clear()
        self.q.clear()
        self.mapping.clear()
        self.group = None

    def _fits(self, pages: int) -> bool:
        return pages <= min(len(self.p.free_pages), len(self.q.free_pages))

    def alloc(self, n: int) -> Optional[list[int]]:
        if not self._fits(n // self.page_size):
            return None
        out = self.p.alloc(n)
        self.mapping.update(zip(out, self.q.alloc(n)))
        return out

    def alloc_extend(self, prefix_lens, seq_lens, last_loc) -> Optional[list[int]]:
        if not self._fits(count_new_pages(prefix_lens, seq_lens, self.page_size)):
            return None
        peer_last = [-1 if x == -1 else self.mapping.get(x, 0) for x in last_loc]
        out = self.p.alloc_extend(prefix_lens, seq_lens, last_loc)
        self.mapping.update(zip(out, self.q.alloc_extend(prefix_lens, seq_lens, peer_last)))
        return out

    def alloc_decode(self, seq_lens, last_loc) -> Optional[list[int]]:
        return self.alloc_extend([s - 1 for s in seq_lens], seq_lens, last_loc)

    def free_peer(self, slots: Sequence[int]) -> None:
        ps, peer = self.page_size, []
        for page in {s // ps for s in slots}:
            for s in range(page * ps, (page + 1) * ps):
                if s in self.mapping:
                    peer.append(self.mapping.pop(s))
        self.q.free(peer)

    def free(self, slots: Sequence[int]) -> None:
        if self.group is not None:
            self.group.extend(slots)
            return
        self.free_peer(slots)
        self.p.free(slots)

    def free_group_begin(self) -> None:
        assert self.group is None
        self.group = []

    def free_group_end(self) -> None:
        group, self.group = self.group, None
        if group:
            self.free(group)

    def backup_state(self):
        return self.p.backup_state(), self.q.backup_state()

    def restore_state(self, state) -> None:
        """Pages handed back by the restore (front of the restored primary list) lose their mapping."""
        p_state, q_state = state
        ps = self.page_size
        for page in p_state[:max(len(p_state) - len(self.p.free_pages), 0)]:
            for s in range(page * ps, (page + 1) * ps):
                self.mapping.pop(s, None)
        self.p.restore_state(p_state)
        self.q.restore_state(q_state)
