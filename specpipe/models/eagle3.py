"""EAGLE-3 draft head (SafeAILab EAGLE-3 / SpecForge layout); the target gives its aux layers via forward(aux_layers=).

The target's outputs of three layers (low, mid, high) are concatenated and fused by ``fc``
(3*H -> H). One decoder layer ("midlayer") normalizes the token embedding (``input_layernorm``)
and the fused hidden (``hidden_norm``) separately and attends over their concatenation, so its
q/k/v projections take 2*H inputs; the residual is the un-normed hidden. Later draft steps feed the
head's own (pre-norm) output back as the hidden, skipping ``fc``. Logits come from ``norm`` and an
``lm_head`` over a reduced draft vocabulary; ``d2t`` maps draft id d to target id d + d2t[d].

A head of several layers (``num_hidden_layers`` > 1, as vLLM runs them) continues the residual stream through
plain decoder layers ``layers.1`` ... after the midlayer; what the last one leaves is the head's hidden.

EAGLE-3.1 options (speculators, NVIDIA Model Optimizer): ``norm_before_fc`` puts an RMSNorm (``input_norm``)
over the concatenated aux hidden before ``fc``, ``fc_norm`` one RMSNorm per aux layer (``fc_norm.i``), and
``norm_output`` makes the step's hidden the final norm's output: the next step reads it and the lm_head takes it
without a second norm.

A head trained with ``use_aux_hidden_state: false`` (e.g. NVIDIA Model Optimizer's *-Eagle3-v2 heads) reads the
target's final (normed) hidden instead, as EAGLE-1/2 do: no aux layers and no ``fc``.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from specpipe.models.attention_batch import AttentionBatch
from specpipe.models.llama import (MLP, Attention, DecoderLayer, KVPool, LlamaConfig, LlamaForCausalLM, RMSNorm,
                                   Rotary)


def default_aux_layers(num_layers: int) -> list[int]:
    """Layers whose outputs EAGLE-3 captures: 1, N//2-1, N-4 (clamped into [0, N-1] for small N)."""
    return [min(max(i, 0), num_layers - 1) for i in (1, num_layers // 2 - 1, num_layers - 4)]


def _positions(input_ids: Tensor, batch: Optional[AttentionBatch]) -> Tensor:
    if batch is not None:
        return batch.positions
    return torch.arange(input_ids.shape[1], device=input_ids.device)[None].expand_as(input_ids)


class Eagle3Layer(nn.Module):
    """The EAGLE-3 decoder layer: attention over concat(norm(embed), norm(hidden)), then a SwiGLU MLP."""

    def __init__(self, cfg: LlamaConfig, norm_before_residual: bool = False):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.self_attn = Attention(cfg, 0)
        a, bias = self.self_attn, cfg.attention_bias
        a.q_proj = nn.Linear(2 * h, a.n_heads * a.hd, bias=bias)  # takes [embed | hidden]
        a.k_proj = nn.Linear(2 * h, a.n_kv * a.hd, bias=bias)
        a.v_proj = nn.Linear(2 * h, a.n_kv * a.hd, bias=bias)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(cfg)

    def forward(self, emb: Tensor, hidden: Tensor, cos: Tensor, sin: Tensor, batch: Optional[AttentionBatch],
                kv: Optional[KVPool]) -> Tensor:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat((self.input_layernorm(emb), normed), dim=-1)  # [B, Q, 2H]
        x = residual + self.self_attn(x, cos, sin, batch, kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Head(nn.Module):
    """Same interface as :class:`EagleHead`; ``target_hidden`` is [B, Q, 3*Ht] (target) or [B, Q, H] (own)."""

    def __init__(self, cfg: LlamaConfig, target: LlamaForCausalLM, draft_vocab_size: Optional[int] = None,
                 target_hidden_size: Optional[int] = None, aux_layers: Optional[Sequence[int]] = None,
                 fc_bias: bool = False, own_embed: bool = False, norm_before_residual: bool = False,
                 use_aux_hidden_state: bool = True, norm_before_fc: bool = False, fc_norm: bool = False,
                 norm_output: bool = False):
        super().__init__()
        self.config = cfg
        h, vocab = cfg.hidden_size, cfg.vocab_size
        vd = draft_vocab_size or vocab
        n_target = target.config.num_hidden_layers
        th = target_hidden_size or target.config.hidden_size
        if not use_aux_hidden_state:  # the target's final hidden, as is: [] makes the pipeline pass that one
            if th != h:
                raise ValueError(f"an EAGLE-3 head without aux hidden states has no fc to map the target's width "
                                 f"{th} to its own {h}")
            self.aux_layers: list[int] = []
            self.fc: Optional[nn.Linear] = None
        else:
            self.aux_layers = list(aux_layers) if aux_layers is not None else default_aux_layers(n_target)
            self.fc = nn.Linear(len(self.aux_layers) * th, h, bias=fc_bias)
        n_in = len(self.aux_layers)
        eps = cfg.rms_norm_eps
        self.fc_norm = nn.ModuleList([RMSNorm(th, eps) for _ in range(n_in)]) if fc_norm and self.fc is not None \
            else None
        self.input_norm = RMSNorm(n_in * th, eps) if norm_before_fc and self.fc is not None else None
        self.norm_output = norm_output
        self.midlayer = Eagle3Layer(cfg, norm_before_residual)
        # named by their index in the checkpoint (layers.1, layers.2, ...): the midlayer is layer 0
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, i) for i in range(1, cfg.num_hidden_layers)})
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, vd, bias=False)  # over the draft vocab
        self.register_buffer("d2t", torch.zeros(vd, dtype=torch.int64))  # target id = d + d2t[d]
        self.register_buffer("t2d", torch.ones(vocab, dtype=torch.bool))  # target token is in the draft vocab
        self.embed_tokens = nn.Embedding(vocab, h) if own_embed else None
        self.rotary = Rotary(cfg)
        self._shared = (target.embed_tokens,)  # kept out of this head's state_dict
        self.kv: Optional[KVPool] = None

    @property
    def draft_vocab_size(self) -> int:
        return self.lm_head.out_features

    def setup_kv(self, num_slots: int, dtype: Optional[torch.dtype] = None) -> KVPool:
        c, p = self.config, self.lm_head.weight
        self.kv = KVPool(1 + len(self.layers), num_slots, c.num_key_value_heads, c.head_dim, dtype or p.dtype, p.device)
        return self.kv

    def embed(self, input_ids: Tensor) -> Tensor:
        return (self.embed_tokens or self._shared[0])(input_ids)

    def capture(self, target: LlamaForCausalLM, input_ids: Tensor,
                batch: Optional[AttentionBatch] = None) -> tuple[Tensor, Tensor]:
        """Run the target; returns ([B, Q, H] final hidden, [B, Q, 3*Ht] this head's input: the aux layers'
        outputs, or the final hidden again for a head without aux hidden states)."""
        if self.fc is None:
            final = target(input_ids, batch)
            return final, final
        return target(input_ids, batch, aux_layers=self.aux_layers)

    def forward(self, input_ids: Tensor, target_hidden: Tensor, batch: Optional[AttentionBatch] = None,
                own_hidden: Optional[bool] = None) -> Tensor:
        """[B, Q] ids, [B, Q, 3*Ht] target aux hidden (or [B, Q, H] own hidden) -> [B, Q, H] draft hidden.

        ``own_hidden``: True when ``target_hidden`` is this head's own output (later draft steps: no fc), False when
        it is the target's features; None guesses from the width, which cannot tell them apart when fc's input is
        as wide as the head (one aux layer of a target as wide as the head): then it takes the target's."""
        w = self.lm_head.weight
        hidden = target_hidden.to(w.dtype)
        if own_hidden is None:
            own_hidden = self.fc is None or hidden.shape[-1] != self.fc.in_features
        if self.fc is not None and not own_hidden:
            if hidden.shape[-1] != self.fc.in_features:
                raise ValueError(f"target_hidden has width {hidden.shape[-1]}; expected {self.fc.in_features} "
                                 f"(aux layers {self.aux_layers} of the target)")
            if self.fc_norm is not None:
                hidden = torch.cat([norm(x) for norm, x in zip(self.fc_norm, hidden.chunk(len(self.fc_norm), -1))], -1)
            if self.input_norm is not None:
                hidden = self.input_norm(hidden)
            hidden = self.fc(hidden)
        elif hidden.shape[-1] != self.config.hidden_size:
            raise ValueError(f"target_hidden has width {hidden.shape[-1]}; expected "
                             + (f"{self.fc.in_features} (aux layers {self.aux_layers} of the target) or "
                                if self.fc is not None else "") + f"{self.config.hidden_size}")
        emb = self.embed(input_ids).to(w.dtype)
        cos, sin = self.rotary(_positions(input_ids, batch), w.dtype)
        x = self.midlayer(emb, hidden, cos, sin, batch, self.kv)
        for layer in self.layers.values():
            x = layer(x, cos, sin, batch, self.kv)
        return self.norm(x) if self.norm_output else x

    def draft_logits(self, hidden: Tensor) -> Tensor:
        """[..., H] -> [..., Vd] logits over the draft vocabulary."""
        return self.lm_head(hidden if self.norm_output else self.norm(hidden))

    def to_target(self, draft_ids: Tensor) -> Tensor:
        """Draft-vocab ids -> target-vocab ids."""
        return draft_ids + self.d2t[draft_ids]

    def logits(self, hidden: Tensor) -> Tensor:
        """[..., H] -> [..., V] logits over the full target vocab; tokens outside the draft vocab get -inf."""
        small = self.draft_logits(hidden)  # [..., Vd]
        ids = self.to_target(torch.arange(small.shape[-1], device=small.device))  # [Vd]
        full = small.new_full((*small.shape[:-1], self.config.vocab_size), float("-inf"))
        return full.index_copy_(-1, ids, small)
