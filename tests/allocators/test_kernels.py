"""Kernels vs the pure-Python reference: torch-native always, Triton (interpreted on CPU) if present.

Inputs live on conftest's DEVICE: CUDA tensors where a GPU is visible (compiled Triton), else CPU
(interpreted Triton)."""
import random
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specpipe.allocators import PagedAllocator, kernels_torch
from specpipe.allocators.reference import count_new_pages, ref_alloc_decode, ref_alloc_extend

from .conftest import DEVICE, HAS_TRITON, ROOT
from .machine import PAGE_SIZES
from .machine import t as host_t

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
KERNELS = [pytest.param("torch", id="torch"), pytest.param("triton", id="triton", marks=needs_triton)]
LIVE = 100_000  # page ids of the requests' existing partial pages; free pages lie below


def t(xs):
    return host_t(xs, DEVICE)


def kernels(name):
    if name == "torch":
        return kernels_torch
    from specpipe.allocators import kernels_triton
    return kernels_triton


def make_batch(rng: random.Random, bs: int, ps: int, long: int = 0):
    """Lengths mixing empty / aligned / unaligned prefixes with empty, same-page, aligned extends."""
    pre, seq, last = [], [], []
    for i in range(bs):
        p = rng.choice([0, rng.randrange(8) * ps, rng.randrange(5 * ps)])
        room = -p % ps                                    # free slots left in the partial page
        e = rng.choice([0, rng.randint(0, room), rng.randint(1, 3) * ps, rng.randrange(4 * ps), long])
        pre.append(p)
        seq.append(p + e)
        last.append(-1 if p == 0 else (LIVE + i) * ps + (p - 1) % ps)
    n = count_new_pages(pre, seq, ps)
    free = rng.sample(range(1, LIVE), n + rng.choice([0, 0, 3]))  # sometimes exactly n pages
    return pre, seq, last, free, n


def check_extend(name, pre, seq, last, free, n, ps, dtype=torch.int64):
    exp, used = ref_alloc_extend(pre, seq, last, free, ps)
    assert used == n
    lens = [torch.tensor(x, dtype=dtype, device=DEVICE) for x in (pre, seq)]
    out = kernels(name).alloc_extend(*lens, t(last), t(free), ps, n, len(exp))
    assert out.dtype == torch.int64 and out.tolist() == exp
    pos = [p for a, b in zip(pre, seq) for p in range(a, b)]
    assert len(set(exp)) == len(exp) and 0 not in exp
    assert all(s % ps == p % ps for s, p in zip(exp, pos))


@pytest.mark.parametrize("name", KERNELS)
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32), ps=st.sampled_from(PAGE_SIZES), bs=st.integers(0, 24),
       int32=st.booleans())
def test_extend_random_batches(name, seed, ps, bs, int32):
    batch = make_batch(random.Random(seed), bs, ps)
    check_extend(name, *batch, ps, torch.int32 if int32 else torch.int64)


@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_extend_batch_over_300_requests(name, ps):
    check_extend(name, *make_batch(random.Random(ps), 333, ps), ps)


@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("ps", [1, 16])
def test_extend_longer_than_the_block_loop(name, ps):
    check_extend(name, *make_batch(random.Random(7), 3, ps, long=5000), ps)


def decode_batch(rng, bs, ps, exhaust):
    seq = [rng.choice([1, 2, ps, ps + 1, ps + 2, 3 * ps, rng.randint(1, 5 * ps)]) for _ in range(bs)]
    last = [-1 if s == 1 else (LIVE + i) * ps + (s - 2) % ps for i, s in enumerate(seq)]
    n = sum((s - 1) % ps == 0 for s in seq)
    return seq, last, rng.sample(range(1, LIVE), n + (0 if exhaust else 2)), n


@pytest.mark.parametrize("name", KERNELS)
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32), ps=st.sampled_from(PAGE_SIZES), bs=st.integers(0, 40),
       exhaust=st.booleans())
def test_decode_random_batches(name, seed, ps, bs, exhaust):
    seq, last, free, n = decode_batch(random.Random(seed), bs, ps, exhaust)
    exp, used = ref_alloc_decode(seq, last, free, ps)
    out = kernels(name).alloc_decode(t(seq), t(last), t(free), ps, n)
    assert used == n and out.tolist() == exp


@pytest.mark.parametrize("name", KERNELS)
def test_decode_free_list_exactly_exhausted_with_trailing_non_openers(name):
    seq, last = [6, 5, 7, 8], [41, LIVE * 4 + 3, 45, 50]   # ps 4: only the second opens a page
    out = kernels(name).alloc_decode(t(seq), t(last), t([9]), 4, 1)
    assert out.tolist() == [42, 36, 46, 51]


@needs_triton
@pytest.mark.parametrize("ps", [1, 16])
def test_allocator_parity_triton_vs_torch(ps):
    """The same walk of extends, decodes and frees through both kernel choices."""
    a, b = (PagedAllocator(64 * ps, ps, device=DEVICE, kernels=k) for k in ("torch", "triton"))
    rng, rows = random.Random(ps), [[] for _ in range(5)]
    for step in range(6):
        pre = [len(r) for r in rows]
        seq = [p + (1 if step % 2 else rng.randrange(2 * ps)) for p in pre]
        last = t([r[-1] if r else -1 for r in rows])
        if step % 2:
            outs = [x.alloc_decode(t(seq), last) for x in (a, b)]
        else:
            outs = [x.alloc_extend(t(pre), t(seq), last) for x in (a, b)]
        assert outs[0].tolist() == outs[1].tolist()
        got = outs[0].tolist()
        for r, p, q in zip(rows, pre, seq):
            r += got[:q - p]
            got = got[q - p:]
        if step == 3:
            for x in (a, b):
                x.free(t(rows[0]))
            rows[0] = []
    assert a.free_pages.tolist() == b.free_pages.tolist()


@needs_triton
def test_one_triton_compilation_serves_every_batch_size(monkeypatch):
    """Only the page size (and block sizes) are compile-time constants: a new batch size mid-run must not compile a
    new kernel (a constexpr batch bound did, once per power of two). Checked on what each launch passes."""
    from specpipe.allocators import kernels_triton

    seen = []

    class Launch:
        def __getitem__(self, grid):
            return lambda *args, **constexprs: seen.append((tuple(a.dtype for a in args), constexprs))

    monkeypatch.setattr(kernels_triton, "_kernels", lambda: (Launch(), Launch()))
    for bs in (1, 2, 3, 5, 9, 17, 33, 130, 333):
        kernels_triton.alloc_extend(t([0] * bs), t([3] * bs), t([-1] * bs), t(range(1, 40 * bs)), 4, bs, 3 * bs)
        kernels_triton.alloc_decode(t([5] * bs), t([7] * bs), t(range(1, 40)), 4, 0)
    assert len(set(map(repr, seen))) == 2  # one signature per kernel


def test_package_import_does_not_import_triton():
    code = "import sys, specpipe.allocators; assert 'triton' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
