"""specpipe's Llama / Mistral / Qwen2 / Qwen3 match transformers' logits (fp32, max abs diff <= 1e-4)."""
from __future__ import annotations

import json

import pytest
import torch

from specpipe.models.attention_batch import extend_batch
from specpipe.models.hf.load import load_hf, load_target
from specpipe.models.hf.save import save_target
from specpipe.models.random_tiny import build_random_tiny

TOL = 1e-4
T = 20  # sequence length; longer than the Mistral (5) and Qwen2 (6) sliding windows


@pytest.fixture(scope="module", params=["llama", "llama3_tied", "mistral_window", "qwen2_window", "qwen3_yarn_tied",
                                        "qwen3_bias_window", "llama_bias_yarn",
                                        "llama_mlpbias_dynamic"])
def checkpoint(request, make_hf_model, tmp_path_factory):
    """(folder, ids [2, T], reference logits [2, T, V]) of a saved random transformers model."""
    model = make_hf_model(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    ids = torch.randint(0, 300, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits.float()
    return folder, ids, ref


def _pool_logits(target, ids: torch.Tensor, prompt_lens: list[int]) -> torch.Tensor:
    """Prefill prompts of different lengths through the KV pool, then decode one token per step."""
    B, L = ids.shape
    target.setup_kv(B * L + 1)  # slot 0 is the padding sink
    table = (torch.randperm(B * L, generator=torch.Generator().manual_seed(2)) + 1).view(B, L)  # scattered slots
    rows, cur = torch.arange(B), torch.tensor(prompt_lens)
    out = torch.full((B, L, target.config.vocab_size), float("nan"))
    q = int(cur.max())
    lg = target.logits(target(ids[:, :q], extend_batch(table, rows, torch.zeros_like(cur), cur, q, q)))
    for b in range(B):
        out[b, :cur[b]] = lg[b, :cur[b]]
    while (cur < L).any():
        lens = (cur < L).long()  # finished rows become padding
        tok = ids.gather(1, cur.clamp(max=L - 1)[:, None])  # [B, 1]
        batch = extend_batch(table, rows, cur, lens, 1, int((cur + lens).max()))
        lg = target.logits(target(tok, batch))[:, 0]  # [B, V]
        for b in torch.nonzero(lens).flatten().tolist():
            out[b, cur[b]] = lg[b]
        cur = cur + lens
    return out


@torch.no_grad()
def test_prefill_matches_transformers(checkpoint):
    folder, ids, ref = checkpoint
    target = load_target(folder)
    got = target.logits(target(ids))
    assert (got - ref).abs().max().item() <= TOL


@torch.no_grad()
def test_kv_pool_matches_transformers(checkpoint):
    folder, ids, ref = checkpoint
    target = load_target(folder)
    got = _pool_logits(target, ids, [7, 3])
    assert (got - ref).abs().max().item() <= TOL


@torch.no_grad()
def test_fused_projections_match_transformers_and_save_unfused(checkpoint, tmp_path):
    """run() fuses q|k|v and gate|up (Qwen2's q/k/v biases included): the same logits, the same checkpoint."""
    from safetensors import safe_open

    from specpipe.models.llama import fuse_projections

    folder, ids, ref = checkpoint
    target = load_target(folder)
    before = _pool_logits(target, ids, [7, 3])
    assert fuse_projections([target]) == 2 * target.config.num_hidden_layers
    assert fuse_projections([target]) == 0  # once
    after = _pool_logits(target, ids, [7, 3])
    assert torch.allclose(after, before, atol=1e-6, rtol=0) and (after - ref).abs().max().item() <= TOL
    save_target(target, None, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert not any("qkv_proj" in k or "gate_up_proj" in k for k in keys)
    assert "model.layers.0.self_attn.q_proj.weight" in keys and "model.layers.1.mlp.up_proj.weight" in keys


@torch.no_grad()
def test_sharded_checkpoint_loads(make_hf_model, tmp_path):
    model = make_hf_model("qwen2_window", seed=3)
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    ids = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(4))
    target = load_target(tmp_path)
    assert (target.logits(target(ids)) - model(ids).logits).abs().max().item() <= TOL


def test_load_hf_with_tokenizer_and_dtype(make_hf_model, edit_config, tmp_path):
    model = make_hf_model("llama3_tied", seed=5)
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    edit_config(tmp_path, specpipe_tokenizer={"type": "byte", "vocab_size": 300, "eos_token_id": 299})
    pair = load_hf(tmp_path, dtype="float32")
    t = pair.target
    assert pair.draft is None and pair.tokenizer.eos_token_id == 299 and pair.name == tmp_path.name
    assert t.embed_tokens.weight.dtype == torch.float32 and t.lm_head.weight is t.embed_tokens.weight
    assert torch.equal(t.embed_tokens.weight, model.model.embed_tokens.weight.float())
    assert t.config.rope_scaling["rope_type"] == "llama3" and t.config.rope_theta == 5000.0
    assert load_target(tmp_path, dtype="bfloat16").norm.weight.dtype == torch.bfloat16


def test_a_llama_config_with_a_sliding_window_is_named_as_unapplied(make_hf_model, edit_config, tmp_path, capsys):
    """Llama attention has no window (HF's LlamaAttention and vLLM ignore the field), but transformers' generate
    trims its cache to it, so its outputs differed from specpipe's with nothing said."""
    make_hf_model("llama").save_pretrained(tmp_path)
    edit_config(tmp_path, specpipe_tokenizer={"type": "byte", "vocab_size": 300, "eos_token_id": 299},
                sliding_window=None)
    load_hf(tmp_path)
    assert "sliding_window" not in capsys.readouterr().err
    edit_config(tmp_path, sliding_window=8)
    pair = load_hf(tmp_path)
    assert "sets sliding_window=8 on a Llama model" in capsys.readouterr().err
    assert all(pair.target.config.window_of(i) is None for i in range(2))  # and it is not applied


@torch.no_grad()
def test_save_target_is_readable_by_transformers(transformers, tmp_path):
    pair = build_random_tiny(vocab_size=300, tie_word_embeddings=True, seed=6)
    save_target(pair.target, pair.tokenizer, tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(7))
    ref = model(ids).logits
    assert (pair.target.logits(pair.target(ids)) - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("variant", ["qwen3_bias_window", "llama_bias_yarn", "llama_mlpbias_dynamic"])
@torch.no_grad()
def test_saved_qwen3_and_biased_llama_read_back_by_transformers(transformers, make_hf_model, tmp_path, variant):
    """save_target writes q/k norms, o_proj and MLP biases and YaRN settings that transformers reads as it
    wrote them."""
    model = make_hf_model(variant, seed=8)
    model.save_pretrained(tmp_path / "orig")
    target = load_target(tmp_path / "orig")
    save_target(target, None, tmp_path / "copy")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "copy").eval()
    assert type(back) is type(model)
    ids = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(9))
    assert (back(ids).logits - model(ids).logits).abs().max().item() <= TOL


@pytest.mark.parametrize("types", [["sliding_attention", "full_attention"], None, "null"])
@torch.no_grad()
def test_a_saved_mistral_keeps_its_window_layout(transformers, make_hf_model, edit_config, tmp_path, types):
    """save_target refused a Mistral with layer_types (a Ministral-style layout), and wrote no sliding_window for
    one whose window is null, which then read back (in specpipe and transformers) as Mistral's default 4096."""
    model = make_hf_model("mistral_window", seed=8)
    model.save_pretrained(tmp_path / "orig")
    edit_config(tmp_path / "orig", **({"sliding_window": None} if types == "null" else {"layer_types": types}))
    if types == "null":  # edit_config deletes a field given None: write the null by hand
        raw = json.loads((tmp_path / "orig" / "config.json").read_text())
        (tmp_path / "orig" / "config.json").write_text(json.dumps({**raw, "sliding_window": None}))
    target = load_target(tmp_path / "orig")
    save_target(target, None, tmp_path / "copy")
    again = load_target(tmp_path / "copy")
    layout = [target.config.window_of(i) for i in range(2)]
    assert [again.config.window_of(i) for i in range(2)] == layout == (
        [None, None] if types == "null" else [5, None] if types else [5, 5])
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "copy").eval()
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "orig").eval()
    ids = torch.randint(0, 300, (1, T), generator=torch.Generator().manual_seed(9))
    assert (back(ids).logits - ref(ids).logits).abs().max().item() <= TOL
    assert (again.logits(again(ids)) - ref(ids).logits).abs().max().item() <= TOL


