"""What a draft node's chance of acceptance is, learned from this run's own verifies.

A drafter may report each node's confidence (`Proposer.node_conf`, in [0, 1]: EAGLE's draft probability of the
node given its parent, the n-gram trie's vote share times match length); the verifies say which nodes the target
accepted. Each (confidence bin, depth) cell counts, for nodes whose parent was accepted, how often the node was
too: its conditional acceptance. A node's path probability is the product along its path, so it never exceeds its
parent's and every top slice of a tree ordered by it is a tree again. The counts decay, so the estimates follow a
run whose text changes, and cells without recent data drift back to the prior, which lets a policy try nodes it
had given up on.

The prior is 0.5, worth one observation, unless the drafter's confidence is its own probability of the token
(`Proposer.conf_is_probability`: EAGLE's draft probability): then each cell starts at its bin's centre. With 0.5
everywhere, a weak head's probes verified its unlikely nodes as if each had an even chance: `cost` paused a
SmolLM2 head that accepts 0.3 tokens a round, yet its probes at batch 4 verified up to 7 tokens a request (181 ms
against a plain step's 80). A confident node still starts optimistic, so what a head is sure of is still tried.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

CONF_BINS = 8  # confidence bins per depth
DEPTH_BINS = 4  # depths 1, 2, 3 and 4+
PRIOR = (0.5, 1.0)  # (accepted, seen) before any data: 0.5, worth one observation (it is left fast)
DECAY = 0.99  # per observed step


class Acceptance:
    def __init__(self):
        self.accepted = np.zeros((CONF_BINS, DEPTH_BINS))
        self.seen = np.zeros((CONF_BINS, DEPTH_BINS))
        self.prior = np.full((CONF_BINS, DEPTH_BINS), PRIOR[0])  # [conf bin, depth bin] before any data

    def prior_from_conf(self) -> None:
        """Start each cell at its confidence bin's centre: the drafter's confidence is a probability."""
        self.prior[:] = ((np.arange(CONF_BINS) + 0.5) / CONF_BINS)[:, None]

    def cells(self, conf: Optional[np.ndarray], depth: np.ndarray, parent: np.ndarray,
              rank: Optional[np.ndarray] = None) -> tuple[np.ndarray, np.ndarray]:
        """(conf bin, depth bin) of every node [B, N]. A drafter that reports no confidence: its sibling rank
        stands in (the first child in the top bin), so siblings do not share one estimate."""
        if conf is None:
            rank = sibling_rank(parent) if rank is None else rank
            c = CONF_BINS - 1 - np.minimum(rank, CONF_BINS - 1)
        else:
            c = np.clip((conf * CONF_BINS).astype(np.int64), 0, CONF_BINS - 1)
        return c, np.clip(depth - 1, 0, DEPTH_BINS - 1)

    def rates(self) -> np.ndarray:
        """[CONF_BINS, DEPTH_BINS] estimated conditional acceptance."""
        return (self.accepted + self.prior * PRIOR[1]) / (self.seen + PRIOR[1])

    def path_probs(self, parent: np.ndarray, depth: np.ndarray, mask: np.ndarray, conf: Optional[np.ndarray],
                   rank: Optional[np.ndarray] = None) -> np.ndarray:
        """[B, N] estimated probability that each node is accepted (the root: 1, an unlinked node: 0): the product
        of the conditional estimates over its path (mask [B, N, N]: node j sees its ancestors and itself)."""
        c, d = self.cells(conf, depth, parent, rank)
        log_a = np.where(parent >= 0, np.log(self.rates()[c, d]), 0.0)  # [B, N], the root's factor 1
        p = np.exp(np.matmul(mask.astype(np.float64), log_a[:, :, None])[:, :, 0])
        return np.where((parent >= 0) | (np.arange(parent.shape[1]) == 0), p, 0.0)

    def observe(self, parent: np.ndarray, depth: np.ndarray, conf: Optional[np.ndarray], accepted: np.ndarray,
                rank: Optional[np.ndarray] = None) -> None:
        """Count, for every linked node whose parent was accepted, whether it was too (accepted [B, N] bool)."""
        self.accepted *= DECAY
        self.seen *= DECAY
        rows = np.arange(parent.shape[0])[:, None]
        tried = (parent >= 0) & accepted[rows, np.maximum(parent, 0)]
        c, d = self.cells(conf, depth, parent, rank)
        np.add.at(self.seen, (c[tried], d[tried]), 1.0)
        np.add.at(self.accepted, (c[tried & accepted], d[tried & accepted]), 1.0)


def sibling_rank(parent: np.ndarray) -> np.ndarray:
    """[B, N] siblings before each node (0: its parent's first child), as `stages.verify.round_stats` counts them."""
    N = parent.shape[1]
    ar = np.arange(N)
    earlier = (parent[:, :, None] == parent[:, None, :]) & (ar[None, None, :] < ar[None, :, None])
    return earlier.sum(-1)


def accepted_nodes(mask: np.ndarray, depth: np.ndarray, rank: np.ndarray, counts: np.ndarray,
                   ranks: np.ndarray) -> np.ndarray:
    """[B, N] bool: the nodes on each request's accepted path (the root included), rebuilt on the host from what
    the step reads back anyway (drafts accepted [B], the sibling rank accepted at each depth [B, S]): a node is on
    it when it and every ancestor sit at an accepted depth with the rank accepted there."""
    S = ranks.shape[1]
    want = np.take_along_axis(ranks, np.clip(depth - 1, 0, S - 1), 1)  # [B, N] the rank accepted at its depth
    ok = ((rank == want) & (depth >= 1) & (depth <= np.minimum(counts, S)[:, None])) | (depth == 0)
    return ~(mask & ~ok[:, None, :]).any(-1) & mask[:, :, 0]
