"""Lay out a draft tree given only each node's token and local parent (the drafters' common tail, and the
speculation policies' trimmed trees).

Produces the same `Tree` as `stages.build_tree.BuildTree`, so every verifier consumes drafts from
EAGLE, n-gram lookup or a standalone model alike. Parents must precede their children (any
topological order works: the commit step only assumes a node at depth d has local index >= d).
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from specpipe.stages.build_tree import Tree


def tree_from_parents(tokens: Tensor, parent: Tensor, seq_lens: Tensor, max_depth: int) -> Tree:
    """tokens [B,N] (node 0 = root), parent [B,N] local parent (-1: root or unlinked), seq_lens [B].

    Nodes whose ancestor chain does not reach the root within max_depth are unlinked: parent -1,
    depth 0, they see only themselves and are never accepted.
    """
    B, N = tokens.shape
    dev = tokens.device
    ar = torch.arange(N, device=dev)
    eye = ar[:, None] == ar[None, :]
    # ancestors by doubling: anc holds every ancestor within h hops, h = 1, 2, 4, ... >= max_depth
    anc = ((parent[:, :, None] == ar) | eye).to(torch.float32)  # [B, N, N]
    for _ in range(max(1, max_depth - 1).bit_length()):
        anc = (torch.bmm(anc, anc) > 0).to(torch.float32)
    anc = anc > 0
    depth = anc.sum(-1) - 1
    reach = anc[:, :, 0] & (depth <= max_depth)  # the root within max_depth hops
    anc = anc & reach[:, :, None] | eye  # unlinked: self only
    depth = torch.where(reach, depth, torch.zeros_like(parent))
    parent = torch.where(reach, parent, torch.full_like(parent, -1))
    child = parent[:, None, :] == ar[None, :, None]  # [B, p, j]
    big = torch.full((), N, device=dev)
    first = torch.where(child, ar, big).min(-1).values
    sib = (parent[:, :, None] == parent[:, None, :]) & (ar[None, None, :] > ar[None, :, None]) \
        & (parent[:, :, None] >= 0)
    nsib = torch.where(sib, ar, big).min(-1).values
    none = torch.full_like(first, -1)
    return Tree(tokens=tokens, positions=seq_lens[:, None] + depth, mask=anc, parent=parent, depth=depth,
                next_token=torch.where(first < N, first, none), next_sibling=torch.where(nsib < N, nsib, none),
                retrieve_index=torch.arange(B, device=dev)[:, None] * N + ar)


def root_only_tree(tokens: Tensor, seq_lens: Tensor) -> Tree:
    """`tree_from_parents(tokens, all -1, seq_lens, ...)` without its ancestor products: node 0 of each row the root,
    any others unlinked padding (a plain step through the verify). A step that does not draft builds it, so it is
    built in a few fills (~80 µs, against ~225 µs on CPU)."""
    B, N = tokens.shape
    dev = tokens.device
    ar = torch.arange(N, device=dev)
    unlinked = torch.full((B, N), -1, dtype=torch.long, device=dev)
    return Tree(tokens=tokens, positions=seq_lens[:, None].repeat(1, N),
                mask=torch.eye(N, dtype=torch.bool, device=dev).repeat(B, 1, 1), parent=unlinked,
                depth=torch.zeros((B, N), dtype=torch.long, device=dev), next_token=unlinked.clone(),
                next_sibling=unlinked.clone(), retrieve_index=torch.arange(B, device=dev)[:, None] * N + ar)


def host_tree_from_parents(tokens: np.ndarray, parent: np.ndarray, seq_lens: Tensor, max_depth: int) -> Tree:
    """`tree_from_parents` on host arrays (numpy: no op dispatches); the `Tree`'s tensors share their memory."""
    B, N = tokens.shape
    ar = np.arange(N)
    eye = ar[:, None] == ar[None, :]
    anc = (parent[:, :, None] == ar) | eye  # [B, N, N]
    for _ in range(max(1, max_depth - 1).bit_length()):
        anc = np.matmul(anc.astype(np.float32), anc.astype(np.float32)) > 0
    depth = anc.sum(-1) - 1
    reach = anc[:, :, 0] & (depth <= max_depth)
    anc = anc & reach[:, :, None] | eye
    depth = np.where(reach, depth, 0).astype(np.int64)
    parent = np.where(reach, parent, -1)
    next_token, next_sibling = host_links(parent)
    t = torch.from_numpy
    return Tree(tokens=t(tokens), positions=seq_lens[:, None] + t(depth), mask=t(anc), parent=t(parent),
                depth=t(depth), next_token=t(next_token), next_sibling=t(next_sibling),
                retrieve_index=t(np.arange(B)[:, None] * N + ar))


def host_links(parent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each node's first child and next sibling [B, N] (-1: none) from its local parent (host arrays)."""
    N = parent.shape[1]
    ar = np.arange(N)
    first = np.where(parent[:, None, :] == ar[None, :, None], ar, N).min(-1)
    sib = (parent[:, :, None] == parent[:, None, :]) & (ar[None, None, :] > ar[None, :, None]) \
        & (parent[:, :, None] >= 0)
    nsib = np.where(sib, ar, N).min(-1)
    return np.where(first < N, first, -1).astype(np.int64), np.where(nsib < N, nsib, -1).astype(np.int64)


def host(t: Tensor) -> np.ndarray:
    """A tree tensor as a numpy array (free for host tensors; on an accelerator this reads the device)."""
    return t.numpy() if t.device.type == "cpu" else t.cpu().numpy()
