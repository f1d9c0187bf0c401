"""`NgramDrafter.propose` in numpy, for token histories that live in host memory.

The torch version is some 250 small ops per step; on the host each costs a dispatch (~4 µs at batch 1), so
matching took 1.1 ms of a 12 ms step on the shipped pair. The same arithmetic in numpy takes a fraction of
that. It is a port, not a variant: the same scores, votes and tie-breaks give the same `Tree`
(tests/drafters/test_ngram_host.py compares the two on random histories). Where the history lives on an
accelerator the torch version runs there instead (`Device.host_memory`).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from specpipe.drafters.ngram_trie import SEP, NgramDrafter


def match_lengths(context: np.ndarray, lengths: np.ndarray, max_n: int) -> np.ndarray:
    """[B, L] uint8: for each continuation start c, how many (<= max_n) tokens before c equal the tail."""
    B, L = context.shape
    rows = np.arange(B)
    run = np.ones((B, L), dtype=bool)
    n = np.zeros((B, L), dtype=np.uint8)
    for t in range(min(max_n, L - 1)):
        s = lengths - 1 - t
        tail = context[rows, np.maximum(s, 0)][:, None]  # [B, 1]
        eq = (context[:, : L - 1 - t] == tail) & ((s >= 0)[:, None] & (tail != SEP))
        shifted = np.zeros((B, L), dtype=bool)
        shifted[:, t + 1:] = run[:, t + 1:] & eq
        run = shifted
        n += run
    return n


def candidates(d: NgramDrafter, context: np.ndarray, lengths: np.ndarray):
    """`NgramDrafter.candidates`: windows [B, M, S], their lengths [B, M], match lengths [B, M]."""
    B, L = context.shape
    S, M = d.S, d.M
    r = np.arange(B)[:, None]  # fancy indexing by row: take_along_axis builds its index grids per call (~20 µs)
    pos = np.arange(L, dtype=np.int64)
    ok = (pos >= 1)[None, :] & (pos[None, :] < lengths[:, None]) & (context != SEP)
    n = match_lengths(context, lengths, d.max_n)
    n = n * (ok & (n >= d.min_n))
    score = n.astype(np.int64) * (L + 1) + pos  # distinct per position: the order below is unique
    k = min(L, M)
    c = np.argpartition(-score, k - 1, axis=1)[:, :k] if k < L else np.broadcast_to(pos, (B, L)).copy()
    top = score[r, c]
    order = np.argsort(-top, axis=1, kind="stable")
    top, c = top[r, order], c[r, order]
    if k < M:
        top = np.concatenate([top, np.zeros((B, M - k), np.int64)], 1)
        c = np.concatenate([c, np.zeros((B, M - k), np.int64)], 1)
    cval = top > L
    t = np.arange(S)
    idx = c[:, :, None] + t  # [B, M, S]
    wlen = np.where(cval, np.minimum(lengths[:, None] - c, S), 0)
    inside = t < wlen[:, :, None]
    win = np.where(inside, context[r[:, :, None], np.minimum(idx, L - 1)], SEP)
    inside = np.cumprod(win != SEP, axis=-1, dtype=np.int64)  # a continuation ends at its segment's separator
    win = np.where(inside > 0, win, SEP)
    return win, inside.sum(-1), np.where(cval, top // (L + 1), 0)


def propose(d: NgramDrafter, context: np.ndarray, lengths: np.ndarray,
            corpus: Optional[np.ndarray] = None) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [B, N], local parents [B, N]) of `NgramDrafter.propose` for the same inputs, as int64 arrays."""
    B = context.shape[0]
    context = context.astype(np.int32, copy=False)
    lengths = np.asarray(lengths, dtype=np.int64)
    if corpus is not None and corpus.size:
        corpus = corpus.astype(np.int32, copy=False)
        context = np.concatenate([np.broadcast_to(corpus, (B, corpus.shape[-1])), context], 1)
        lengths = lengths + corpus.shape[-1]
    S, N, M = d.S, d.N, d.M
    win, wlen, n = candidates(d, context, lengths)
    t = np.arange(S)
    valid = t < wlen[:, :, None]
    same = (np.cumprod(win[:, :, None, :] == win[:, None, :, :], axis=-1, dtype=np.int64).astype(bool)
            & valid[:, :, None, :] & valid[:, None, :, :])  # [B, M, M, S]
    canon = same.argmax(2)  # [B, M, S] best-ranked match through this node
    mm = np.arange(M)
    own = valid & (canon == mm[None, :, None])
    votes = np.left_shift(np.int64(1), np.minimum(n, 30)) * (wlen > 0)  # [B, M]
    count = (same * votes[:, None, :, None]).sum(2)  # [B, M, S]
    order = (M * S) - (mm[:, None] * S + t[None, :])
    key = np.where(own, count * (M * S + 1) + order, -1).reshape(B, M * S)
    pick = np.argsort(-key, axis=1, kind="stable")[:, : N - 1]  # the N-1 best, parents before children
    r = np.arange(B)[:, None]
    top = key[r, pick]
    picked = top >= 0
    local = np.full((B, M * S + 1), -1, dtype=np.int64)
    local[r, np.where(picked, pick, M * S)] = np.arange(1, N)
    local[:, M * S] = -1
    pm, pt = pick // S, pick % S
    prev = np.maximum(pt - 1, 0)
    up = canon[r, pm, prev]  # the parent node's canonical match
    par = np.where(pt > 0, local[r, up * S + prev], 0)
    root = context[r[:, 0], np.maximum(lengths - 1, 0)][:, None].astype(np.int64)
    tok = win.reshape(B, M * S)[r, pick]
    tokens = np.concatenate([root, np.where(picked, tok, root)], 1).astype(np.int64)
    parent = np.concatenate([np.full((B, 1), -1, np.int64), np.where(picked, par, -1)], 1)
    d.node_conf = node_confidence(d, count, votes, n, pick, pm, pt, up, picked)
    return tokens, parent


def node_confidence(d: NgramDrafter, count, votes, n, pick, pm, pt, up, picked) -> np.ndarray:
    """[B, N] each node's share of its parent's votes, times how long its best match is (n / max_n): what the
    speculation policies learn acceptance by. The root 1, unpicked nodes 0."""
    B, M, S = count.shape
    r = np.arange(B)[:, None]
    mine = count.reshape(B, M * S)[r, pick]
    above = np.where(pt > 0, count[r, up, np.maximum(pt - 1, 0)], votes.sum(1, keepdims=True))
    share = mine / np.maximum(above, 1)
    conf = np.where(picked, np.minimum(share, 1.0) * n[r, pm] / d.max_n, 0.0)
    return np.concatenate([np.ones((B, 1)), conf], 1)
