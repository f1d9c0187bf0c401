"""Cut a draft tree down to the nodes a policy keeps, on the host, and lay it out again.

`keep` [B, N] must be closed under ancestors (the policies keep top slices of a path-probability order). With
`compact`, kept nodes move to the front (their order, hence parents before children, unchanged) and the tree
narrows to the widest request's count: a request with nothing kept verifies its root alone, a one-token step
inside the same batched forward. Without it (speculation=static) the width stays and dropped nodes are unlinked.
Ancestry is read off the old tree's mask, never recomputed: a few gathers over [B, N, N] booleans.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from specpipe.speculation.acceptance import sibling_rank
from specpipe.stages.build_tree import Tree
from specpipe.stages.tree_layout import host, host_links


@dataclass
class HostTree:
    """What the policies read of a tree, as host arrays [B, N] (mask [B, N, N])."""
    parent: np.ndarray
    depth: np.ndarray
    mask: np.ndarray
    rank: np.ndarray  # earlier siblings of each node
    tokens: Optional[np.ndarray] = None  # the draft tokens, where they were read with the rest (`trim` lays them out)

    @classmethod
    def of(cls, tree: Tree) -> "HostTree":
        """The tree's parent, depth, mask and tokens in one read (on an accelerator each read is a sync)."""
        B, N = tree.parent.shape
        flat = host(torch.cat([tree.parent.long(), tree.depth.long(), tree.tokens.long(),
                               tree.mask.reshape(B, N * N).long()], 1))  # [B, 3N + N*N]
        parent = flat[:, :N]
        return cls(parent, flat[:, N:2 * N], flat[:, 3 * N:].reshape(B, N, N).astype(bool), sibling_rank(parent),
                   flat[:, 2 * N:3 * N])


def trim(tree: Tree, ht: HostTree, keep: np.ndarray, L_t: torch.Tensor, compact: bool, width: int = 0,
         draft_probs: Optional[torch.Tensor] = None, conf: Optional[np.ndarray] = None):
    """(the `Tree` of the kept nodes, its `HostTree`, draft_probs and conf in its node order). `width`: the least
    width to lay out (a compiled verify pads to its buckets)."""
    tokens = ht.tokens if ht.tokens is not None else host(tree.tokens)
    B, N = tokens.shape
    ar = np.arange(N)
    keep = keep & ((ht.parent >= 0) | (ar == 0))
    rows = np.arange(B)[:, None]
    if compact:
        Nv = min(N, max(int(keep.sum(1).max()), width))
        order = np.argsort(~keep, axis=1, kind="stable")[:, :Nv]  # kept first, in their order
    else:
        Nv, order = N, np.broadcast_to(ar, (B, N))
    kept = keep[rows, order]  # [B, Nv]
    new_index = np.full((B, N), -1, dtype=np.int64)
    new_index[rows, order] = np.arange(Nv)
    old_parent = ht.parent[rows, order]
    parent = np.where(kept & (old_parent >= 0), new_index[rows, np.maximum(old_parent, 0)], -1)
    eye = np.eye(Nv, dtype=bool)
    mask = (ht.mask[rows[:, :, None], order[:, :, None], order[:, None, :]] & kept[:, :, None] & kept[:, None, :]) | eye
    depth = np.where(kept, ht.depth[rows, order], 0)
    nxt, nsib = host_links(parent)
    t = torch.from_numpy
    dev = tree.tokens.device
    out = Tree(tokens=t(np.where(kept, tokens[rows, order], tokens[:, :1])), positions=None, mask=t(mask),
               parent=t(parent), depth=t(depth), next_token=t(nxt), next_sibling=t(nsib),
               retrieve_index=t(rows * Nv + np.arange(Nv)))
    if dev.type != "cpu":
        out = Tree(*(x.to(dev) if x is not None else None for x in (
            out.tokens, None, out.mask, out.parent, out.depth, out.next_token, out.next_sibling, out.retrieve_index)))
    out.positions = L_t[:, None] + out.depth
    if draft_probs is not None:
        draft_probs = draft_probs.gather(1, t(np.ascontiguousarray(order)).to(dev)[:, :, None]
                                         .expand(-1, -1, draft_probs.shape[-1]))
    return out, HostTree(parent, depth, mask, sibling_rank(parent)), draft_probs, \
        None if conf is None else conf[rows, order]
