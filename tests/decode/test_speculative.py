"""The speculative round's commit: K/V moves only when an accepted node sits off its committed position, and the
per-request logits check flags every non-finite value."""
from types import SimpleNamespace

import pytest
import torch

from helpers import compose
from specpipe.run import run
from specpipe.models.attention import KVPool
from specpipe.stages.finite import finite_rows
from specpipe.decode.speculative import SpecPipeline


@pytest.fixture(scope="module")
def shipped():
    from specpipe.models.hf.load import load_tiny

    return load_tiny(dtype="float64")


def counted_run(pair, monkeypatch, path, *overrides):
    """Outputs, metrics and the number of KVPool.move calls of one run of the shipped pair; `counted_run.off` is the
    number of rounds in which some request accepted a node away from its committed position (node d of the path
    not being tree node d), read from the accept indices themselves."""
    from specpipe.decode import speculative as spec_pipeline

    calls = []
    move = KVPool.move
    monkeypatch.setattr(KVPool, "move", lambda self, *a, **k: (calls.append(1), move(self, *a, **k))[1])
    moves, off = spec_pipeline.commit_moves, []

    def watched(vslots, accept_index, count):
        d = torch.arange(accept_index.shape[1])
        on_path = d[None, :] <= count[:, None]  # path nodes 0..count (bonus included)
        off.append(bool(((accept_index != d[None, :]) & on_path).any()))
        return moves(vslots, accept_index, count)

    monkeypatch.setattr(spec_pipeline, "commit_moves", watched)
    common = ["model=tiny", "device.dtype=float64", f"workload.prompts_file={path}", "workload.max_new_tokens=32",
              "workload.batch_size=2", "speculation=static"]  # (every tree verified: the AL and moves are the tree's)
    out = run(compose(*common, *overrides), quiet=True, pair=pair)
    monkeypatch.setattr(KVPool, "move", move)
    monkeypatch.setattr(spec_pipeline, "commit_moves", moves)
    counted_run.off = sum(off)
    return [r.output_ids for r in out["requests"]], out["metrics"], len(calls)


def test_kv_moves_only_when_an_accepted_node_is_off_its_position(shipped, monkeypatch, prompts_file):
    path = prompts_file(["def fibonacci(n):\n    ", "class Stack:\n    def __init__(self):\n        ",
                         "import os\nimport sys\n\n", "    for i in range(len(items)):\n        "])
    want, _, _ = counted_run(shipped, monkeypatch, path, "draft=none")
    # a chain's accepted nodes are nodes 0..k in order: already where they are committed, never moved
    for chain in (["draft.topk=1", "draft.num_steps=5"], ["draft=ngram", "draft.topk=1", "draft.num_steps=6"]):
        got, m, moves = counted_run(shipped, monkeypatch, path, *chain)
        assert got == want, chain
        assert m["accept_length_mean"] > 1.5 and moves == 0, (chain, moves)
    # a tree accepts a later sibling's branch in some rounds only: exactly those rounds move (one request per round,
    # so that rounds with every accepted node in place occur)
    got, m, moves = counted_run(shipped, monkeypatch, path, "draft.topk=4", "draft.num_steps=4",
                                "draft.num_draft_tokens=10", "workload.batch_size=1")
    assert got == want
    assert 0 < moves == counted_run.off < m["num_verify_steps"], (moves, counted_run.off, m["num_verify_steps"])
    assert m["kv_leaked_slots"] == 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_round_status_flags_any_non_finite_logit(bad, dtype):
    B, N, V, S = 3, 5, 40, 4
    logits = torch.randn(B, N, V, dtype=torch.float64).mul(60).to(dtype)  # large but finite: sums of them may not be
    logits[1, 3, 17] = bad
    tree = SimpleNamespace(parent=torch.tensor([[-1, 0, 0, 1, 2]] * B))
    stub = SimpleNamespace(proposer=SimpleNamespace(bad=None))
    accept_index = torch.tensor([[0, 1, 3, -1, -1]] * B)
    stats = SpecPipeline.round_stats(stub, tree, accept_index, logits, torch.tensor([True, False, True]))
    assert stats[:, -1].tolist() == [1, 0, 1]  # status: only row 1 holds a non-finite logit
    assert stats[:, -2].tolist() == [1, 0, 1]  # in place, as given
    assert stats[:, :S].tolist() == [[0, 0, 0, 0]] * B and stats[:, S].tolist() == [4] * B  # ranks, linked


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_finite_rows_is_isfinite_all_even_where_a_sum_would_overflow(dtype):
    big = torch.finfo(dtype).max
    x = torch.tensor([[big, big, big], [1.0, 2.0, 3.0], [0.0, float("nan"), 1.0], [float("-inf"), 0.0, 0.0],
                      [-0.0, -5.0, 7.0]], dtype=dtype)
    assert finite_rows(x).tolist() == torch.isfinite(x).all(-1).tolist() == [True, True, False, False, True]
    assert not torch.isfinite(x[0].sum())  # what a check on the row's sum would have flagged
