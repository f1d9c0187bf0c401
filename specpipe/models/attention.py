"""Slot-pool attention: the KV pool (full pool + optional window pool) and the attention module.

Sliding-window layers may keep their K/V in a smaller *window pool* (allocator=swa): the engine
hands out full-pool slots, ``PrepareDecode.decorate`` adds their window-pool translations to the
:class:`AttentionBatch`, and a layer whose pool storage is window-sized reads and writes only
those. Whether a layer is windowed is decided by the pool it was given, not by the config alone:
a draft model sharing the target's config keeps a full-size pool and reads full slots.

Optional top-k sparse attention (``sparse_top_k``, target models only): see :func:`sparse_select`.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specpipe.models.attention_batch import AttentionBatch, pack_group_mask, sdpa_mask
from specpipe.models.norm import RMSNorm


class KVPool:
    """K/V storage, one tensor pair per layer: full layers [S, Hkv, D] indexed by full slots; window layers
    (only when ``window_slots`` is given) [Sw, Hkv, D] indexed by window-pool slots.

    Every layer owns its storage (not a view of one stacked tensor): a compiled forward that writes a
    view of a shared base is functionalized into copies of the whole base, per layer and per call, and
    ran ~10x slower than eager on CPU; separate tensors are updated in place."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu",
                 window_slots: Optional[int] = None, window_layers: Sequence[int] = (),
                 track_selection: bool = False):
        win = set(window_layers) if window_slots is not None else set()
        self.windowed = [i in win for i in range(num_layers)]
        self._num_slots, self._window_slots = num_slots, window_slots or 0

        def zeros(slots: int) -> Tensor:
            return torch.zeros((slots, num_kv_heads, head_dim), dtype=dtype, device=device)

        self.keys = [zeros(self._window_slots if w else num_slots) for w in self.windowed]
        self.values = [zeros(self._window_slots if w else num_slots) for w in self.windowed]
        self.dtype = dtype
        # slot 0 is zeroed through this index: `ks[0].zero_()` in a compiled forward became a pass over the whole
        # pool (a slice of a graph input written back), per layer and per call
        self.null_slot = torch.zeros(1, dtype=torch.int64, device=device)
        self.track_selection = track_selection  # report sparse selections to batch.observe (hisparse)
        self.token_bytes = 2 * num_kv_heads * head_dim * self.keys[0].element_size()  # K+V of one token, one layer

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def window_slots(self) -> int:
        return self._window_slots

    @property
    def nbytes(self) -> int:
        """Bytes of K/V storage (every layer's, window-pool layers at their smaller size)."""
        return sum(t.nbytes for t in (*self.keys, *self.values))

    @property
    def has_window(self) -> bool:
        return any(self.windowed)

    def layer(self, i: int) -> tuple[Tensor, Tensor]:
        """(K, V) storage of layer i: [S or Sw, Hkv, D] each."""
        return self.keys[i], self.values[i]

    def move(self, tgt: Tensor, src: Tensor, window_tgt: Optional[Tensor] = None,
             window_src: Optional[Tensor] = None) -> None:
        """Copy K/V from slots ``src`` to ``tgt`` (both [n] int64); window layers use the translated pair."""
        if self.has_window and (window_tgt is None or window_src is None):
            raise ValueError("this pool has window-pool layers: pass window_tgt/window_src "
                             "(the slots translated by the SWA allocator)")
        for w, k, v in zip(self.windowed, self.keys, self.values):
            t, s = (window_tgt, window_src) if w else (tgt, src)
            # index_select/index_copy_: advanced indexing (k[t] = k[s]) goes through the slower index_put path
            k.index_copy_(0, t, k.index_select(0, s))
            v.index_copy_(0, t, v.index_select(0, s))


def fused_linear(parts: list) -> nn.Linear:
    """One Linear computing `parts` (Linears over the same input) side by side: their outputs concatenated.

    Inference only (`fuse_projections`): fewer, wider GEMMs; the outputs are bitwise those of the parts on
    the CPU BLAS this was measured on. The parts keep their parameters, re-pointed at row slices of the fused
    weight (`refresh_fused_views`), so no memory is duplicated and checkpoints still save by their names.
    """
    w = torch.cat([p.weight.detach() for p in parts])
    has_bias = parts[0].bias is not None
    fused = nn.Linear(w.shape[1], w.shape[0], bias=has_bias, device="meta", dtype=w.dtype)  # no init pass
    fused.weight = nn.Parameter(w, requires_grad=False)
    if has_bias:
        fused.bias = nn.Parameter(torch.cat([p.bias.detach() for p in parts]), requires_grad=False)
    fused.fused_parts = list(parts)
    refresh_fused_views(fused)
    return fused


