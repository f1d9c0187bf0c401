"""Loader round trips and the CheckpointError messages (file + field / tensor) of broken folders."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specpipe.models.eagle import EagleHead
from specpipe.models.hf.config import parse_config
from specpipe.models.hf.errors import CheckpointError
from specpipe.models.hf.load import load_draft, load_hf, load_target, load_tiny
from specpipe.models.hf.save import save_eagle, save_target
from specpipe.models.random_tiny import build_random_tiny
from specpipe.workload.tokenizer import ByteTokenizer, HFTokenizer


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(pair, target folder, EAGLE head folder) written by save_target / save_eagle."""
    pair = build_random_tiny()
    root = tmp_path_factory.mktemp("saved")
    save_target(pair.target, pair.tokenizer, root / "target")
    save_eagle(pair.draft, root / "eagle")
    return pair, root / "target", root / "eagle"


@pytest.fixture
def target_copy(saved, tmp_path):
    return shutil.copytree(saved[1], tmp_path / "target")


def _raises(fn, *parts: str) -> str:
    with pytest.raises(CheckpointError) as e:
        fn()
    msg = str(e.value)
    for p in parts:
        assert p in msg, f"{p!r} not in: {msg}"
    return msg


@torch.no_grad()
def test_round_trip_target_and_eagle(saved):
    pair, tfolder, efolder = saved
    loaded = load_hf(tfolder, efolder)
    ids = torch.randint(0, 258, (2, 9), generator=torch.Generator().manual_seed(0))
    h = pair.target(ids)
    assert torch.equal(loaded.target(ids), h)
    assert isinstance(loaded.draft, EagleHead) and isinstance(loaded.tokenizer, ByteTokenizer)
    assert torch.equal(loaded.draft.logits(loaded.draft(ids, h)), pair.draft.logits(pair.draft(ids, h)))
    assert loaded.draft.embed_tokens is None and loaded.draft.lm_head is None  # shared from the target


def test_dtype_conversion(saved, tmp_path):
    pair = saved[0]
    save_target(pair.target, pair.tokenizer, tmp_path, dtype="bfloat16")
    t = load_target(tmp_path, dtype="float32")
    assert t.lm_head.weight.dtype == torch.float32
    assert torch.equal(t.lm_head.weight, pair.target.lm_head.weight.to(torch.bfloat16).float())
    assert load_target(tmp_path, dtype=torch.float16).embed_tokens.weight.dtype == torch.float16


def test_missing_config(tmp_path):
    _raises(lambda: load_target(tmp_path / "nope"), "nope", "does not exist")
    _raises(lambda: load_target(tmp_path), str(tmp_path / "config.json"), "not found")
    (tmp_path / "weights.safetensors").write_bytes(b"x")
    _raises(lambda: load_target(tmp_path / "weights.safetensors"), "weights.safetensors is a file, not a folder")


def test_missing_weights(target_copy):
    (target_copy / "model.safetensors").unlink()
    _raises(lambda: load_target(target_copy), str(target_copy / "model.safetensors"), "no weights")


def test_general_pickles_are_refused_unopened(target_copy):
    (target_copy / "model.safetensors").unlink()
    (target_copy / "last.ckpt").write_bytes(b"not really a pickle")  # must never be opened
    _raises(lambda: load_target(target_copy), "last.ckpt", "never general pickles", "execute arbitrary code")


