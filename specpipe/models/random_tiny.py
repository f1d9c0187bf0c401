"""A seeded random target + EAGLE head pair, built in milliseconds, for tests."""
from __future__ import annotations

from typing import Optional

import torch

from specpipe.errors import ConfigError
from specpipe.models.eagle import EagleHead
from specpipe.models.llama import LlamaConfig, LlamaForCausalLM
from specpipe.models.pair import ModelPair
from specpipe.workload.tokenizer import small_or_byte_tokenizer


def layer_pattern(sliding_layers: str, num_layers: int) -> Optional[list]:
    """layer_types for a sliding pattern: None (every layer slides) or alternating sliding/full."""
    if sliding_layers == "all":
        return None
    if sliding_layers == "alternate":
        return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    raise ConfigError(f"model.sliding_layers={sliding_layers!r} is unknown (valid: all, alternate)")


def check_shape(**shape) -> None:
    """A ConfigError naming every model.* value that cannot make a model (before torch fails obscurely)."""
    errors = [f"model.{k}={v} must be >= 1" for k, v in shape.items() if v is not None and v < 1]
    if shape["vocab_size"] >= 1 and shape["vocab_size"] < 2:
        errors.append(f"model.vocab_size={shape['vocab_size']} must be >= 2 (a token and the EOS)")
    elif 26 < shape["vocab_size"] < 256:  # small_or_byte_tokenizer: letters a..z, or all 256 bytes
        errors.append(f"model.vocab_size={shape['vocab_size']} has no tokenizer: use 2 to 26 (letters a..z) or "
                      f"256 and more (bytes; the default is 258)")
    heads, kv = shape["num_heads"], shape["num_kv_heads"]
    if heads >= 1 and kv >= 1 and heads % kv:
        errors.append(f"model.num_kv_heads={kv} must divide model.num_heads={heads}")
    if (heads >= 1 and shape["hidden_size"] >= 1
            and (shape["hidden_size"] % heads or (shape["hidden_size"] // heads) % 2)):
        errors.append(f"model.hidden_size={shape['hidden_size']} must be a multiple of 2 * model.num_heads "
                      f"= {2 * heads} (RoPE needs an even head dimension)")
    if errors:
        raise ConfigError(errors)


def build_random_tiny(vocab_size: int = 258, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                      num_kv_heads: int = 2, intermediate_size: int = 128, max_position: int = 2048,
                      tie_word_embeddings: bool = False, init_std: float = 0.5, seed: int = 0,
                      residual_scale: float = 0.1, aligned_draft: bool = True,
                      sliding_window: Optional[int] = None, sliding_layers: str = "all",
                      sparse_top_k: Optional[int] = None, sparse_local: int = 16,
                      dtype: str = "float32", device: str = "cpu", draft_path: Optional[str] = None) -> ModelPair:
    """Random weights with a large init scale so logits are far from uniform (few argmax ties).

    `residual_scale` shrinks every block's output projections so the residual stream stays close
    to the token embedding; with `aligned_draft` the head's fc passes the embedding through. The
    draft then agrees with the target often but not always, so tests see accepted and rejected
    tree paths (a fully random head would accept almost nothing).

    `sliding_window` with `sliding_layers` "all" (Mistral) or "alternate" (Gemma/Qwen2-style
    layer_types: even layers slide, odd layers are full) gives allocator=swa something to serve;
    `sparse_top_k` makes the target's attention top-k sparse (allocator=hisparse).
    """
    check_shape(vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                num_kv_heads=num_kv_heads, intermediate_size=intermediate_size, max_position=max_position,
                sliding_window=sliding_window, sparse_top_k=sparse_top_k, sparse_local=sparse_local)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
                      num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                      intermediate_size=intermediate_size, max_position_embeddings=max_position,
                      tie_word_embeddings=tie_word_embeddings, eos_token_id=vocab_size - 1,
                      sliding_window=sliding_window, layer_types=layer_pattern(sliding_layers, num_layers),
                      sparse_top_k=sparse_top_k, sparse_local=sparse_local)
    gen = torch.Generator().manual_seed(seed)
    target = LlamaForCausalLM(cfg)
    draft = EagleHead(cfg, target)
    for module in (target, draft):
        for name, p in module.named_parameters():
            if "norm" in name:
                continue
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=gen) * init_std / max(1, p.shape[-1]) ** 0.5
                        if p.dim() > 1 else torch.randn(p.shape, generator=gen) * 0.02)
    with torch.no_grad():
        for module in (target, draft):
            for name, p in module.named_parameters():
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    p.mul_(residual_scale)
        if aligned_draft:
            h = hidden_size
            draft.fc.weight[:, :h] = torch.eye(h)
            draft.fc.weight[:, h:] *= 0.1
            draft.fc.bias.zero_()
    dt = getattr(torch, dtype)
    target.to(device=device, dtype=dt).eval()
    draft.to(device=device, dtype=dt).eval()
    tok = small_or_byte_tokenizer(vocab_size, eos_token_id=vocab_size - 1)
    return ModelPair(target, draft, tok, name="random_tiny")