@pytest.mark.parametrize("fields", [
    {"rope_theta": 1e6, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},  # the dict's wins
    {"original_max_position_embeddings": 32, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                                                 "original_max_position_embeddings": 128}},
    {"original_max_position_embeddings": 256, "rope_parameters": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "rope_theta": 5e5,
        "original_max_position_embeddings": 64}},  # the top-level field wins (transformers 5, for Phi-3)
    # DeepSeek-style YaRN: `factor: null` is max_position_embeddings / the pretraining length
    {"max_position_embeddings": 512, "rope_parameters": {"rope_type": "yarn", "factor": None, "rope_theta": 1e4,
                                                         "original_max_position_embeddings": 64}},
    {"max_position_embeddings": 512, "original_max_position_embeddings": 128,
     "rope_parameters": {"rope_type": "yarn", "factor": None, "rope_theta": 1e4, "mscale": 1.0,
                         "mscale_all_dim": 0.5}},
    {"rope_scaling": {"rope_type": "linear", "factor": 4.0}, "rope_theta": 500.0,
     "rope_parameters": {"rope_type": "default", "rope_theta": 50.0}},  # rope_scaling wins over rope_parameters
])
def test_rope_settings_given_twice_resolve_as_in_transformers(transformers, make_hf_model, edit_config, tmp_path,
                                                              fields):
    folder = tmp_path / "m"
    make_hf_model("llama").save_pretrained(folder)
    edit_config(folder, **{"rope_scaling": None, **fields})
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).model.rotary_emb
    mine = load_target(folder).rotary
    assert torch.allclose(mine.inv_freq.float(), ref.inv_freq.float(), rtol=1e-6, atol=0)
    assert mine.scale == pytest.approx(float(ref.attention_scaling))