class _Payload:
    """Unpickling this calls Path.touch(marker): what a crafted checkpoint would do with os.system."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_pytorch_state_dicts_load_like_safetensors(saved, target_copy, tmp_path):
    pair, target_dir, eagle_dir = saved
    sd = load_file(target_copy / "model.safetensors")
    (target_copy / "model.safetensors").unlink()
    torch.save(sd, target_copy / "pytorch_model.bin")  # what the original EAGLE repos ship
    ids = torch.randint(0, 250, (1, 9), generator=torch.Generator().manual_seed(3))
    want = load_target(target_dir)
    got = load_target(target_copy)
    assert torch.equal(got.logits(got(ids)), want.logits(want(ids)))
    # sharded: pytorch_model.bin.index.json + shards
    (target_copy / "pytorch_model.bin").unlink()
    keys = sorted(sd)
    parts = {"pytorch_model-00001-of-00002.bin": keys[::2], "pytorch_model-00002-of-00002.bin": keys[1::2]}
    for name, part in parts.items():
        torch.save({k: sd[k] for k in part}, target_copy / name)
    (target_copy / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"weight_map": {k: name for name, part in parts.items() for k in part}}))
    got = load_target(target_copy)
    assert torch.equal(got.logits(got(ids)), want.logits(want(ids)))
    # an EAGLE head folder with pytorch_model.bin
    head = shutil.copytree(eagle_dir, tmp_path / "eagle")
    torch.save(load_file(head / "model.safetensors"), head / "pytorch_model.bin")
    (head / "model.safetensors").unlink()
    a, b = load_draft(head, want), load_draft(eagle_dir, want)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    # a Trainer's checkpoint-N folder: the weights next to its optimizer, scheduler, RNG and arguments files
    trainer = shutil.copytree(target_copy, tmp_path / "checkpoint-500")
    for f in trainer.glob("pytorch_model*"):
        f.unlink()
    torch.save(sd, trainer / "pytorch_model.bin")
    torch.save({"state": {0: {"step": 3}}, "param_groups": []}, trainer / "optimizer.pt")
    torch.save({"python": [1, 2]}, trainer / "rng_state.pth")
    torch.save(_Payload(tmp_path / "pwned"), trainer / "training_args.bin")  # a pickled object, never opened
    got = load_target(trainer)
    assert torch.equal(got.logits(got(ids)), want.logits(want(ids))) and not (tmp_path / "pwned").exists()
    (trainer / "pytorch_model.bin").rename(trainer / "weights.pt")  # any *.pt name: the trainer files still skipped
    got = load_target(trainer)
    assert torch.equal(got.logits(got(ids)), want.logits(want(ids)))


def test_a_crafted_or_broken_pytorch_file_is_refused_without_running_code(target_copy, tmp_path):
    (target_copy / "model.safetensors").unlink()
    marker = tmp_path / "pwned"
    torch.save({"embed_tokens.weight": _Payload(marker)}, target_copy / "pytorch_model.bin")
    msg = _raises(lambda: load_target(target_copy), "pytorch_model.bin", "weights_only=True",
                  "it holds Python objects besides tensors")
    assert "\x1b[" not in msg and "two options" not in msg  # not torch's own advice to load it unsafely
    assert not marker.exists()  # the restricted unpickler never called Path.touch
    (target_copy / "pytorch_model.bin").write_bytes(b"not really a pickle")
    _raises(lambda: load_target(target_copy), "pytorch_model.bin", "cannot be read as a PyTorch state dict")
    torch.save({"state_dict": {"a": torch.zeros(2)}, "epoch": 3}, target_copy / "pytorch_model.bin")
    _raises(lambda: load_target(target_copy), "pytorch_model.bin", "not a flat state dict")


def test_a_general_pickle_is_refused_without_torchs_warning(target_copy, tmp_path):
    """Issue #46: a .pt that is a plain pickle was refused, and torch's UserWarning ("Detected pickle protocol 4
    ...") printed besides the message."""
    import pickle
    import warnings

    (target_copy / "model.safetensors").unlink()
    marker = tmp_path / "pwned"
    (target_copy / "weights.pt").write_bytes(pickle.dumps(_Payload(marker), protocol=4))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        _raises(lambda: load_target(target_copy), "weights.pt", "weights_only=True",
                "it is not a pickle of tensors that the weights-only loader can read")
    assert [str(w.message) for w in said] == [] and not marker.exists()


