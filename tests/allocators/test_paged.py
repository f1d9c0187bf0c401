"""Paged allocator: model walk for page sizes 1..64, OOM, num_new_pages, free order."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specpipe.allocators import HiSparseAllocator, PagedAllocator, SWAAllocator, num_new_pages
from specpipe.allocators.reference import RefAllocator

from .conftest import DEVICE, HAS_TRITON
from .machine import PAGE_SIZES, SETTINGS, AllocatorMachine, t


def _walk(ps, kernels="torch", device="cpu"):
    class PagedMachine(AllocatorMachine):
        page_size = ps

        def make(self):
            n = self.num_pages * ps
            return PagedAllocator(n, ps, device=device, debug=True, kernels=kernels), RefAllocator(n, ps)

    PagedMachine.device = device
    case = PagedMachine.TestCase
    case.settings = SETTINGS
    return case


for _ps in PAGE_SIZES:
    globals()[f"TestPagedWalkPs{_ps}"] = _walk(_ps)
# the same walk through the Triton kernels, on CUDA tensors where a GPU is visible (interpreted on CPU)
TestPagedWalkTritonPs16 = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")(
    _walk(16, "triton", DEVICE))


def test_extend_layout_fills_partial_page_then_new_pages():
    a = PagedAllocator(40, 4)          # pages 1..10
    first = a.alloc_extend(t([0]), t([6]), t([-1]))
    assert first.tolist() == [4, 5, 6, 7, 8, 9]
    out = a.alloc_extend(t([6, 0]), t([11, 2]), t([9, -1]), num_new_pages=2, extend_num_tokens=7)
    assert out.tolist() == [10, 11, 12, 13, 14, 16, 17]
    assert a.available() == 6 * 4


@pytest.mark.parametrize("ps", [2, 16])
def test_oom_exactly_enough_then_one_short(ps):
    a = PagedAllocator(3 * ps, ps)
    before = a.backup_state()
    assert a.alloc_extend(t([0]), t([3 * ps + 1]), t([-1])) is None
    assert a.free_pages is before                      # untouched: not even re-sliced
    assert a.alloc_extend(t([0]), t([3 * ps]), t([-1])) is not None
    assert a.available() == 0


def test_wrong_num_new_pages_trips_debug_only():
    args = (t([0, 3]), t([5, 9]), t([-1, 6]))   # ps 4: 2 + (3 - 1) = 4 pages
    with pytest.raises(AssertionError, match="num_new_pages=3 passed, but the lengths need 4"):
        PagedAllocator(64, 4, debug=True).alloc_extend(*args, num_new_pages=3)
    ok = PagedAllocator(64, 4, debug=True).alloc_extend(*args, num_new_pages=4)
    assert ok.tolist() == PagedAllocator(64, 4).alloc_extend(*args).tolist()


def test_debug_rejects_misaligned_last_loc_and_double_free():
    a = PagedAllocator(64, 4, debug=True)
    with pytest.raises(AssertionError, match="page-aligned"):
        a.alloc_extend(t([3]), t([5]), t([9]))           # slot 9 has offset 1, prefix 3 needs 2
    with pytest.raises(AssertionError, match="page-aligned"):
        a.alloc_extend(t([3]), t([5]), t([0]))           # a partly filled page needs its last slot
    assert a.alloc_extend(t([4]), t([6]), t([0])).numel() == 2  # a whole-page prefix may have none (SWA peer)
    x = a.alloc(8)
    a.free(x)
    with pytest.raises(AssertionError, match="double free"):
        a.free(x[:1])


def test_one_token_frees_its_page_and_pages_are_reused_first():
    a = PagedAllocator(32, 4)
    x = a.alloc(12)                                      # pages 1, 2, 3
    a.free(torch.cat((x[9:10], x[1:3])))                 # tokens of pages 3 and 1
    assert a.free_pages[:3].tolist() == [1, 3, 4]
    assert a.available() == 7 * 4


def test_grouped_frees_land_at_group_end_once():
    a = PagedAllocator(32, 4)
    x = a.alloc(16)
    a.free_group_begin()
    a.free(x[:4])
    a.free(x[4:6])
    a.free(x[12:])
    assert a.available() == 16
    a.free_group_end()
    assert a.free_pages[:3].tolist() == [1, 2, 4] and a.available() == 28


def test_decode_with_free_list_exactly_exhausted():
    a = PagedAllocator(16, 4)
    a.alloc_extend(t([0, 0, 0]), t([4, 2, 3]), t([-1, -1, -1]))   # pages 1, 2, 3
    assert a.available() == 4
    out = a.alloc_decode(t([5, 3, 4]), t([4, 9, 14]))   # only request 0 opens a page (page 4)
    assert out.tolist() == [16, 10, 15] and a.available() == 0
    assert a.alloc_decode(t([5]), t([15])) is None            # needs a page: none left
    assert a.alloc_decode(t([4]), t([10])).tolist() == [11]   # continues its page: fine


def test_backup_restore_is_o1_rebind():
    a = PagedAllocator(64, 4)
    state = a.backup_state()
    a.alloc_extend(t([0]), t([9]), t([-1]))
    a.restore_state(state)
    assert a.free_pages is state


def test_unknown_kernels_rejected():
    with pytest.raises(ValueError, match="kernels must be one of"):
        PagedAllocator(16, 4, kernels="cuda")


@pytest.mark.parametrize("make", [lambda: PagedAllocator(512, 16), lambda: PagedAllocator(64, 1),
                                  lambda: SWAAllocator(512, 16, window=16),
                                  lambda: HiSparseAllocator(512, 16)], ids=["paged", "ps1", "swa", "hisparse"])
def test_passed_counts_do_no_host_sync(make, monkeypatch):
    """With num_new_pages and extend_num_tokens given, nothing reads a device value on the host."""
    a = make()
    ps = a.page_size
    row = a.alloc_extend(t([0, 0]), t([3, 2 * ps]), t([-1, -1]))
    pre, seq, last = t([3, 2 * ps]), t([3 + 5, 2 * ps + 1]), row[t([2, 1 + 2 * ps])]
    n, d_n = num_new_pages(pre, seq, ps), num_new_pages(seq, seq + 1, ps)

    def sync(*args):
        raise AssertionError("host sync")
    for name in ("item", "tolist", "__bool__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, sync)
    out = a.alloc_extend(pre, seq, last, num_new_pages=n, extend_num_tokens=6)
    dec = a.alloc_decode(seq + 1, out[t([4, 5])], num_new_pages=d_n)
    monkeypatch.undo()
    assert out.numel() == 6 and dec.numel() == 2


@settings(max_examples=200, deadline=None)
@given(s=st.integers(0, 5000), steps=st.integers(1, 8), topk=st.integers(1, 8),
       ps=st.sampled_from([1, 2, 16, 64]))
def test_spec_closed_forms_match_the_page_count(s, steps, topk, ps):
    """kv_allocators.md §5: the counts EAGLE callers pass as num_new_pages."""
    chain = num_new_pages(t([s]), t([s + steps]), ps)
    assert chain == -(-(s + steps) // ps) - -(-s // ps)
    last = s % ps
    p = -(-(last + steps) // ps)
    tree_seq = s // ps * ps + p * ps * topk
    assert num_new_pages(t([s]), t([tree_seq]), ps) == p * topk - (last > 0)