@pytest.mark.parametrize("rope", [
    None, {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 16, "beta_slow": 2,
     "mscale": 0.8, "mscale_all_dim": 0.5, "truncate": False},
])
def test_rope_cos_sin_equal_transformers_bit_for_bit(transformers, make_hf_model, edit_config, tmp_path, rope):
    """RoPE is computed in float32 as transformers does: cos/sin at positions up to 8k equal HF's exactly, in
    float32 and bfloat16 (float64 frequencies were 7e-4 off at 8k in float32, and rounded differently in bf16)."""
    folder = tmp_path / "m"
    make_hf_model("llama").save_pretrained(folder)
    edit_config(folder, rope_scaling=rope, rope_theta=5e5)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).model.rotary_emb
    mine = load_target(folder).rotary
    assert torch.equal(mine.inv_freq, ref.inv_freq)
    pos = torch.arange(8192)[None]
    for dtype in (torch.float32, torch.bfloat16):
        cos, sin = mine(pos, dtype)
        want_cos, want_sin = ref(torch.zeros(1, dtype=dtype), pos)
        assert torch.equal(cos[:, :, 0], want_cos) and torch.equal(sin[:, :, 0], want_sin), dtype


def test_a_dtype_cast_of_the_model_keeps_float32_rope_frequencies():
    """model.to(torch.bfloat16) casts buffers; the frequencies stay float32 (bf16 ones are off by up to 0.4%)."""
    exact = build_random_tiny(dtype="float32").target.rotary.inv_freq
    for dtype in ("bfloat16", "float16", "float64"):
        rotary = build_random_tiny(dtype=dtype).target.rotary
        assert rotary.inv_freq.dtype == torch.float32 and torch.equal(rotary.inv_freq, exact), dtype


@torch.no_grad()
@pytest.mark.parametrize("types", [["sliding_attention", "full_attention"], ["full_attention", "full_attention"]])
def test_a_mistral_config_with_layer_types_slides_only_the_layers_it_names(transformers, make_hf_model, edit_config,
                                                                          tmp_path, types):
    """transformers loads a `mistral` config that has layer_types as Ministral (Ministral-8B alternates sliding and
    full layers): the window applies to the sliding_attention layers only. specpipe slid every layer, so its
    tokens differed from the first one on prompts longer than the window."""
    make_hf_model("mistral_window").save_pretrained(tmp_path)
    edit_config(tmp_path, layer_types=types)
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 300, (2, T), generator=torch.Generator().manual_seed(1))
    ref = ref_model(ids).logits.float()
    target = load_target(tmp_path)
    assert [target.config.window_of(i) for i in range(2)] == [5 if t == "sliding_attention" else None for t in types]
    assert (target.logits(target(ids)) - ref).abs().max().item() <= TOL
    assert (_pool_logits(target, ids, [7, 3]) - ref).abs().max().item() <= TOL
