"""Draft scratch under paging: page-aligned per-branch regions, the prefix mirror, exact branch paths."""
from pathlib import Path

import numpy as np
import pytest
import torch

import specpipe
from specpipe.allocators import PagedAllocator, TokenAllocator
from specpipe.models.attention import KVPool
from specpipe.stages.draft_scratch import BranchRegions, FlatScratch, scratch_tokens_per_request
from specpipe.stages.prepare_decode import PrepareDecode

LENS = [1, 15, 16, 17, 33, 40]  # empty, partial, aligned and multi-page prefixes


def prepared(alloc, lens):
    prep = PrepareDecode(alloc, 8, 256, torch.device("cpu"))
    rows = np.asarray([prep.acquire_row() for _ in lens])
    L = np.asarray(lens, dtype=np.int64)
    assert prep.reserve(rows, L + 3)  # own a little past the prefix, as after a verify round
    prep.commit(rows, L)
    return prep, rows, torch.from_numpy(rows), L, torch.from_numpy(L)


@pytest.mark.parametrize("ps", [2, 16])
@pytest.mark.parametrize("K, W", [(1, 3), (3, 4), (4, 1)])
def test_regions_are_page_aligned_disjoint_and_handed_back(ps, K, W):
    alloc = PagedAllocator(4096, ps, debug=True)  # debug: the passed num_new_pages is verified
    prep, rows, rows_t, L, L_t = prepared(alloc, LENS)
    owned = {int(s) for r, n in zip(rows, prep.alloc_len[rows]) for s in prep.table[r, :n]}
    before = alloc.available()
    sc = prep.draft_scratch(rows, rows_t, L, L_t, K, W)
    assert isinstance(sc, BranchRegions)
    last, base = L % ps, L - L % ps
    P = -(-(last + W) // ps)
    assert before - alloc.available() == int((K * P - (last > 0)).sum()) * ps  # closed-form page count
    seen = set()
    for b in range(len(L)):
        for k in range(K):
            reg = sc.region[b, k, : P[b] * ps].tolist()
            for j, slot in enumerate(reg):
                v = base[b] + k * P[b] * ps + j  # virtual position
                assert slot % ps == v % ps, "slot not page-aligned with its position"
                if k == 0 and j < last[b]:
                    assert slot == int(prep.table[rows[b], base[b] + j])  # branch 0 continues the real page
                    continue
                assert slot not in seen and slot != 0
                seen.add(slot)
                if v >= base[b] + ps or k > 0:  # pages past the prefix's partial page are new
                    assert slot not in owned
            assert (sc.region[b, k, P[b] * ps:] == 0).all()
        cols = torch.stack([sc.region[b, k, last[b]: last[b] + W] for k in range(K)])  # [K, W]
        step_slots = [sc.step_batch(i).out_slots[b] for i in range(W)]
        assert torch.equal(torch.stack(step_slots, 1), cols)
    prep.end_scratch(sc.state)
    assert alloc.available() == before


def test_page_size_one_keeps_the_flat_layout():
    alloc = TokenAllocator(1024)
    prep, rows, rows_t, L, L_t = prepared(alloc, LENS)
    sc = prep.draft_scratch(rows, rows_t, L, L_t, 4, 3)
    assert isinstance(sc, FlatScratch) and sc.cols.shape == (len(LENS), 3, 4)
    assert scratch_tokens_per_request(1, 4, 3) == 12
    assert scratch_tokens_per_request(16, 4, 3) == 4 * 2 * 16  # worst case: the prefix page nearly full


def test_mirror_and_follow_copy_each_branch_its_own_path():
    ps, K, W = 4, 3, 3
    alloc = PagedAllocator(1024, ps)
    prep, rows, rows_t, L, L_t = prepared(alloc, [6, 9])
    pool = KVPool(1, alloc.pool_slots, 1, 1, torch.float64)
    pool.keys[0][:, 0, 0] = torch.arange(alloc.pool_slots, dtype=torch.float64)  # each slot holds its own id
    sc = prep.draft_scratch(rows, rows_t, L, L_t, K, W)
    last = (L % ps).tolist()
    prefix_ids = [prep.table[r, L[b] - last[b]: L[b]].double() for b, r in enumerate(rows)]
    sc.begin(prep, pool)
    for b in range(2):
        for k in range(K):  # every branch now starts with the prefix's partial page
            got = pool.keys[0][sc.region[b, k, : last[b]], 0, 0]
            assert torch.equal(got, prefix_ids[b])
    # step 0 wrote a token per branch: mark it, then re-rank so branch k continues parent[k]'s path
    out0 = sc.step_batch(0).out_slots
    pool.keys[0][out0.reshape(-1), 0, 0] = 1000.0 + torch.arange(2 * K, dtype=torch.float64)
    parent = torch.tensor([[2, 2, 0], [1, 0, 0]])
    sc.follow(prep, pool, parent, 1)
    for b in range(2):
        for k in range(K):
            col0 = pool.keys[0][sc.region[b, k, last[b]], 0, 0].item()
            assert col0 == 1000.0 + b * K + int(parent[b, k])
            assert torch.equal(pool.keys[0][sc.region[b, k, : last[b]], 0, 0], prefix_ids[b])  # prefix untouched


def trees(monkeypatch, cfg, pair, cls):
    """Run the pipeline and record every round's draft tree (tokens and parents)."""
    from specpipe.run import run

    seen = []
    propose = cls.propose

    def spy(self, *a, **k):
        tree, probs = propose(self, *a, **k)
        seen.append((tree.tokens.clone(), tree.parent.clone()))
        return tree, probs

    monkeypatch.setattr(cls, "propose", spy)
    out = run(cfg, quiet=True, pair=pair)
    monkeypatch.undo()
    return seen, out


TINY_TARGET = str(Path(specpipe.__file__).parent / "assets" / "tiny" / "target")


@pytest.mark.parametrize("drafter", [["draft=eagle"], ["draft=standalone", f"draft.path={TINY_TARGET}"]])
@pytest.mark.parametrize("ps", [2, 16])
def test_paged_draft_trees_equal_the_page_size_one_trees(drafter, ps, monkeypatch, prompts_file, tiny_pair):
    """Branches that re-rank onto another parent read that parent's path, so the per-branch regions
    (what a page-table kernel would read) give the same draft as the ancestry mask over flat slots.
    The trained pair drafts with attention that matters: without the mirror or `follow` trees differ."""
    from helpers import compose
    from specpipe.drafters.eagle import EagleProposer
    from specpipe.drafters.standalone import StandaloneProposer

    cls = EagleProposer if drafter[0] == "draft=eagle" else StandaloneProposer
    path = prompts_file(["d", "def f(x):\n   ", "class Stack:\n    def __init__(self):\n        ",
                         "import os\nimport sys\n", "for i in range(10):\n    print(i"])
    common = ["model=tiny", "device.dtype=float64", f"workload.prompts_file={path}", "workload.max_new_tokens=16",
              "workload.batch_size=5", *drafter, "draft.topk=4", "draft.num_steps=4", "draft.num_draft_tokens=10",
              "speculation=static"]  # (the same rounds on either allocator)
    want, base = trees(monkeypatch, compose(*common, "allocator=token"), tiny_pair, cls)
    got, out = trees(monkeypatch, compose(*common, "allocator=paged", f"allocator.page_size={ps}",
                                          "allocator.debug=true"), tiny_pair, cls)
    assert len(got) == len(want) > 3
    for (wt, wp), (gt, gp) in zip(want, got):
        assert torch.equal(wt, gt) and torch.equal(wp, gp)
    assert [r.output_ids for r in out["requests"]] == [r.output_ids for r in base["requests"]]
    assert out["metrics"]["kv_leaked_slots"] == 0


@pytest.fixture(scope="module")
def tiny_pair():
    from specpipe.models.hf.load import load_tiny

    return load_tiny(dtype="float64")


@pytest.mark.parametrize("ps", [4, 16])
def test_one_draft_step_takes_no_scratch_when_the_pool_is_full(ps):
    """num_steps=1 drafts no column, so the step budget counts no scratch; asking the allocator for the
    branches' pages anyway failed on a full pool, and the run died with OutOfKVMemory instead of retracting."""
    alloc = PagedAllocator(2 * ps, ps)
    prep, rows, rows_t, L, L_t = prepared(alloc, [ps + 1])  # owns both pages
    assert alloc.available() == 0 and scratch_tokens_per_request(ps, 4, 0) == 0
    sc = prep.draft_scratch(rows, rows_t, L, L_t, 4, 0)
    assert sc is not None and alloc.available() == 0
    prep.end_scratch(sc.state)
    assert alloc.available() == 0 and prep.reserve(rows, np.asarray([ps - 1]))  # the verify still fits


@pytest.mark.parametrize("ps", [1, 4])
def test_peak_use_counts_the_draft_scratch(ps):
    """kv_peak_slots is what a pool must hold: a draft round's throw-away slots are in use while it drafts."""
    alloc = PagedAllocator(4096, ps) if ps > 1 else TokenAllocator(4096)
    prep, rows, rows_t, L, L_t = prepared(alloc, LENS)
    held = alloc.size - alloc.available()
    sc = prep.draft_scratch(rows, rows_t, L, L_t, 4, 3)
    in_use = alloc.size - alloc.available()
    assert prep.peak_used == in_use > held
    prep.end_scratch(sc.state)
    assert prep.peak_used == in_use and alloc.size - alloc.available() == held
