"""Cut a draft tree down to the nodes a policy keeps, on the host, and lay it out again.

`keep` [B, N] must be closed under ancestors (the policies keep top slices of a path-probability order). With
`compact`, kept nodes move to the front (their order, hence parents before children, unchanged) and the tree
narrows to the widest request's count: a request with nothing kept verifies its root alone, a one-token step
inside the same batched forward. Without it (speculation=static) the width stays and dropped nodes are unlinked.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from specpipe.stages.build_tree import Tree
from specpipe.stages.tree_layout import host_tree_from_parents


def host(t: torch.Tensor) -> np.ndarray:
    """A tree tensor as a numpy array (free for host tensors; on an accelerator this reads the device)."""
    return t.numpy() if t.device.type == "cpu" else t.cpu().numpy()


def trim(tree: Tree, keep: np.ndarray, L_t: torch.Tensor, max_depth: int, compact: bool, width: int = 0,
         draft_probs: Optional[torch.Tensor] = None, conf: Optional[np.ndarray] = None):
    """(the `Tree` of the kept nodes, draft_probs and conf in its node order). `width`: the least width to lay out
    (a compiled verify pads to its buckets)."""
    tokens, parent = host(tree.tokens), host(tree.parent)
    B, N = tokens.shape
    keep = keep & ((parent >= 0) | (np.arange(N) == 0))
    rows = np.arange(B)[:, None]
    if compact:
        Nv = min(N, max(int(keep.sum(1).max()), width))
        order = np.argsort(~keep, axis=1, kind="stable")[:, :Nv]  # kept first, in their order
    else:
        Nv, order = N, np.broadcast_to(np.arange(N), (B, N))
    kept = keep[rows, order]
    new_index = np.full((B, N), -1, dtype=np.int64)
    new_index[rows, order] = np.arange(Nv)
    old_parent = parent[rows, order]
    new_parent = np.where(kept & (old_parent >= 0), new_index[rows, np.maximum(old_parent, 0)], -1)
    new_tokens = np.where(kept, tokens[rows, order], tokens[:, :1])
    out = host_tree_from_parents(new_tokens, new_parent, L_t.cpu(), max_depth)
    dev = tree.tokens.device
    if dev.type != "cpu":
        out = Tree(*(t.to(dev) for t in (out.tokens, out.positions, out.mask, out.parent, out.depth,
                                         out.next_token, out.next_sibling, out.retrieve_index)))
    if draft_probs is not None:
        draft_probs = draft_probs.gather(1, torch.from_numpy(np.ascontiguousarray(order)).to(dev)[:, :, None]
                                         .expand(-1, -1, draft_probs.shape[-1]))
    return out, draft_probs, None if conf is None else conf[rows, order]