def refresh_fused_views(fused: nn.Linear) -> None:
    """Point each part's weight (and bias) at its rows of the fused ones (after a layout change too)."""
    a = 0
    with torch.no_grad():
        for p in fused.fused_parts:
            n = p.weight.shape[0]
            p.weight.data = fused.weight.data[a:a + n]
            if p.bias is not None:
                p.bias.data = fused.bias.data[a:a + n]
            a += n


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def sparse_select(q: Tensor, keys: Tensor, mask: Tensor, positions: Tensor, kv_positions: Tensor,
                  top_k: int, local: int) -> Tensor:
    """The keys each query attends to under top-k sparse attention ([B, Q, Lkv] bool, within ``mask``).

    q [B, Q, H, D], keys [B, Lkv, Hkv, D] (after RoPE). A query at position p always keeps the
    visible keys at positions (p - local, p] (itself, its tree ancestors while the tree is shallower
    than ``local``, and the newest tokens, like NSA's sliding branch); among older visible keys it
    keeps the ``top_k`` with the highest indexer score, the mean over query heads of q·k (one
    [B, Q, Lkv] matmul after averaging each GQA group's queries). The rule depends only on
    positions and committed KV, so plain decode and tree verify select the same keys (lossless),
    and with top_k >= the visible keys it returns ``mask`` itself (exactly dense attention).
    """
    B, Q, H, D = q.shape
    Lkv, Hkv = keys.shape[1], keys.shape[2]
    if top_k >= Lkv:
        return mask
    recent = (positions[:, :, None] - kv_positions[:, None, :]) < local  # [B, Q, Lkv]
    cand = mask & ~recent
    qm = q.reshape(B, Q, Hkv, H // Hkv, D).mean(3)  # [B, Q, Hkv, D]
    score = torch.einsum("bqhd,bkhd->bqk", qm, keys.to(qm.dtype)).masked_fill(~cand, float("-inf"))
    pick = torch.zeros_like(mask).scatter_(-1, score.topk(top_k, dim=-1).indices, True)  # [B, Q, Lkv]
    return mask & (recent | (pick & cand))


# K/V elements (B * L * Hkv * D) from which packing pays: below it the packing's fixed cost (~40 us per call on this
# CPU) outweighs reading K/V once per group instead of once per head (scripts/bench_gqa_attention.py)
PACK_MIN_KV = 1 << 19


def grouped_sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, packed_mask: Optional[Callable] = None) -> Tensor:
    """SDPA of q [B, H, Q, D] over k, v [B, Hkv, L, D] (H a multiple of Hkv, query head h reading KV head
    h // (H / Hkv)) under a mask shared by the heads ([B, 1, Q, L]) -> [B, H, Q, D].

    The G = H / Hkv query heads of a KV group go in as G*Q queries of one head: every K/V block is then read
    once per group, not once per query head as with enable_gqa, which is what few-query attention over a long
    context (decode, verify trees, draft steps) pays for: 1.2-3.3x per call from 2^19 K/V elements on
    (`scripts/bench_gqa_attention.py`). Each query row gets the same dot products and softmax as before.

    `packed_mask(G, dtype)`, when given, returns the mask packed that way ([B, 1, G*Q, L], additive, of q's dtype),
    built once per forward by the caller (AttentionBatch.packed_dense_mask): packed and converted here, per layer,
    a compiled forward recomputed the whole mask (its gathers included) in every layer's kernel."""
    B, H, Q, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    G = H // Hkv
    if G == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    # a compiled graph packs always: a size test would guard (or fail) on the dynamic context length
    if not torch.compiler.is_compiling() and B * L * Hkv * D < PACK_MIN_KV:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    qg = q.reshape(B, Hkv, G * Q, D)  # head g*G + r, query i -> group g, row r*Q + i
    mg = packed_mask(G, q.dtype) if packed_mask is not None else pack_group_mask(mask, G)
    return F.scaled_dot_product_attention(qg, k, v, attn_mask=mg).view(B, H, Q, D)


BAND_CHUNK = 256  # queries per chunk of a banded (sliding-window) prefill


