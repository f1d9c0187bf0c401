"""The multi-step training forward is the head's own drafting: step 0 equals the module's forward, and step j at
position p equals the j-th draft step of a chain started at p through the head's KV pool (as specpipe drafts)."""
from __future__ import annotations

import pytest
import torch

from specpipe.models.attention_batch import extend_batch
from specpipe.models.eagle3 import Eagle3Head
from specpipe.models.random_tiny import build_random_tiny
from specpipe.train.heads import new_head
from specpipe.train.ttt import soft_ce, to_draft_ids, ttt_forward

L, STEPS = 12, 4


class Head:
    def __init__(self, kind, **more):
        self.kind, self.aux_layers, self.norm_before_residual = kind, None, False
        self.__dict__.update(more)


@pytest.fixture(scope="module")
def target():
    return build_random_tiny(num_layers=4, hidden_size=64).target.eval().requires_grad_(False)


def make(kind, target, **more):
    ids = torch.arange(0, target.config.vocab_size, 3)  # a draft vocabulary of every third token
    return new_head(Head(kind, **more), target, ids, seed=1).eval()


def inputs(head, target, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.config.vocab_size, (2, L), generator=g)
    if isinstance(head, Eagle3Head):
        return ids, target(ids, aux_layers=head.aux_layers)[1]
    return ids, target(ids)


def chain(head, ids, feats, p, steps):
    """Draft `steps` tokens from position p through the head's KV pool: true features up to p, then its own."""
    head.setup_kv(L + steps + 2, torch.float32)
    table, rows = torch.arange(1, L + steps + 2)[None], torch.zeros(1, dtype=torch.long)

    def batch(start, q):
        return extend_batch(table, rows, torch.tensor([start]), torch.tensor([q]), q, start + q)
    d = head(ids[:1, 1:p + 2], feats[:1, :p + 1], batch(0, p + 1), own_hidden=False)[:, -1:]
    outs = [d]
    for j in range(1, steps):
        d = head(ids[:1, p + 1 + j:p + 2 + j], d, batch(p + j, 1), own_hidden=True)
        outs.append(d)
    head.kv = None
    return outs


@pytest.mark.parametrize("kind,more", [("eagle3", {}), ("eagle3", {"norm_before_residual": True}), ("eagle1", {})])
@torch.no_grad()
def test_training_steps_are_the_drafting_steps(target, kind, more):
    head = make(kind, target, **more)
    ids, feats = inputs(head, target)
    outs = ttt_forward(head, ids, feats, STEPS)
    plain = head(ids[:, 1:], feats[:, :-1])  # step 0: the module's forward with batch=None
    torch.testing.assert_close(outs[0][:, :-1], plain, rtol=1e-5, atol=1e-5)
    for p in (0, 3, L - 1 - STEPS):
        ref = chain(head, ids, feats, p, STEPS)
        for j in range(STEPS):
            torch.testing.assert_close(outs[j][0, p], ref[j][0, 0], rtol=1e-4, atol=1e-5, msg=f"step {j} at {p}")


def test_soft_labels_outside_the_draft_vocabulary_are_dropped(target):
    head = make("eagle3", target)
    top = torch.tensor([[0, 1, 3]])  # 1 is not in the draft vocabulary (every third id)
    draft = to_draft_ids(head, top)
    assert draft.tolist() == [[0, -1, 1]]
    assert torch.equal(head.to_target(draft[draft >= 0]), torch.tensor([0, 3]))
    logits = torch.full((1, head.draft_vocab_size), -30.0)
    logits[0, 0] = logits[0, 1] = 0.0  # the draft's mass on target ids 0 and 3, equally
    lp = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    want = -(0.5 / 0.7 * torch.log(torch.tensor(0.5)) + 0.2 / 0.7 * torch.log(torch.tensor(0.5)))
    torch.testing.assert_close(soft_ce(logits, lp, draft)[0], want, rtol=1e-4, atol=1e-4)


def test_simulated_decode_walks_round_by_round():
    """Each round drafts from where the last one ended: accepted drafts + the target's bonus token further on."""
    from specpipe.train.evaluate import walk

    S, L = 3, 12
    labelled = torch.zeros(L, dtype=torch.bool)
    labelled[2:] = True  # the continuation: the target's distributions from index 2 on are labels
    lab = torch.stack([torch.cat([labelled[1 + j:], torch.zeros(1 + j, dtype=torch.bool)]) for j in range(S)])
    hit = torch.zeros(S, L, dtype=torch.bool)
    hit[:, 2] = True  # the first round (p=2) accepts its 3 drafts -> the next one drafts from p=6
    hit[0, 6] = True  # accepts 1 -> p=8; then 8, 9 and 10 accept none (p=11 has no label left)
    assert walk(hit, lab, 3) == [3, 1, 0, 0, 0]
    assert walk(hit, lab, 1) == [1, 0, 0, 1, 0, 0, 0]
