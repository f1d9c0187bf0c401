"""Tiny random Hugging Face checkpoints shared by the model tests (transformers is a test-only dependency)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

COMMON = dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=128, max_position_embeddings=256, bos_token_id=298, eos_token_id=299)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
VARIANTS = {  # name -> (config class, model class, extra config fields)
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3_tied": ("LlamaConfig", "LlamaForCausalLM",
                    dict(rope_scaling=LLAMA3_ROPE, rope_theta=5000.0, tie_word_embeddings=True)),
    "mistral_window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=5)),
    "qwen2_window": ("Qwen2Config", "Qwen2ForCausalLM",
                     dict(use_sliding_window=True, sliding_window=6, max_window_layers=1)),
    # Qwen3: per-head q/k norms, head_dim 32 != hidden / heads, YaRN RoPE (its cos/sin scale included)
    "qwen3_yarn_tied": ("Qwen3Config", "Qwen3ForCausalLM",
                        dict(head_dim=32, tie_word_embeddings=True, rope_theta=20000.0, rope_scaling=YARN_ROPE)),
    "qwen3_bias_window": ("Qwen3Config", "Qwen3ForCausalLM",
                          dict(attention_bias=True, use_sliding_window=True, sliding_window=6, max_window_layers=1)),
    # Llama's attention_bias: q, k, v and o biases; YaRN with explicit mscale / beta settings
    "llama_bias_yarn": ("LlamaConfig", "LlamaForCausalLM",
                        dict(attention_bias=True, rope_scaling={**YARN_ROPE, "beta_fast": 16, "beta_slow": 2,
                                                                "mscale": 0.8, "mscale_all_dim": 0.5})),
    # Llama's mlp_bias (gate, up and down biases); dynamic NTK RoPE, the default one within the context
    "llama_mlpbias_dynamic": ("LlamaConfig", "LlamaForCausalLM",
                              dict(mlp_bias=True, rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
}


@pytest.fixture(scope="session")
def transformers():
    return pytest.importorskip("transformers")


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Large-scale random weights (HF's init gives near-uniform logits and zero biases)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1 + 0.1 * r)
            elif p.dim() == 1:  # q/k/v biases
                p.copy_(0.3 * r)
            else:
                p.copy_(r * 1.0 / p.shape[-1] ** 0.5)


@pytest.fixture(scope="session")
def make_hf_model(transformers):
    """make_hf_model(variant, seed=0) -> a random-weight transformers model of VARIANTS[variant]."""

    def make(variant: str, seed: int = 0):
        cfg_cls, model_cls, extra = VARIANTS[variant]
        cfg = getattr(transformers, cfg_cls)(**COMMON, **extra)
        model = getattr(transformers, model_cls)(cfg).eval()
        randomize(model, seed)
        return model

    return make


@pytest.fixture(scope="session")
def edit_config():
    """edit_config(folder, **fields) updates a folder's config.json (None deletes a field)."""

    def edit(folder: Path, **fields) -> None:
        raw = json.loads((Path(folder) / "config.json").read_text())
        for k, v in fields.items():
            raw.pop(k, None) if v is None else raw.__setitem__(k, v)
        (Path(folder) / "config.json").write_text(json.dumps(raw))

    return edit
