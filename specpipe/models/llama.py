"""A Llama-family decoder (Llama, Mistral, Qwen2) whose attention reads and writes a slot-indexed KV pool.

One readable file in the gpt-fast spirit: RMSNorm, RoPE (with llama3-style scaling), grouped-query
attention (optional q/k/v bias as in Qwen2, optional per-layer sliding window as in Mistral),
SwiGLU MLP, optional tied embeddings. With ``batch=None`` the model runs plain causal attention
over the whole input (training); otherwise it follows an :class:`AttentionBatch`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specpipe.models.attention_batch import AttentionBatch


@dataclass
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    head_dim: Optional[int] = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: Optional[int] = None
    layer_types: Optional[list] = None  # per layer "full_attention" | "sliding_attention"
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads

    def window_of(self, layer: int) -> Optional[int]:
        """Sliding window of a layer, or None for full attention."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None


class KVPool:
    """K/V storage for all layers: slot s of layer l holds one token's keys and values."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, S, Hkv, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # [L, S, Hkv, D]

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]

    def move(self, tgt: Tensor, src: Tensor) -> None:
        """Copy every layer's K/V from slots ``src`` to slots ``tgt`` (both [n] int64)."""
        self.k[:, tgt] = self.k[:, src]
        self.v[:, tgt] = self.v[:, src]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


def rope_inv_freq(cfg: LlamaConfig) -> Tensor:
    """Inverse frequencies, with llama3-style scaling or linear scaling when configured."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    rs = cfg.rope_scaling or {}
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "llama3":
        factor = rs["factor"]
        lo, hi = rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
        old_ctx = rs.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv
        lo_wl, hi_wl = old_ctx / lo, old_ctx / hi
        scaled = torch.where(wavelen > lo_wl, inv / factor, inv)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= hi_wl) & (wavelen <= lo_wl)
        inv = torch.where(is_mid, mid, scaled)
    elif kind == "linear":
        inv = inv / rs["factor"]
    elif kind not in (None, "default"):
        raise ValueError(f"rope_scaling type {kind!r} is not supported (valid: llama3, linear, default)")
    return inv


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.window = cfg.window_of(layer_idx)
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.hd, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.hd, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.hd, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, batch: Optional[AttentionBatch],
                kv: Optional[KVPool]) -> Tensor:
        B, Q, _ = x.shape
        q = self.q_proj(x).view(B, Q, self.n_heads, self.hd)
        k = self.k_proj(x).view(B, Q, self.n_kv, self.hd)
        v = self.v_proj(x).view(B, Q, self.n_kv, self.hd)
        q = q * cos + rotate_half(q) * sin  # cos/sin: [B, Q, 1, D]
        k = k * cos + rotate_half(k) * sin
        if batch is None and self.window is None:  # training: plain causal attention over the input
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True, enable_gqa=True)
        elif batch is None:  # causal and within the sliding window
            i = torch.arange(Q, device=x.device)
            dist = i[:, None] - i[None, :]  # [Q, Q]
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               attn_mask=(dist >= 0) & (dist < self.window), enable_gqa=True)
        else:
            o = self._pool_attention(q, k, v, batch, kv)
        return self.o_proj(o.transpose(1, 2).reshape(B, Q, self.n_heads * self.hd))

    def _pool_attention(self, q: Tensor, k: Tensor, v: Tensor, batch: AttentionBatch, kv: KVPool) -> Tensor:
        layer = self.layer_idx
        flat = batch.out_slots.reshape(-1)
        kv.k[layer].index_copy_(0, flat, k.reshape(-1, self.n_kv, self.hd).to(kv.k.dtype))
        kv.v[layer].index_copy_(0, flat, v.reshape(-1, self.n_kv, self.hd).to(kv.v.dtype))
        keys = kv.k[layer][batch.kv_slots].to(q.dtype)  # [B, Lkv, Hkv, D]
        vals = kv.v[layer][batch.kv_slots].to(q.dtype)
        mask = batch.mask
        if self.window is not None and batch.kv_positions is not None:
            dist = batch.positions[:, :, None] - batch.kv_positions[:, None, :]  # [B, Q, Lkv]
            mask = mask & (dist < self.window)
        # a fully masked row (padding query) would give NaN: let it see column 0 instead
        mask = mask | (~mask.any(-1, keepdim=True) & (torch.arange(mask.shape[-1], device=mask.device) == 0))
        return F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), vals.transpose(1, 2),
                                              attn_mask=mask[:, None], enable_gqa=True)


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_idx: int, input_norm: bool = True):
        super().__init__()
        # EAGLE-1/2 heads drop the first layer's input norm (the fc output is used as is)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if input_norm else nn.Identity()
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, batch, kv):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch, kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class Rotary(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(cfg).float(), persistent=False)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = positions[..., None].to(torch.float64) * self.inv_freq.to(torch.float64)  # [B, Q, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]  # [B, Q, 1, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)


class LlamaForCausalLM(nn.Module):
    """Target model. ``forward`` returns the final-norm hidden states; ``logits`` applies lm_head."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(cfg)
        self.kv: Optional[KVPool] = None

    def setup_kv(self, num_slots: int, dtype: Optional[torch.dtype] = None) -> KVPool:
        p = self.lm_head.weight
        c = self.config
        self.kv = KVPool(c.num_hidden_layers, num_slots, c.num_key_value_heads, c.head_dim, dtype or p.dtype, p.device)
        return self.kv

    def forward(self, input_ids: Tensor, batch: Optional[AttentionBatch] = None) -> Tensor:
        x = self.embed_tokens(input_ids)  # [B, Q, D]
        positions = batch.positions if batch is not None else torch.arange(
            input_ids.shape[1], device=input_ids.device)[None].expand_as(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, batch, self.kv)
        return self.norm(x)

    def logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden)
