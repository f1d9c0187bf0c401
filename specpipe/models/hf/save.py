"""Write targets and EAGLE heads as Hugging Face folders (config.json + model.safetensors)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from specpipe.models.hf.dtypes import to_dtype
from specpipe.models.llama import LlamaConfig, LlamaForCausalLM

MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
               "Qwen3ForCausalLM": "qwen3"}


def unfused(sd: dict) -> dict:
    """A state dict without the inference-only fused projections (their parts hold the same values)."""
    return {n: t for n, t in sd.items() if ".qkv_proj." not in n and ".gate_up_proj." not in n}


def _pick_arch(cfg: LlamaConfig) -> str:
    arch = cfg.extra.get("architecture")
    if arch in MODEL_TYPES:
        return arch
    if cfg.qk_norm:
        return "Qwen3ForCausalLM"
    if cfg.attention_bias and not cfg.o_proj_bias:
        return "Qwen2ForCausalLM"
    return "MistralForCausalLM" if cfg.sliding_window is not None else "LlamaForCausalLM"


def config_to_hf(cfg: LlamaConfig, architecture: Optional[str] = None) -> dict:
    """A ``config.json`` dict that transformers (v4 and v5) and :func:`load_target` both read."""
    arch = architecture or _pick_arch(cfg)
    out = {"architectures": [arch], "model_type": MODEL_TYPES.get(arch, "llama"), "hidden_act": "silu",
           "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
           "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
           "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
           "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_position_embeddings,
           "tie_word_embeddings": cfg.tie_word_embeddings, "bos_token_id": cfg.bos_token_id,
           "eos_token_id": cfg.extra.get("eos_token_ids", cfg.eos_token_id)}
    if cfg.rope_scaling:
        out["rope_scaling"] = dict(cfg.rope_scaling)
    if cfg.qk_norm != (arch == "Qwen3ForCausalLM"):
        raise ValueError(f"{arch} cannot express this model's q/k norms (qk_norm={cfg.qk_norm}); Qwen3 has them")
    if arch == "Qwen2ForCausalLM" and (not cfg.attention_bias or cfg.o_proj_bias):
        raise ValueError("Qwen2ForCausalLM has q/k/v biases and no o_proj bias; this model does not")
    if arch != "Qwen2ForCausalLM" and cfg.attention_bias != cfg.o_proj_bias:
        raise ValueError(f"{arch}'s attention_bias puts a bias on q, k, v and o alike; save q/k/v-only biases "
                         f"as Qwen2ForCausalLM")
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        types = cfg.layer_types or ["sliding_attention"] * cfg.num_hidden_layers
        out.update(use_sliding_window=cfg.sliding_window is not None, sliding_window=cfg.sliding_window,
                   max_window_layers=next((i for i, t in enumerate(types) if t == "sliding_attention"), 0))
        if cfg.sliding_window is not None:
            out["layer_types"] = list(types)
        if arch == "Qwen3ForCausalLM":
            out["attention_bias"] = cfg.o_proj_bias
    elif cfg.attention_bias and arch != "LlamaForCausalLM":
        raise ValueError(f"{arch} has no attention bias; save this model as LlamaForCausalLM or Qwen2ForCausalLM")
    if cfg.attention_bias and arch == "LlamaForCausalLM":
        out["attention_bias"] = True
    if cfg.mlp_bias:
        if arch != "LlamaForCausalLM":
            raise ValueError(f"{arch} has no MLP biases; save this model as LlamaForCausalLM")
        out["mlp_bias"] = True
    if arch == "MistralForCausalLM":  # written when null too: absent, Mistral's default window of 4096 applies
        out["sliding_window"] = cfg.sliding_window
        if cfg.sliding_window is not None and cfg.layer_types is not None:  # read as Ministral: per-layer windows
            out["layer_types"] = list(cfg.layer_types)
    elif arch not in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and cfg.sliding_window is not None:
        raise ValueError(f"{arch} cannot express a sliding window; save this model as MistralForCausalLM or "
                         f"Qwen2ForCausalLM")
    return out


def _tensors(named: dict[str, Tensor], dtype: Optional[torch.dtype], prefix=lambda n: n) -> dict[str, Tensor]:
    out = {}
    for n, t in named.items():
        t = t.detach().to("cpu", dtype if dtype is not None and t.is_floating_point() else t.dtype)
        out[prefix(n)] = t.contiguous().clone()  # clone: safetensors refuses shared storage
    return out


def _dtype(dtype) -> Optional[torch.dtype]:
    return None if dtype is None else to_dtype(dtype)


def _write(folder: str | Path, config: dict, tensors: dict[str, Tensor]) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def save_target(model: LlamaForCausalLM, tokenizer: Any, folder: str | Path, dtype=None) -> Path:
    """Write ``model`` (HF keys: model.* and lm_head.weight) and its tokenizer; ``dtype=None`` keeps dtypes."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    config = config_to_hf(cfg)
    if hasattr(tokenizer, "describe"):
        config["specpipe_tokenizer"] = tokenizer.describe()
    elif hasattr(tokenizer, "_tok"):  # HFTokenizer: copy its tokenizer.json
        tokenizer._tok.save(str(folder / "tokenizer.json"))
        config["specpipe_tokenizer"] = {"type": "hf", "file": "tokenizer.json",
                                        "eos_token_id": tokenizer.eos_token_id, "bos_token_id": tokenizer.bos_token_id}
    elif tokenizer is not None:
        raise TypeError(f"cannot save tokenizer of type {type(tokenizer).__name__} (needs describe())")
    sd = {n: t for n, t in unfused(model.state_dict()).items()
          if not (cfg.tie_word_embeddings and n == "lm_head.weight")}
    tensors = _tensors(sd, _dtype(dtype), lambda n: n if n.startswith("lm_head.") else "model." + n)
    return _write(folder, config, tensors)


def save_eagle(head: nn.Module, folder: str | Path, dtype=None) -> Path:
    """Write an EagleHead (fc.*, layers.N.*) or Eagle3Head (midlayer.*, fc, norm, lm_head, d2t, t2d)."""
    cfg = head.config
    if hasattr(head, "midlayer"):  # EAGLE-3
        config = config_to_hf(cfg)
        config.update(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1 + len(head.layers),
                      draft_vocab_size=head.draft_vocab_size,
                      target_hidden_size=head.fc.in_features // len(head.aux_layers) if head.fc is not None
                      else cfg.hidden_size)
        if head.fc is None:  # reads the target's final hidden
            config["eagle_config"] = {"use_aux_hidden_state": False}
        elif min(head.aux_layers) >= 0:  # sglang's convention: layer i's output
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(head.aux_layers)}
        else:  # the embeddings have a name only in vLLM's: the input of layer j
            config["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in head.aux_layers]
        if head.midlayer.norm_before_residual:
            config["norm_before_residual"] = True
        for flag, on in (("norm_before_fc", head.input_norm is not None), ("fc_norm", head.fc_norm is not None),
                         ("norm_output", head.norm_output)):
            if on:
                config[flag] = True
    else:
        config = config_to_hf(cfg)
        config.update(num_hidden_layers=len(head.layers), bias=head.fc.bias is not None)
        if cfg.layer_types is not None:
            config["layer_types"] = list(cfg.layer_types[:len(head.layers)])
    return _write(folder, config, _tensors(unfused(head.state_dict()), _dtype(dtype)))
