"""compile.draft_loop.steps: an EAGLE round's tree steps as one call, with the step-by-step round's tokens."""
import pytest

from helpers import compose
from pipeline_spy import run_watched

AOT = "'compile(dynamic=true, fullgraph=true, backend=aot_eager)'"
BASE = ["model=random_tiny", "device.dtype=float64", "workload.num_prompts=5", "workload.max_new_tokens=12",
        "workload.batch_size=3", "speculation=static"]  # every tree verified whole: the same rounds eager and fused


def counted(monkeypatch, cfg):
    """Run `cfg`; returns (outputs, metrics, rounds run step by step, whether the rounds ran as one call)."""
    from specpipe.drafters import eagle

    calls = [0]
    step_by_step = eagle.EagleProposer.step_by_step

    def counting(self, *a):
        calls[0] += 1
        return step_by_step(self, *a)

    monkeypatch.setattr(eagle.EagleProposer, "step_by_step", counting)
    seen = run_watched(monkeypatch, cfg)
    return [r.output_ids for r in seen["requests"]], seen["metrics"], calls[0], seen["pipe"].proposer.one_call


CHAIN = ["draft.topk=1", "draft.num_steps=4", "draft.num_draft_tokens=5"]
TREE = ["draft.topk=3", "draft.num_steps=3", "draft.num_draft_tokens=7"]
PAGED = ["allocator=paged", "allocator.page_size=4"]


@pytest.mark.parametrize("tree", [CHAIN, TREE, [*CHAIN, *PAGED], [*TREE, *PAGED]],
                         ids=["chain", "tree", "paged-chain", "paged-tree"])
def test_one_call_per_round_gives_the_step_by_step_tokens(tree, monkeypatch):
    """Both scratch layouts: the flat columns of page size 1, and page-aligned branch regions (page size 4), whose
    copies of each parent's columns between steps run inside the call (a tree that re-ranks needs them)."""
    eager, m_eager, stepwise, _ = counted(monkeypatch, compose(*BASE, *tree))
    assert stepwise == m_eager["num_verify_steps"] > 0  # the default: every round step by step
    fused, m_fused, stepwise, one_call = counted(monkeypatch, compose(*BASE, *tree, f"compile.draft_loop.steps={AOT}"))
    assert stepwise == 0 and one_call  # every round one compiled call
    assert fused == eager
    assert m_fused["accept_length_mean"] == m_eager["accept_length_mean"]
    assert m_fused.get("unapplied_compile_policies") is None


def test_the_loop_body_equals_the_step_by_step_round():
    """The function itself, eager: the tree the per-step calls and build_tree make, on a round that re-ranks; a
    request whose draft turns NaN is flagged alone."""
    import torch

    from specpipe.models.random_tiny import build_random_tiny
    from specpipe.drafters.eagle import EagleProposer
    from specpipe.stages.draft_scratch import FlatScratch

    torch.manual_seed(0)
    head = build_random_tiny(dtype="float64").draft
    B, K, S, Lp, H = 2, 3, 4, 16, head.config.hidden_size
    head.setup_kv(256)
    prop = EagleProposer(head, K, S, 10)
    topk_p = torch.softmax(torch.randn(B, K, dtype=torch.float64), -1)
    topk_index = torch.randint(0, 50, (B, K))
    hidden = torch.randn(B, H, dtype=torch.float64)
    prefix = torch.arange(1, 1 + B * Lp).view(B, Lp)
    valid = torch.arange(Lp)[None, :] < torch.tensor([[9], [14]])
    cols = torch.arange(100, 100 + B * (S - 1) * K).view(B, S - 1, K)
    seq = torch.tensor([9, 14])
    sc = FlatScratch(cols, prefix, valid, seq, 0, None)
    prop.topk_p, prop.topk_index, prop.draft_hidden = topk_p, topk_index, hidden

    class Prep:
        device = "cpu"

        @staticmethod
        def decorate(b):
            return b

    blocks = prop.step_by_step(Prep, head.kv, sc, B)
    ref = prop.tree_stage(torch.tensor([5, 7]), *(list(x) for x in zip(*blocks)), seq)
    assert torch.any(ref.parent[:, 2:] > 0)  # a real tree: some node hangs below another draft node
    prop.loop.layout = FlatScratch
    tree, bad = prop.loop.steps(topk_p, topk_index, hidden, torch.tensor([5, 7]), seq, *sc.tensors())
    for got, want in zip(tree, astuple_shallow(ref)):
        assert torch.equal(got, want)
    assert not bad.any()
    hidden[1, 0] = float("nan")  # request 1's draft scores turn NaN, request 0's do not
    _, bad = prop.loop.steps(topk_p, topk_index, hidden, torch.tensor([5, 7]), seq, *sc.tensors())
    assert bad.tolist() == [False, True]


