"""A Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) whose attention reads and writes a slot-indexed KV pool.

One readable file in the gpt-fast spirit: RMSNorm, RoPE (with llama3, linear or YaRN scaling), grouped-query
attention (optional q/k/v bias as in Qwen2, o bias as in Llama's attention_bias, per-head q/k RMSNorm as in
Qwen3, optional per-layer sliding window as in Mistral),
SwiGLU MLP, optional tied embeddings. With ``batch=None`` the model runs plain causal attention
over the whole input (training); otherwise it follows an :class:`AttentionBatch`. The KV pool and
the attention module (window pool, top-k sparse attention) live in :mod:`specpipe.models.attention`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specpipe.models.attention import Attention, KVPool, fused_linear, rotate_half  # noqa: F401 (re-exported)
from specpipe.models.attention_batch import AttentionBatch
from specpipe.models.norm import RMSNorm  # noqa: F401 (re-exported)


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
    attention_bias: bool = False  # q/k/v biases (Qwen2; Llama and Qwen3 with attention_bias)
    o_proj_bias: bool = False  # o_proj bias too (Llama and Qwen3 with attention_bias; not Qwen2)
    qk_norm: bool = False  # RMSNorm over head_dim on every q and k head before RoPE (Qwen3)
    mlp_bias: bool = False  # biases on gate, up and down projections (Llama's mlp_bias)
    sliding_window: Optional[int] = None
    layer_types: Optional[list] = None  # per layer "full_attention" | "sliding_attention"
    sparse_top_k: Optional[int] = None  # top-k sparse attention in the target (None: dense)
    sparse_local: int = 16  # sparse attention always keeps the last sparse_local positions
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


def rope_inv_freq(cfg: LlamaConfig) -> Tensor:
    """Inverse frequencies (float32), with llama3, linear or YaRN scaling when configured.

    Computed in float32 op for op as transformers does (vLLM and sglang compute in float32 too), so cos/sin
    equal HF's bit for bit: float64 frequencies gave cos/sin 7e-4 apart from HF's at position 8k in float32,
    and rounded differently in bf16."""
    d, base = cfg.head_dim, cfg.rope_theta
    rs = cfg.rope_scaling or {}
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "yarn":
        return yarn_inv_freq(d, base, rs)
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if kind == "llama3":
        factor = rs["factor"]
        lo, hi = rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
        old_ctx = rs.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv
        lo_wl, hi_wl = old_ctx / lo, old_ctx / hi
        scaled = torch.where(wavelen > lo_wl, inv / factor, inv)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = ~(wavelen < hi_wl) * ~(wavelen > lo_wl)
        inv = torch.where(is_mid, mid, scaled)
    elif kind == "linear":
        inv = inv / rs["factor"]
    elif kind not in (None, "default"):
        raise ValueError(f"rope_scaling type {kind!r} is not supported (valid: llama3, linear, yarn, default)")
    return inv


def yarn_inv_freq(d: int, theta: float, rs: dict) -> Tensor:
    """YaRN: interpolated (1 / (factor * base^(i/d))) low frequencies, original high ones, a linear ramp between
    the dimensions that rotate beta_slow and beta_fast times over the original context."""
    factor, ctx = rs["factor"], rs["original_max_position_embeddings"]
    fast, slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def dim_of(rotations):  # the dimension that turns `rotations` times over the original context
        return d * math.log(ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = dim_of(fast), dim_of(slow)
    if rs.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, d - 1)
    if lo == hi:
        hi += 0.001
    pos_freqs = theta ** (torch.arange(0, d, 2).float() / d)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ((torch.arange(d // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)  # 1: original frequency
    return interpolated * (1 - keep) + extrapolated * keep


def rope_attention_scale(cfg: LlamaConfig) -> float:
    """YaRN's factor on cos/sin (it scales q.k by its square); 1 for every other RoPE."""
    rs = cfg.rope_scaling or {}
    if rs.get("rope_type", rs.get("type")) != "yarn":
        return 1.0
    if rs.get("attention_factor") is not None:
        return float(rs["attention_factor"])

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    f, m, m_all = rs["factor"], rs.get("mscale"), rs.get("mscale_all_dim")
    return mscale(f, m) / mscale(f, m_all) if m and m_all else mscale(f)


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        bias = getattr(cfg, "mlp_bias", False)
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=bias)

        self.gate_up_proj: Optional[nn.Linear] = None  # set by fuse()

    def fuse(self) -> None:
        """Inference: one [gate|up] projection instead of two (`fused_linear`)."""
        self.gate_up_proj = fused_linear([self.gate_proj, self.up_proj])

    def forward(self, x: Tensor) -> Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def fuse_projections(models) -> int:
    """Fuse q/k/v and gate/up of every attention and MLP in `models` (None skipped), once; returns how
    many modules were fused now. For inference: training keeps the separate projections."""
    n = 0
    for model in models:
        for mod in (model.modules() if model is not None else ()):
            if ((isinstance(mod, MLP) and mod.gate_up_proj is None)
                    or (isinstance(mod, Attention) and mod.qkv_proj is None)):
                mod.fuse()
                n += 1
    return n


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
    """cos/sin in float32 as transformers computes them, cast to the model's dtype at the end."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self._inv_freq = rope_inv_freq(cfg)  # the float32 master copy (a plain attribute: .to() leaves it)
        self.register_buffer("inv_freq", self._inv_freq.clone(), persistent=False)
        self.scale = rope_attention_scale(cfg)

    def _apply(self, fn, recurse=True):
        """A dtype cast of the model (`.to(torch.bfloat16)`) moves the buffer but never rounds the frequencies."""
        super()._apply(fn, recurse)
        if not self.inv_freq.is_meta:
            self.inv_freq = self._inv_freq.to(self.inv_freq.device)
        return self

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = positions[..., None].float() * self.inv_freq  # [B, Q, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]  # [B, Q, 1, D]
        if self.scale == 1.0:
            return emb.cos().to(dtype), emb.sin().to(dtype)
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)


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
        for layer in self.layers:  # draft heads built from the same config stay dense
            layer.self_attn.top_k = cfg.sparse_top_k
        self.kv: Optional[KVPool] = None

    def window_layers(self) -> list[int]:
        """Layers with a sliding window (their KV may live in a window pool)."""
        return [i for i in range(self.config.num_hidden_layers) if self.config.window_of(i) is not None]

    def setup_kv(self, num_slots: int, dtype: Optional[torch.dtype] = None, window_slots: Optional[int] = None,
                 track_selection: bool = False) -> KVPool:
        """KV pool of ``num_slots`` full slots; with ``window_slots``, sliding layers get a window pool of
        that size instead (allocator=swa). ``track_selection`` reports sparse selections (allocator=hisparse)."""
        p = self.lm_head.weight
        c = self.config
        self.kv = KVPool(c.num_hidden_layers, num_slots, c.num_key_value_heads, c.head_dim, dtype or p.dtype,
                         p.device, window_slots, self.window_layers(), track_selection)
        return self.kv

    def forward(self, input_ids: Tensor, batch: Optional[AttentionBatch] = None,
                aux_layers: Optional[Sequence[int]] = None):
        """Final-norm hidden [B, Q, D]; with ``aux_layers`` (EAGLE-3), also those layers' outputs (the residual
        stream after each; -1: the embeddings), concatenated: ([B, Q, D], [B, Q, len(aux_layers)*D]). One forward
        either way, so forward hooks (the model timer) see EAGLE-3's target forwards too."""
        x = self.embed_tokens(input_ids)  # [B, Q, D]
        positions = batch.positions if batch is not None else torch.arange(
            input_ids.shape[1], device=input_ids.device)[None].expand_as(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        keep = set(aux_layers or ())
        outs: dict[int, Tensor] = {-1: x} if -1 in keep else {}  # only the requested layers' outputs stay alive
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, batch, self.kv)
            if i in keep:
                outs[i] = x
        if aux_layers is None:
            return self.norm(x)
        aux = torch.cat([outs[i] for i in aux_layers], dim=-1) if aux_layers else x[..., :0]
        return self.norm(x), aux

    def logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden)

    def fit_vocab(self, n: int) -> None:
        """Inference, as a draft for a target with `n` ids sharing its tokenizer (checkpoints pad their vocabularies
        differently: Qwen2.5-7B has 152064 ids, 0.5B 151936): ids past this model's own embed as zeros and score
        -inf (never drafted); ids past `n` are no longer scored."""
        own = self.config.vocab_size
        if n == own:
            return
        w = self.lm_head.weight.detach()
        head = nn.Linear(w.shape[1], n, bias=n > own, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            head.weight.zero_()
            head.weight[:min(n, own)] = w[:n]
            if n > own:
                head.bias.zero_()
                head.bias[own:] = float("-inf")
                emb = self.embed_tokens.weight.detach()
                self.embed_tokens = nn.Embedding(n, emb.shape[1], device=emb.device, dtype=emb.dtype)
                self.embed_tokens.weight.zero_()
                self.embed_tokens.weight[:own] = emb
        self.lm_head = head.requires_grad_(False)
        self.config.vocab_size = n