def test_shape_mismatch(target_copy):
    f = target_copy / "model.safetensors"
    sd = load_file(f)
    sd["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(16, 64)
    save_file(sd, f)
    _raises(lambda: load_target(target_copy), str(f), "model.layers.1.self_attn.k_proj.weight", "[16, 64]",
            "[32, 64]", "num_key_value_heads=2")


def test_missing_and_unexpected_tensor(target_copy):
    f = target_copy / "model.safetensors"
    sd = load_file(f)
    sd["model.layers.0.mlp.extra.weight"] = sd.pop("model.norm.weight")
    save_file(sd, f)
    _raises(lambda: load_target(target_copy), str(f), "'model.norm.weight' is missing")
    sd["model.norm.weight"] = torch.ones(64)
    save_file(sd, f)
    _raises(lambda: load_target(target_copy), str(f), "unexpected tensor 'model.layers.0.mlp.extra.weight'")


def test_quantized_checkpoints_are_refused_by_name(target_copy, edit_config):
    cfg = str(target_copy / "config.json")
    edit_config(target_copy, quantization_config={"quant_method": "awq", "bits": 4})
    _raises(lambda: load_target(target_copy), cfg, "'quantization_config'", "quant_method='awq'", "unquantized")
    edit_config(target_copy, quantization_config=None)
    f = target_copy / "model.safetensors"
    sd = load_file(f)
    sd["model.layers.0.mlp.up_proj.weight"] = torch.zeros_like(sd["model.layers.0.mlp.up_proj.weight"],
                                                               dtype=torch.int8)
    save_file(sd, f)
    _raises(lambda: load_target(target_copy), str(f), "'model.layers.0.mlp.up_proj.weight' holds torch.int8")


def test_config_errors(target_copy, edit_config):
    cfg = str(target_copy / "config.json")
    edit_config(target_copy, architectures=["GPT2LMHeadModel"])
    _raises(lambda: load_target(target_copy), cfg, "'architectures'", "GPT2LMHeadModel", "LlamaForCausalLM")
    edit_config(target_copy, architectures=None, model_type="gemma")  # the model type is the reason, not None
    _raises(lambda: load_target(target_copy), cfg, "field 'model_type' is 'gemma'", "llama, mistral, qwen2")
    edit_config(target_copy, model_type="llama", architectures=["LlamaForCausalLM"],
                rope_scaling={"type": "longrope", "factor": 2.0})  # Phi-3's spelling
    _raises(lambda: load_target(target_copy), cfg, "'rope_scaling.type' is 'longrope'")
    edit_config(target_copy, rope_scaling=None)
    edit_config(target_copy, architectures=["LlamaForCausalLM"], hidden_size=None)
    _raises(lambda: load_target(target_copy), cfg, "'hidden_size' is missing")
    edit_config(target_copy, hidden_size=64, rope_scaling={"rope_type": "longrope", "factor": 2.0})
    _raises(lambda: load_target(target_copy), cfg, "'rope_scaling.rope_type' is 'longrope'", "dynamic, llama3, linear")
    edit_config(target_copy, rope_scaling=None, architectures=["MistralForCausalLM"], mlp_bias=True)
    _raises(lambda: load_target(target_copy), cfg, "'mlp_bias' is true, which mistral models do not have")
    edit_config(target_copy, architectures=["LlamaForCausalLM"], mlp_bias=None, num_key_value_heads=3)
    _raises(lambda: load_target(target_copy), cfg, "'num_key_value_heads' is 3, which does not divide")
    edit_config(target_copy, num_key_value_heads=None, head_dim=7)
    _raises(lambda: load_target(target_copy), cfg, "'head_dim' (or hidden_size / num_attention_heads) is 7")
    edit_config(target_copy, head_dim=None, architectures=["MistralForCausalLM"])  # MistralConfig: 8 KV heads
    _raises(lambda: load_target(target_copy), cfg, "'num_key_value_heads' is 8, which does not divide")
    edit_config(target_copy, num_key_value_heads=2, sliding_window=0)
    msg = _raises(lambda: load_target(target_copy), cfg, "'sliding_window' must be a positive integer, got 0")
    assert "required" not in msg  # null is valid (no window): only an absent required field is "required"
    edit_config(target_copy, architectures=["LlamaForCausalLM"], sliding_window=None)
    edit_config(target_copy, rope_scaling={"rope_type": "yarn", "factor": "4x"})
    _raises(lambda: load_target(target_copy), cfg, "'rope_scaling.factor' must be a positive number, got '4x'")
    edit_config(target_copy, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": "x"})
    _raises(lambda: load_target(target_copy), cfg, "'rope_scaling.low_freq_factor' must be a number, got 'x'")
    edit_config(target_copy, rope_scaling=None, rope_parameters={"rope_type": "default", "rope_theta": "abc"})
    _raises(lambda: load_target(target_copy), cfg, "'rope_parameters.rope_theta' must be a positive number")
    edit_config(target_copy, rope_parameters=None, rope_theta=-5.0)  # NaN logits at every request before
    _raises(lambda: load_target(target_copy), cfg, "'rope_theta' must be a positive number, got -5.0")
    edit_config(target_copy, rope_theta=None, architectures=["Qwen2ForCausalLM"], use_sliding_window=True,
                sliding_window=16, max_window_layers="1")
    _raises(lambda: load_target(target_copy), cfg, "'max_window_layers' must be an integer >= 0, got '1'")
    n = json.loads((target_copy / "config.json").read_text())["num_hidden_layers"]
    edit_config(target_copy, max_window_layers=None, layer_types=["full_attention"] * (n - 1) + ["chunked_attention"])
    _raises(lambda: load_target(target_copy), cfg, "'layer_types' holds 'chunked_attention'")
    edit_config(target_copy, architectures=["LlamaForCausalLM"], use_sliding_window=None, sliding_window=None,
                layer_types=None)
    edit_config(target_copy, rope_scaling=None, rms_norm_eps="x")  # before: a ValueError deep in a float()
    _raises(lambda: load_target(target_copy), cfg, "'rms_norm_eps' must be a positive number, got 'x'")
    edit_config(target_copy, rms_norm_eps=None, max_position_embeddings="4k")
    _raises(lambda: load_target(target_copy), cfg, "'max_position_embeddings' must be a positive integer, got '4k'")
    edit_config(target_copy, max_position_embeddings=None, eos_token_id=[2, "</s>"])
    _raises(lambda: load_target(target_copy), cfg, "'eos_token_id' must be a token id", "[2, '</s>']")
    (target_copy / "config.json").write_text("{not json")
    _raises(lambda: load_target(target_copy), cfg, "not valid JSON")
    (target_copy / "config.json").write_text("[1, 2]")  # issue #46: called "not valid JSON"
    msg = _raises(lambda: load_target(target_copy), cfg, "valid JSON, but its top level is an array, not an object")
    assert "not valid JSON" not in msg


def test_missing_shard(target_copy):
    (target_copy / "model.safetensors").rename(target_copy / "model-00001-of-00002.safetensors")
    (target_copy / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}')
    _raises(lambda: load_target(target_copy), "model.safetensors.index.json", "model-00002-of-00002.safetensors")
    (target_copy / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a": "model-00001-of-00002.safetensors", "b": 2}}')  # was a TypeError from Path / int
    _raises(lambda: load_target(target_copy), "model.safetensors.index.json", "maps 'b' to 2")


def test_tokenizers(target_copy, edit_config):
    from tokenizers import Tokenizer, models

    edit_config(target_copy, specpipe_tokenizer=None)
    _raises(lambda: load_hf(target_copy), "tokenizer.json", "specpipe_tokenizer")
    Tokenizer(models.WordLevel({"[unk]": 0, "hi": 1}, unk_token="[unk]")).save(str(target_copy / "tokenizer.json"))
    tok = load_hf(target_copy).tokenizer
    assert isinstance(tok, HFTokenizer) and tok.eos_token_id == 257
    edit_config(target_copy, specpipe_tokenizer={"type": "sentencepiece"})
    _raises(lambda: load_hf(target_copy), "'specpipe_tokenizer'", "sentencepiece")
    edit_config(target_copy, specpipe_tokenizer=None)
    text = (target_copy / "tokenizer.json").read_text()
    (target_copy / "tokenizer.json").write_text(text[:len(text) // 2])  # cut short, as by a failed download
    _raises(lambda: load_hf(target_copy), str(target_copy / "tokenizer.json"), "not a tokenizer file",
            "EOF while parsing")


def test_eagle_head_errors(saved, tmp_path, edit_config):
    pair, _, efolder = saved
    head = shutil.copytree(efolder, tmp_path / "eagle")
    edit_config(head, vocab_size=300)
    _raises(lambda: load_draft(head, pair.target), str(head / "config.json"), "'vocab_size' is 300", "258")
    edit_config(head, vocab_size=258)
    f = head / "model.safetensors"
    sd = load_file(f)
    sd["fc.weight"] = torch.zeros(64, 64)
    sd["embed_tokens.weight"] = torch.zeros(258, 64)  # an own embedding is fine
    save_file(sd, f)
    _raises(lambda: load_draft(head, pair.target), str(f), "'fc.weight'", "[64, 64]", "[64, 128]")
    sd["fc.weight"] = torch.zeros(64, 128)
    sd["layers.0.post_feedforward_layernorm.weight"] = torch.ones(64)  # a Gemma-style norm: no Llama layer has it
    save_file(sd, f)
    _raises(lambda: load_draft(head, pair.target), "unexpected tensor 'layers.0.post_feedforward_layernorm.weight'")
    del sd["layers.0.post_feedforward_layernorm.weight"]
    save_file(sd, f)
    assert load_draft(head, pair.target).embed_tokens is not None


def test_parse_config_variants():
    base = dict(vocab_size=300, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=96)
    f = Path("x/config.json")
    rope = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64}
    v4 = parse_config({**base, "architectures": ["LlamaForCausalLM"], "rope_theta": 5e5, "rope_scaling": rope}, f)
    v5 = parse_config({**base, "model_type": "llama", "rope_parameters": {**rope, "rope_theta": 5e5}}, f)
    assert v4.rope_theta == v5.rope_theta == 5e5 and v4.rope_scaling == v5.rope_scaling == rope
    assert v4.num_key_value_heads == 4 and v4.head_dim == 16 and not v4.attention_bias
    qwen = parse_config({**base, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True,
                         "sliding_window": 8, "max_window_layers": 2, "eos_token_id": [7, 9]}, f)
    assert qwen.attention_bias and [qwen.window_of(i) for i in range(4)] == [None, None, 8, 8]
    assert qwen.eos_token_id == 7 and qwen.extra["eos_token_ids"] == [7, 9]
    qwen_off = parse_config({**base, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 8}, f)
    assert qwen_off.sliding_window is None
    mistral = parse_config({**base, "architectures": ["MistralForCausalLM"], "sliding_window": 8,
                            "num_key_value_heads": 2}, f)
    assert [mistral.window_of(i) for i in range(4)] == [8] * 4
    bare = parse_config({**base, "num_attention_heads": 16, "architectures": ["MistralForCausalLM"]}, f)
    assert bare.num_key_value_heads == 8 and bare.sliding_window == 4096  # MistralConfig's defaults
    assert parse_config({**base, "num_attention_heads": 16, "architectures": ["MistralForCausalLM"],
                         "sliding_window": None}, f).sliding_window is None
    # llama3 / yarn without original_max_position_embeddings: the top-level field, else max_position_embeddings
    no_ctx = {"rope_type": "yarn", "factor": 4.0}
    top = parse_config({**base, "architectures": ["LlamaForCausalLM"], "rope_scaling": no_ctx,
                        "original_max_position_embeddings": 32, "max_position_embeddings": 128}, f)
    assert top.rope_scaling["original_max_position_embeddings"] == 32
    ctx = parse_config({**base, "architectures": ["LlamaForCausalLM"], "rope_scaling": no_ctx,
                        "max_position_embeddings": 128}, f)
    assert ctx.rope_scaling["original_max_position_embeddings"] == 128
    # max_position_embeddings absent: each family's transformers default (it bounds prompt plus output here)
    for arch, n in (("LlamaForCausalLM", 2048), ("MistralForCausalLM", 131072), ("Qwen2ForCausalLM", 32768),
                    ("Qwen3ForCausalLM", 32768)):
        assert parse_config({**base, "architectures": [arch], "num_key_value_heads": 4}, f).max_position_embeddings \
            == n, arch
    bare_llama3 = parse_config({**base, "architectures": ["LlamaForCausalLM"], "rope_scaling": no_ctx}, f)
    assert bare_llama3.rope_scaling["original_max_position_embeddings"] == 2048  # was refused as missing
    # attention biases: Qwen2 q/k/v only; Llama and Qwen3 attention_bias adds o_proj's; Qwen3 q/k norms
    llama_b = parse_config({**base, "architectures": ["LlamaForCausalLM"], "attention_bias": True}, f)
    assert llama_b.attention_bias and llama_b.o_proj_bias and not llama_b.qk_norm
    assert not qwen.o_proj_bias and not qwen.qk_norm
    qwen3 = parse_config({**base, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32}, f)
    assert qwen3.qk_norm and not qwen3.attention_bias and not qwen3.o_proj_bias and qwen3.head_dim == 32
    # head_dim absent: Qwen3Config's default is 128 (not hidden / heads, which Llama, Mistral and Qwen2 use)
    assert parse_config({**base, "architectures": ["Qwen3ForCausalLM"]}, f).head_dim == 128
    assert parse_config({**base, "architectures": ["Qwen2ForCausalLM"]}, f).head_dim == \
        base["hidden_size"] // base["num_attention_heads"]


def test_partial_rotary_factor_null_is_absent_and_anything_but_one_is_refused(tmp_path):
    """transformers loads `"partial_rotary_factor": null` as absent; specpipe called float() on it (a TypeError,
    exit 1, Hydra's wrapper text) and on a string (ValueError)."""
    f = tmp_path / "config.json"
    base = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "architectures": ["LlamaForCausalLM"]}
    for ok in (None, 1.0, 1):
        assert parse_config({**base, "partial_rotary_factor": ok}, f).head_dim == 16
        assert parse_config({**base, "rope_parameters": {"rope_type": "default", "partial_rotary_factor": ok}}, f)
    for bad, says in (("half", "must be a positive number, got 'half'"), ([1], "got [1]"), (0.5, "is 0.5"),
                      (0, "must be a positive number, got 0")):
        with pytest.raises(CheckpointError, match=re.escape(says)) as e:
            parse_config({**base, "partial_rotary_factor": bad}, f)
        assert "partial_rotary_factor" in str(e.value)
    with pytest.raises(CheckpointError, match="rope_parameters.partial_rotary_factor"):
        parse_config({**base, "rope_parameters": {"rope_type": "default", "partial_rotary_factor": "x"}}, f)


def test_load_tiny_assets():
    try:
        pair = load_tiny()
    except CheckpointError as e:  # the trained pair is not built in this checkout
        assert "train_tiny.py" in str(e)
    else:
        assert pair.name == "tiny" and pair.draft is not None


def bos_wordlevel_tokenizer(path: Path) -> None:
    """A tokenizer.json whose post-processor adds BOS, as Llama's does."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tok = Tokenizer(models.WordLevel({"[unk]": 0, "hi": 1, "there": 2, "<s>": 3, "</s>": 4, "<eot>": 5},
                                     unk_token="[unk]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 3)])
    tok.save(str(path))


def test_prompts_get_the_special_tokens_transformers_adds(target_copy, edit_config, transformers):
    edit_config(target_copy, specpipe_tokenizer=None)
    bos_wordlevel_tokenizer(target_copy / "tokenizer.json")
    tok = load_hf(target_copy).tokenizer
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(target_copy / "tokenizer.json"))
    for text in ["hi there", "there hi hi", ""]:
        assert tok.encode(text) == hf(text).input_ids  # BOS first, as tokenizer(prompt) gives it
    assert tok.encode("hi there") == [3, 1, 2]


def test_the_eos_ids_hf_generate_stops_at(target_copy, edit_config):
    """generation_config.json's ids where it names some (HF generate reads only them then), else config.json's."""
    import json

    from specpipe.workload.tokenizer import stop_token_ids

    edit_config(target_copy, specpipe_tokenizer=None, eos_token_id=[4, 6])
    bos_wordlevel_tokenizer(target_copy / "tokenizer.json")
    (target_copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [4, 5], "bos_token_id": 3}))
    tok = load_hf(target_copy).tokenizer
    assert tok.eos_token_id == 4 and stop_token_ids(tok) == (4, 5)
    (target_copy / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert stop_token_ids(load_hf(target_copy).tokenizer) == (5,)
    (target_copy / "generation_config.json").write_text(json.dumps({"temperature": 0.7}))
    assert stop_token_ids(load_hf(target_copy).tokenizer) == (4, 6)
    (target_copy / "generation_config.json").write_text(json.dumps({"eos_token_id": ["</s>"]}))
    _raises(lambda: load_hf(target_copy), "generation_config.json", "eos_token_id", "'</s>'")
    (target_copy / "generation_config.json").write_text("{broken")
    _raises(lambda: load_hf(target_copy), "generation_config.json", "not a valid generation config")


@torch.no_grad()
def test_a_stored_lm_head_that_differs_from_tied_embeddings_is_used(saved, target_copy, edit_config):
    """tie_word_embeddings=true, but the file holds its own, different lm_head: transformers 5 keeps it untied."""
    ids = torch.randint(0, 250, (1, 9), generator=torch.Generator().manual_seed(3))
    want = load_target(saved[1])
    edit_config(target_copy, tie_word_embeddings=True)
    got = load_target(target_copy)
    assert not got.config.tie_word_embeddings and got.lm_head.weight.data_ptr() != got.embed_tokens.weight.data_ptr()
    assert torch.equal(got.logits(got(ids)), want.logits(want(ids)))
    sd = load_file(target_copy / "model.safetensors")
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()  # the same values stored twice: tied
    save_file(sd, target_copy / "model.safetensors")
    tied = load_target(target_copy)
    assert tied.config.tie_word_embeddings and tied.lm_head.weight is tied.embed_tokens.weight


def test_generation_settings_specpipe_does_not_apply_are_named(target_copy, edit_config, capsys):
    """repetition_penalty & co. change HF generate's greedy output: loading says so, metrics record it."""
    edit_config(target_copy, specpipe_tokenizer=None)
    bos_wordlevel_tokenizer(target_copy / "tokenizer.json")
    (target_copy / "generation_config.json").write_text(json.dumps(
        {"repetition_penalty": 1.05, "no_repeat_ngram_size": 0, "temperature": 0.7, "num_beams": 1}))
    pair = load_hf(target_copy)
    assert pair.target.config.extra["unapplied_generation_settings"] == {"repetition_penalty": 1.05}
    assert "sets repetition_penalty=1.05, which specpipe does not apply" in capsys.readouterr().err
    (target_copy / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.0, "top_k": 20}))
    assert "unapplied_generation_settings" not in load_hf(target_copy).target.config.extra
    assert "note" not in capsys.readouterr().err
    (target_copy / "generation_config.json").write_text(json.dumps({"typical_p": 0.9, "min_p": 0.1}))
    assert load_hf(target_copy).target.config.extra["unapplied_generation_settings"] == {"typical_p": 0.9}
    assert "typical_p=0.9, which specpipe does not apply (HF generate does when sampling)" in capsys.readouterr().err
