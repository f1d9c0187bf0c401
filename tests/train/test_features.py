"""The feature budget spends itself on the target's own continuations first."""
from __future__ import annotations

import random

from specpipe.train.data import Seq
from specpipe.train.features import batches_first_own, group, windows


def _seqs(n: int, origin: str, rng: random.Random) -> list:
    return [Seq([rng.randrange(1000) for _ in range(rng.randrange(20, 300))], 0, origin) for _ in range(n)]


def test_distilled_windows_come_before_the_corpus_and_none_is_lost():
    """A budget that stops after the first batches keeps every self-distilled window (they cost a decode each),
    and the batches hold exactly the windows of all the data."""
    rng = random.Random(0)
    own = _seqs(20, "greedy", rng) + _seqs(20, "sampled", rng)
    corpus = _seqs(200, "corpus", rng)
    seqs = corpus[:100] + own + corpus[100:]
    batches = batches_first_own(seqs, 128, 512, seed=3)
    own_ids = {tuple(w) for w, _ in windows(own, 128)}
    kinds = [all(tuple(w) in own_ids for w, _ in b) for b in batches]
    first = kinds.index(False)
    assert first > 0 and all(kinds[:first]) and not any(kinds[first:])
    assert sum(len(b) for b in batches[:first]) == len(own_ids)
    every = sorted(tuple(w) for b in batches for w, _ in b)
    assert every == sorted(tuple(w) for w, _ in windows(seqs, 128))
    shuffled = group(windows(seqs, 128), 512, seed=3)  # (what the budget kept before: own windows spread out)
    assert not all(all(tuple(w) in own_ids for w, _ in b) for b in shuffled[:first])


def test_a_window_before_a_long_prompts_continuation_is_left_out():
    """Labels start at the prompt's last position; the windows wholly before it teach nothing (a batch of only
    such windows, which distilled-first order made likely, had no loss to step on)."""
    long = Seq(list(range(700)), 600, "greedy")
    wins = windows([long], 256)
    assert [(len(w), first) for w, first in wins] == [(188, 88)]
    assert all(first < len(w) for w, first in windows([long, Seq(list(range(50)), 0)], 16))
