"""EAGLE-1/2 draft head: fc over concat(token embedding, target hidden) -> one decoder layer -> lm_head.

The head predicts the target's next hidden feature. Draft position p takes the pair
(token x_{p+1}, target hidden h_p) at RoPE position p, writes its K/V into the draft's own pool
at the same slot the target uses for position p, and its output hidden state both feeds the
next draft step and, through the target's lm_head, gives the draft distribution.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from specpipe.models.attention_batch import AttentionBatch
from specpipe.models.llama import DecoderLayer, KVPool, LlamaConfig, LlamaForCausalLM, Rotary


class EagleHead(nn.Module):
    def __init__(self, cfg: LlamaConfig, target: LlamaForCausalLM, num_layers: int = 1,
                 fc_bias: bool = True, own_embed: bool = False, own_lm_head: bool = False,
                 first_input_norm: bool = False):
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=fc_bias)
        # EAGLE's layer 0 skips its input norm (fc's output feeds attention directly) unless trained with one
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, input_norm=i > 0 or first_input_norm)
                                    for i in range(num_layers))
        self.rotary = Rotary(cfg)
        # shared modules are kept out of this head's state_dict unless the checkpoint has its own
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h) if own_embed else None
        self.lm_head = nn.Linear(h, cfg.vocab_size, bias=False) if own_lm_head else None
        self._shared = (target.embed_tokens, target.lm_head)
        self.kv: Optional[KVPool] = None

    def setup_kv(self, num_slots: int, dtype: Optional[torch.dtype] = None) -> KVPool:
        c = self.config
        p = self.fc.weight
        self.kv = KVPool(len(self.layers), num_slots, c.num_key_value_heads, c.head_dim, dtype or p.dtype, p.device)
        return self.kv

    def embed(self, input_ids: Tensor) -> Tensor:
        return (self.embed_tokens or self._shared[0])(input_ids)

    def forward(self, input_ids: Tensor, target_hidden: Tensor, batch: Optional[AttentionBatch] = None,
                own_hidden: Optional[bool] = None) -> Tensor:
        """[B, Q] ids, [B, Q, H] target hidden -> [B, Q, H] draft hidden. ``own_hidden`` (the input is this head's
        own output) changes nothing here: EAGLE-1/2 fuse either through fc with the token embedding."""
        x = self.fc(torch.cat((self.embed(input_ids), target_hidden.to(self.fc.weight.dtype)), dim=-1))
        positions = batch.positions if batch is not None else torch.arange(
            input_ids.shape[1], device=input_ids.device)[None].expand_as(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, batch, self.kv)
        return x

    def logits(self, hidden: Tensor) -> Tensor:
        return (self.lm_head or self._shared[1])(hidden)
