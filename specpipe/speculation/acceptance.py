"""What a draft node's chance of acceptance is, learned from this run's own verifies.

A drafter may report each node's confidence (`Proposer.node_conf`, in [0, 1]: EAGLE's draft probability of the
node given its parent, the n-gram trie's vote share times match length); the verifies say which nodes the target
accepted. Each (confidence bin, depth) cell counts, for nodes whose parent was accepted, how often the node was
too: its conditional acceptance. A node's path probability is the product along its path, so it never exceeds its
parent's and every top slice of a tree ordered by it is a tree again. The counts decay, so the estimates follow a
run whose text changes, and cells without recent data drift back to the prior, which lets a policy try nodes it
had given up on.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

CONF_BINS = 8  # confidence bins per depth
DEPTH_BINS = 4  # depths 1, 2, 3 and 4+
PRIOR = (1.0, 2.0)  # (accepted, seen) before any data: 0.5
DECAY = 0.99  # per observed step


class Acceptance:
    def __init__(self):
        self.accepted = np.zeros((CONF_BINS, DEPTH_BINS))
        self.seen = np.zeros((CONF_BINS, DEPTH_BINS))

    def cells(self, conf: Optional[np.ndarray], depth: np.ndarray, parent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(conf bin, depth bin) of every node [B, N]. A drafter that reports no confidence: its sibling rank
        stands in (the first child in the top bin), so siblings do not share one estimate."""
        if conf is None:
            c = CONF_BINS - 1 - np.minimum(sibling_rank(parent), CONF_BINS - 1)
        else:
            c = np.clip((conf * CONF_BINS).astype(np.int64), 0, CONF_BINS - 1)
        return c, np.clip(depth - 1, 0, DEPTH_BINS - 1)

    def rates(self) -> np.ndarray:
        """[CONF_BINS, DEPTH_BINS] estimated conditional acceptance."""
        return (self.accepted + PRIOR[0]) / (self.seen + PRIOR[1])

    def path_probs(self, parent: np.ndarray, depth: np.ndarray, conf: Optional[np.ndarray]) -> np.ndarray:
        """[B, N] estimated probability that each node is accepted (the root: 1, an unlinked node: 0)."""
        c, d = self.cells(conf, depth, parent)
        a = self.rates()[c, d]
        linked = parent >= 0
        p = np.zeros(parent.shape)
        p[:, 0] = 1.0
        rows = np.arange(parent.shape[0])[:, None]
        for level in range(1, int(depth.max(initial=0)) + 1):  # parents sit one level up: settled before
            at = linked & (depth == level)
            p = np.where(at, p[rows, np.maximum(parent, 0)] * a, p)
        return p

    def observe(self, parent: np.ndarray, depth: np.ndarray, conf: Optional[np.ndarray],
                accepted: np.ndarray) -> None:
        """Count, for every linked node whose parent was accepted, whether it was too (accepted [B, N] bool)."""
        self.accepted *= DECAY
        self.seen *= DECAY
        rows = np.arange(parent.shape[0])[:, None]
        tried = (parent >= 0) & accepted[rows, np.maximum(parent, 0)]
        c, d = self.cells(conf, depth, parent)
        np.add.at(self.seen, (c[tried], d[tried]), 1.0)
        np.add.at(self.accepted, (c[tried & accepted], d[tried & accepted]), 1.0)


def sibling_rank(parent: np.ndarray) -> np.ndarray:
    """[B, N] siblings before each node (0: its parent's first child), as `stages.verify.round_stats` counts them."""
    N = parent.shape[1]
    ar = np.arange(N)
    earlier = (parent[:, :, None] == parent[:, None, :]) & (ar[None, None, :] < ar[None, :, None])
    return earlier.sum(-1)


def accepted_nodes(parent: np.ndarray, depth: np.ndarray, counts: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """[B, N] bool: the nodes on each request's accepted path (the root included), rebuilt on the host from what
    the step reads back anyway (drafts accepted [B], the sibling rank accepted at each depth [B, S])."""
    B, N = parent.shape
    rank = sibling_rank(parent)
    acc = np.zeros((B, N), dtype=bool)
    acc[:, 0] = True
    rows = np.arange(B)[:, None]
    for level in range(1, ranks.shape[1] + 1):
        want = ranks[:, level - 1][:, None]
        on = (parent >= 0) & (depth == level) & (rank == want) & (counts[:, None] >= level)
        acc |= on & acc[rows, np.maximum(parent, 0)]
    return acc