def banded_attention(q: Tensor, k: Tensor, v: Tensor, window: int, chunk: Optional[int] = None) -> Tensor:
    """Causal sliding-window attention over one forward's own K/V: query i sees keys (i - window, i].
    q [B, T, H, D], k/v [B, T, Hkv, D] -> [B, H, T, D]. Chunks of `chunk` queries each read only their band
    of keys, so the scores held at once are [B, H, chunk, chunk + window - 1] instead of [B, H, T, T]."""
    T, chunk = q.shape[1], chunk or BAND_CHUNK
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    outs = []
    for a in range(0, T, chunk):
        b, lo = min(a + chunk, T), max(0, a - window + 1)
        dist = torch.arange(a, b, device=q.device)[:, None] - torch.arange(lo, b, device=q.device)[None, :]
        outs.append(F.scaled_dot_product_attention(qt[:, :, a:b], kt[:, :, lo:b], vt[:, :, lo:b],
                                                   attn_mask=(dist >= 0) & (dist < window), enable_gqa=True))
    return torch.cat(outs, 2)


class Attention(nn.Module):
    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.window = cfg.window_of(layer_idx)
        self.top_k: Optional[int] = None  # sparse attention; set by the target model (drafts stay dense)
        self.local = getattr(cfg, "sparse_local", 16)
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.hd, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.hd, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.hd, cfg.hidden_size, bias=getattr(cfg, "o_proj_bias", False))
        if getattr(cfg, "qk_norm", False):  # Qwen3: RMSNorm over head_dim of every q and k head, before RoPE
            self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.qkv_proj: Optional[nn.Linear] = None  # set by fuse()

    def fuse(self) -> None:
        """Inference: one [q|k|v] projection instead of three (`fused_linear`)."""
        self.qkv_proj = fused_linear([self.q_proj, self.k_proj, self.v_proj])

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, batch: Optional[AttentionBatch],
                kv: Optional[KVPool]) -> Tensor:
        B, Q, _ = x.shape
        if self.qkv_proj is not None:  # one GEMM, and RoPE over q and k together
            nq, nk = self.n_heads, self.n_kv
            qkv = self.qkv_proj(x).view(B, Q, nq + 2 * nk, self.hd)
            qk = qkv[:, :, : nq + nk]
            if self.q_norm is not None:
                qk = torch.cat([self.q_norm(qk[:, :, :nq]), self.k_norm(qk[:, :, nq:])], 2)
            qk = qk * cos + rotate_half(qk) * sin
            q, k, v = qk[:, :, :nq], qk[:, :, nq:], qkv[:, :, nq + nk:]
        else:
            q = self.q_proj(x).view(B, Q, self.n_heads, self.hd)
            k = self.k_proj(x).view(B, Q, self.n_kv, self.hd)
            v = self.v_proj(x).view(B, Q, self.n_kv, self.hd)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q = q * cos + rotate_half(q) * sin  # cos/sin: [B, Q, 1, D]
            k = k * cos + rotate_half(k) * sin
        if batch is None and self.window is None:  # training: plain causal (dense) attention over the input
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True, enable_gqa=True)
        elif batch is None:  # causal and within the sliding window
            o = banded_attention(q, k, v, self.window)
        else:
            o = self._pool_attention(q, k, v, batch, kv)
        return self.o_proj(o.transpose(1, 2).reshape(B, Q, self.n_heads * self.hd))

    def _pool_attention(self, q: Tensor, k: Tensor, v: Tensor, batch: AttentionBatch, kv: KVPool) -> Tensor:
        layer = self.layer_idx
        out_slots = batch.out_slots
        if kv.windowed[layer]:  # this layer's storage is the window pool: use translated slots
            if batch.swa_kv_slots is None:
                raise RuntimeError(f"layer {layer} keeps its K/V in the window pool, but the batch has no "
                                   "window-pool slots (build it through PrepareDecode.decorate with allocator=swa)")
            out_slots = batch.swa_out_slots
        # one query length: out_slots' and q's are separate symbols in a compiled forward (no duck sizing), and inductor
        # emitted a guard on out_slots' that it never bound ("NameError: name 's59' is not defined") on windowed layers
        torch._check(out_slots.shape[1] == q.shape[1])
        ks, vs = kv.layer(layer)
        flat = out_slots.reshape(-1)
        ks.index_copy_(0, flat, k.reshape(-1, self.n_kv, self.hd).to(ks.dtype))
        vs.index_copy_(0, flat, v.reshape(-1, self.n_kv, self.hd).to(vs.dtype))
        # hygiene: padding rows wrote slot 0, and columns no query may see are re-pointed at it, so
        # stale or non-finite K/V elsewhere in the pool can never leak in through a 0 * NaN
        ks.index_fill_(0, kv.null_slot, 0)
        vs.index_fill_(0, kv.null_slot, 0)
        if batch.fresh_causal and self.window is not None and self.top_k is None and batch.segments is None:
            # prefill of a sliding-window layer: each query chunk attends to its band of the fresh K/V only,
            # so memory and time grow with T * window, not T^2 (a [B, H, T, T] score matrix per layer)
            return banded_attention(q, k.to(ks.dtype).to(q.dtype), v.to(vs.dtype).to(q.dtype), self.window)
        if batch.fresh_causal and self.window is None and self.top_k is None:
            # prefill with no cached prefix: valid queries see only earlier (valid) keys of this forward,
            # so a causal kernel over the fresh K/V (as stored, dtype round trip included) is exact and
            # skips the pool gather, the explicit mask and the masked half of the scores
            kq, vq = k.to(ks.dtype).to(q.dtype), v.to(vs.dtype).to(q.dtype)
            if batch.segments is None:
                return F.scaled_dot_product_attention(q.transpose(1, 2), kq.transpose(1, 2), vq.transpose(1, 2),
                                                      is_causal=True, enable_gqa=True)
            return torch.cat([F.scaled_dot_product_attention(  # packed requests: causal within each one
                q[:, a:a + n].transpose(1, 2), kq[:, a:a + n].transpose(1, 2), vq[:, a:a + n].transpose(1, 2),
                is_causal=True, enable_gqa=True) for a, n in batch.segments], 2)
        if batch.segments is not None:
            raise RuntimeError("a packed batch (segments) is only valid for a fresh prefill of dense layers")
        if self.window is not None and self.top_k is None:
            batch = batch.window_view(self.window)  # only the columns this window can reach
        read, swa_read = batch.read_slots()
        kv_slots = swa_read if kv.windowed[layer] else read
        flat_kv = kv_slots.reshape(-1)  # index_select is ~2x faster than advanced indexing here
        keys = ks.index_select(0, flat_kv).view(*kv_slots.shape, self.n_kv, self.hd).to(q.dtype)  # [B, Lkv, Hkv, D]
        vals = vs.index_select(0, flat_kv).view(*kv_slots.shape, self.n_kv, self.hd).to(q.dtype)
        windowed = self.window is not None and batch.kv_positions is not None
        sparse = self.top_k is not None and batch.kv_positions is not None
        if windowed or sparse:
            return self._masked_pool_attention(q, keys, vals, batch, kv, windowed, sparse)
        return grouped_sdpa(q.transpose(1, 2), keys.transpose(1, 2), vals.transpose(1, 2), batch.dense_mask(),
                            batch.packed_dense_mask)

    def _masked_pool_attention(self, q: Tensor, keys: Tensor, vals: Tensor, batch: AttentionBatch, kv: KVPool,
                               windowed: bool, sparse: bool) -> Tensor:
        """Attention under this layer's own mask (the batch's, narrowed to the window and / or the sparse
        selection), BAND_CHUNK queries at a time: each query's mask and selection depend on that query alone,
        so a long forward (a prefill) never holds [B, Q, Lkv] masks and scores at once. Returns [B, H, Q, D]."""
        Q = q.shape[1]
        outs, picked = [], None
        track = sparse and kv.track_selection and batch.observe is not None
        kt, vt = keys.transpose(1, 2), vals.transpose(1, 2)
        for a in range(0, Q, BAND_CHUNK):
            b = min(a + BAND_CHUNK, Q)
            # one chunk: the batch's whole mask, built once per forward and shared by every layer
            mask = batch.attend_mask() if b - a == Q else batch.mask_rows(a, b)
            pos = batch.positions[:, a:b]
            if windowed:
                mask = mask & ((pos[:, :, None] - batch.kv_positions[:, None, :]) < self.window)
            if sparse:
                mask = sparse_select(q[:, a:b], keys, mask, pos, batch.kv_positions, self.top_k, self.local)
                if track:
                    picked = mask.any(1) if picked is None else picked | mask.any(1)
            outs.append(grouped_sdpa(q[:, a:b].transpose(1, 2), kt, vt, sdpa_mask(mask)))
        if track:
            batch.observe(self.layer_idx, batch, picked[:, None, :], kv.token_bytes, self.top_k + self.local)
        return outs[0] if len(outs) == 1 else torch.cat(outs, 2)
