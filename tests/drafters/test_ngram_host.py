"""The numpy n-gram drafter (host-memory devices) is a port of the torch one: for the same history, corpus and
settings it gives the same tree, field for field, and the proposer's two paths draft alike in a real run."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from specpipe.drafters import ngram_host
from specpipe.drafters.ngram_trie import SEP, NgramDrafter, pack_histories
from specpipe.stages.tree_layout import host_tree_from_parents, tree_from_parents

FIELDS = ("tokens", "positions", "mask", "parent", "depth", "next_token", "next_sibling", "retrieve_index")


def assert_same_tree(a, b):
    for f in FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype and x.shape == y.shape, f
        assert torch.equal(x, y), (f, x, y)


@st.composite
def cases(draw):
    topk = draw(st.integers(1, 4))
    steps = draw(st.integers(1, 6))
    n_tokens = draw(st.integers(2, 1 + topk * steps))
    max_n = draw(st.integers(1, 4))
    min_n = draw(st.integers(1, max_n))
    vocab = draw(st.integers(2, 6))  # few symbols: many matches, ties and shared prefixes
    histories = draw(st.lists(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=40), min_size=1, max_size=4))
    corpus = draw(st.none() | st.lists(st.integers(-1, vocab - 1), max_size=30))
    per_row = draw(st.booleans())
    return topk, steps, n_tokens, min_n, max_n, histories, corpus, per_row


@settings(max_examples=300, deadline=None)
@given(cases())
def test_the_numpy_drafter_gives_the_torch_drafters_tree(case):
    topk, steps, n_tokens, min_n, max_n, histories, corpus, per_row = case
    d = NgramDrafter(steps, topk, n_tokens, min_n, max_n)
    ctx, lens = pack_histories(histories)
    seq_lens = lens + 5
    c_t = c_np = None
    if corpus is not None:
        c = torch.tensor(corpus + [SEP], dtype=torch.int32)
        if per_row:  # one corpus per request, as the running requests' histories give
            c = torch.stack([c.roll(i) for i in range(len(histories))])
        c_t, c_np = c, c.numpy()
    want = d.propose(ctx, lens, seq_lens, c_t)
    tokens, parent = ngram_host.propose(d, ctx.numpy(), lens.numpy(), c_np)
    assert_same_tree(host_tree_from_parents(tokens, parent, seq_lens, steps), want)


def test_unreachable_nodes_are_unlinked_as_in_torch():
    """Parents past max_depth, or chains that never reach the root: the host layout unlinks them alike."""
    tokens = torch.arange(6)[None].repeat(2, 1)
    parent = torch.tensor([[-1, 0, 1, 2, 3, -1], [-1, 0, 0, 5, 3, 4]])
    seq = torch.tensor([7, 9])
    want = tree_from_parents(tokens, parent, seq, 3)
    assert_same_tree(host_tree_from_parents(tokens.numpy(), parent.numpy(), seq, 3), want)
    assert want.parent[0, 4] == -1 and want.parent[1, 3] == -1  # (what is compared is not vacuous)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_a_run_drafts_the_same_on_either_path(monkeypatch, tmp_path, method):
    from helpers import compose, random_prompts, write_prompts
    from specpipe.run import run
    from specpipe.devices.cpu import CpuDevice

    path = write_prompts(tmp_path / "p.jsonl", random_prompts(3, [60, 90, 30, 75]))
    over = ("model=random_tiny", f"draft={method}", f"workload.prompts_file={path}", "workload.batch_size=3",
            "workload.max_new_tokens=24", "speculation=static")  # (drafts every step on either path)
    calls = []
    real = ngram_host.propose
    monkeypatch.setattr(ngram_host, "propose", lambda *a: calls.append(1) or real(*a))
    host = run(compose(*over), quiet=True)["metrics"]
    assert len(calls) == host["num_verify_steps"]  # the numpy path drafted every step on the CPU
    monkeypatch.setattr(CpuDevice, "host_memory", False)
    dev = run(compose(*over), quiet=True)["metrics"]
    assert len(calls) == host["num_verify_steps"]  # and none with the torch path
    assert (host["accept_length_mean"] == dev["accept_length_mean"]
            and host["num_verify_steps"] == dev["num_verify_steps"])
    assert host["acceptance_rate_per_position"] == dev["acceptance_rate_per_position"]


def test_the_running_corpus_is_built_alike_on_the_host():
    from specpipe.drafters.ngram import NgramProposer

    prop = NgramProposer(4, 3, 9, 1, 3, max_requests=3, max_context=16, device="cpu", running_tokens=12)
    ctx = torch.tensor([[10, 11, 12, 13, 14, 15, 0], [20, 21, 22, 0, 0, 0, 0], [30, 31, 32, 33, 34, 35, 36]])
    L = np.array([5, 2, 6])
    cache = torch.tensor([7, 8, SEP], dtype=torch.int32)
    for c in (None, cache):
        want = prop.running_corpus(ctx, L, c)
        got = prop.running_corpus_host(ctx.numpy(), L, None if c is None else c.numpy())
        assert got.dtype == np.int32 and got.tolist() == want.tolist()
