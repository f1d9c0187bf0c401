"""Checkpoint layouts and config spellings transformers loads that specpipe must load the same way."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from specpipe.models.hf.config import parse_config
from specpipe.models.hf.errors import CheckpointError
from specpipe.models.hf.load import load_target


@torch.no_grad()
def test_a_tied_checkpoint_that_stores_only_lm_head_loads_as_transformers_loads_it(transformers, make_hf_model,
                                                                                   tmp_path):
    """safetensors.torch.save_model(model) keeps one name of a shared tensor, the first in sorted order:
    `lm_head.weight`, dropping `model.embed_tokens.weight`. transformers ties the embeddings to it; specpipe
    refused the folder, saying model.embed_tokens.weight was missing."""
    from safetensors.torch import save_model

    model = make_hf_model("qwen3_yarn_tied", seed=21)
    model.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    save_model(model, str(tmp_path / "model.safetensors"))
    keys = load_file(tmp_path / "model.safetensors").keys()
    assert "lm_head.weight" in keys and "model.embed_tokens.weight" not in keys
    ids = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(22))
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()(ids).logits
    target = load_target(tmp_path)
    assert target.lm_head.weight is target.embed_tokens.weight
    assert (target.logits(target(ids)) - ref).abs().max().item() <= 1e-4


def test_a_tied_checkpoint_with_neither_embedding_is_still_refused_by_name(make_hf_model, tmp_path):
    from safetensors.torch import save_file

    make_hf_model("llama3_tied").save_pretrained(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    sd.pop("model.embed_tokens.weight")
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="tensor 'model.embed_tokens.weight' is missing"):
        load_target(tmp_path)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_num_key_value_heads_null_means_one_per_query_head(arch, tmp_path):
    """Every family's transformers config reads `"num_key_value_heads": null` as num_attention_heads (multi-head
    attention); specpipe refused it as a missing required field."""
    base = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "head_dim": 16, "architectures": [arch]}
    cfg = parse_config({**base, "num_key_value_heads": None}, tmp_path / "config.json")
    assert cfg.num_key_value_heads == 4
    with pytest.raises(CheckpointError, match="'num_key_value_heads' must be a positive integer, got 0"):
        parse_config({**base, "num_key_value_heads": 0}, tmp_path / "config.json")