def test_the_loop_body_copies_each_parents_columns_in_page_aligned_regions(monkeypatch):
    """Page size > 1, eager: each branch drafts in its own page-aligned region, and before a step takes its parent's
    columns (BranchRegions.follow), inside the function as between the per-step calls: the same tree as step by step,
    on a round where the re-rank moves branches onto other parents, so that skipping the copies changes the tree."""
    import numpy as np
    import torch

    from specpipe.models.random_tiny import build_random_tiny
    from specpipe.drafters.eagle import EagleProposer
    from specpipe.stages.draft_scratch import BranchRegions

    torch.manual_seed(0)
    head = build_random_tiny(dtype="float64").draft
    B, K, S, ps, H = 2, 3, 4, 4, head.config.hidden_size
    kv = head.setup_kv(256)
    with torch.no_grad():  # attention that moves the draft's scores (random_tiny's o_proj is near zero)
        for t in (*kv.keys, *kv.values):  # a prefix with small K/V: the draft columns weigh in
            t.normal_(0, 0.01)
        attn = head.layers[0].self_attn
        attn.o_proj.weight.normal_(0, 0.5)
        attn.v_proj.weight.normal_(0, 0.5)
    prop = EagleProposer(head, K, S, 20)  # a tree wide enough to hold step 2's candidates (drafted after a copy)
    L = np.array([9, 14])
    last, base = L % ps, L - L % ps
    R = 8  # ceil((last + S - 1) / ps) = 1 and 2 pages per branch
    region = torch.zeros(B, K, R, dtype=torch.int64)
    for b, pages in enumerate(-(-(last + S - 1) // ps)):
        for k in range(K):
            region[b, k, :pages * ps] = 100 + (b * K + k) * R + torch.arange(pages * ps)
    region[:, 0, :ps] = torch.tensor([[8, 9, 10, 11], [12, 13, 14, 15]])  # branch 0 goes on in the partial last page
    prefix = torch.arange(16).expand(B, 16).clone()
    sc = BranchRegions(region, torch.from_numpy(last), torch.from_numpy(base), prefix, 0, None, last.copy())
    topk_p = torch.softmax(torch.randn(B, K, dtype=torch.float64), -1)
    topk_index = torch.randint(0, 50, (B, K))
    hidden = torch.randn(B, H, dtype=torch.float64)
    prop.topk_p, prop.topk_index, prop.draft_hidden = topk_p, topk_index, hidden
    L_t, root = torch.from_numpy(L), torch.tensor([5, 7])
    saved = [t.clone() for t in (*kv.keys, *kv.values)]

    class Prep:
        device = "cpu"

        @staticmethod
        def decorate(b):
            return b

        @staticmethod
        def move_kv(pool, tgt, src):
            pool.move(tgt, src)

    def fresh_pool():
        for t, v in zip((*kv.keys, *kv.values), saved):
            t.copy_(v)

    blocks = prop.step_by_step(Prep, kv, sc, B)
    ref = prop.tree_stage(root, *(list(x) for x in zip(*blocks)), L_t)
    loop = prop.loop
    loop.layout, loop.prep, loop.kv = BranchRegions, Prep, kv

    def one_call():
        fresh_pool()
        sc.begin(Prep, kv)
        return loop.steps(topk_p, topk_index, hidden, root, L_t, *sc.tensors())[0]

    for got, want in zip(one_call(), astuple_shallow(ref)):
        assert torch.equal(got, want)
    monkeypatch.setattr(BranchRegions, "follow", lambda *a: None)
    assert not all(torch.equal(got, want) for got, want in zip(one_call(), astuple_shallow(ref)))


def astuple_shallow(tree):
    import dataclasses

    return [getattr(tree, f.name) for f in dataclasses.fields(tree)]


def test_allocators_that_decorate_batches_run_step_by_step_and_say_so(monkeypatch, capsys):
    swa = ["model.sliding_window=8", "allocator=swa"]
    cfg = compose(*BASE, *TREE, *swa, f"compile.draft_loop.steps={AOT}")
    out, m, stepwise, one_call = counted(monkeypatch, cfg)
    assert stepwise == m["num_verify_steps"] > 0 and not one_call
    key = f"compile.draft_loop.steps={AOT.strip(chr(39))}"
    assert m["unapplied_compile_policies"] == [key]
    err = capsys.readouterr().err
    assert "the draft steps run one call each with allocator=swa, since the SWA window pool's slots" in err
    ref, *_ = counted(monkeypatch, compose(*BASE, *TREE, *swa))
    assert out == ref


def test_every_tree_shape_keeps_its_own_graphs():
    """The round's graphs unroll the tree shape; sharing one code object, an in-process sweep's shapes used up
    Dynamo's recompile limit (8 per code object) and later shapes ran eager. Here with the limit at 1 and two
    shapes: no limit hit, each shape's tokens as eager, and a repeated shape compiles nothing new."""
    import torch._dynamo.config as dynamo_config

    from specpipe.run import run
    from specpipe.decode.metrics import recompile_count

    policy = [f"compile.draft_loop.steps={AOT}", f"compile.verify.round={AOT}"]
    shapes = [["draft.topk=1", f"draft.num_steps={s}", f"draft.num_draft_tokens={s + 1}"] for s in (2, 3)]
    with dynamo_config.patch(recompile_limit=1):  # (a config module: monkeypatch's undo would delete the key)
        for shape in shapes:
            m = run(compose(*BASE, *shape, *policy), quiet=True)
            assert m["metrics"]["recompile_limit_hits"] == 0, shape
            eager = run(compose(*BASE, *shape), quiet=True)["requests"]
            assert [r.output_ids for r in m["requests"]] == [r.output_ids for r in eager]
        before = recompile_count()
        assert run(compose(*BASE, *shapes[0], *policy), quiet=True)["metrics"]["recompile_limit_hits"] == 0
    assert recompile_count() == before  # the repeated first shape reused its graphs
