"""Token allocator (page size 1): model walk plus the append-on-free order."""

from specpipe.allocators import TokenAllocator
from specpipe.allocators.reference import RefAllocator

from .machine import SETTINGS, AllocatorMachine, t


class TokenMachine(AllocatorMachine):
    def make(self):
        return TokenAllocator(self.num_pages), RefAllocator(self.num_pages, 1, append_frees=True)


TestTokenWalk = TokenMachine.TestCase
TestTokenWalk.settings = SETTINGS


def test_freed_slots_are_reused_last():
    a = TokenAllocator(6)
    x = a.alloc(3)
    a.free(x[:1])
    assert a.alloc(4).tolist() == [4, 5, 6, 1]


def test_decode_and_extend_through_the_shared_api():
    a = TokenAllocator(8)
    out = a.alloc_extend(t([0, 0]), t([2, 3]), t([-1, -1]))
    assert out.tolist() == [1, 2, 3, 4, 5]
    assert a.alloc_decode(t([3, 4]), t([2, 5])).tolist() == [6, 7]
    assert a.alloc_decode(t([4, 5]), t([6, 7])) is None and a.available() == 1
