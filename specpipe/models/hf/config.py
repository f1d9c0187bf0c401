"""Read and check a model folder's config.json into a :class:`LlamaConfig` (Llama / Mistral / Qwen2 / Qwen3
targets and EAGLE heads), with Hugging Face's defaults per family. Every problem raises a one-paragraph
:class:`CheckpointError` naming the file and the field.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from specpipe.config.schema import is_int
from specpipe.models.hf.errors import CheckpointError
from specpipe.models.llama import LlamaConfig

TARGET_ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                "Qwen3ForCausalLM": "qwen3"}


def read_config(folder: str | Path) -> dict:
    """The parsed ``config.json`` of a model folder."""
    file = Path(folder) / "config.json"
    if not file.is_file():
        why = "file not found" if file.parent.is_dir() else (
            f"{file.parent} is a file, not a folder (give the folder that holds it)" if file.parent.exists()
            else f"the folder {file.parent} does not exist")
        raise CheckpointError(f"{file}: {why}; a model folder needs config.json (the Hugging Face model config) "
                              f"next to its safetensors weights")
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):  # valid JSON, but a list or a number is no set of settings
        kind = {list: "an array", str: "a string", bool: "true or false", type(None): "null"}.get(type(raw), "a number")
        raise CheckpointError(f"{file}: valid JSON, but its top level is {kind}, not an object; config.json holds "
                              f"one {{...}} object of the model's settings (\"architectures\", \"hidden_size\", ...)")
    return raw


def _family(raw: dict, file: Path, draft: bool) -> str:
    """llama | mistral | qwen2 | qwen3, from `architectures` (targets must name a supported one)."""
    arch = (raw.get("architectures") or [None])[0]
    if arch in TARGET_ARCHS:
        return TARGET_ARCHS[arch]
    mt = raw.get("model_type")
    if draft:  # EAGLE heads name e.g. LlamaForCausalLMEagle3 or nothing at all
        name = f"{arch} {mt}".lower()
        return "qwen2" if "qwen2" in name else "mistral" if "mistral" in name else "llama"
    if arch is None and mt in TARGET_ARCHS.values():
        return mt
    if "eagle" in str(arch).lower() or "eagle_config" in raw or "speculators_model_type" in raw:
        raise CheckpointError(f"{file}: field 'architectures' is {raw.get('architectures')!r}: an EAGLE draft head, "
                              f"not a whole model; give its folder as draft.path with draft=eagle (model.path, and "
                              f"draft.path of draft=standalone, take a causal LM: {', '.join(TARGET_ARCHS)})")
    if arch is None and mt is not None:  # the model type is what says which model this is
        raise CheckpointError(f"{file}: field 'model_type' is {mt!r} (and 'architectures' is missing), a model "
                              f"specpipe cannot load (valid: {', '.join(TARGET_ARCHS.values())}; architectures "
                              f"{', '.join(TARGET_ARCHS)})")
    raise CheckpointError(f"{file}: field 'architectures' is {raw.get('architectures')!r}, an architecture specpipe "
                          f"cannot load (valid: {', '.join(TARGET_ARCHS)})")


def int_field(raw: dict, key: str, file: Path, default: Optional[int] = None, name: Optional[str] = None) -> int:
    """A positive integer field (`default` when absent); anything else is a CheckpointError naming it."""
    v = raw.get(key, default)
    if not is_int(v) or v <= 0:
        what = "required field '{}' is missing" if v is None else f"field '{{}}' must be a positive integer, got {v!r}"
        raise CheckpointError(f"{file}: " + what.format(name or key))
    return v


def _number(raw: dict, key: str, file: Path, default: Optional[float] = None, name: Optional[str] = None,
            positive: bool = False) -> Optional[float]:
    """A finite number (positive when asked), or `default` when absent; a string or a list would fail far from
    its cause."""
    v = raw.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not -float("inf") < v < float("inf") \
            or (positive and v <= 0):
        raise CheckpointError(f"{file}: field '{name or key}' must be a {'positive ' if positive else ''}number, "
                              f"got {v!r}")
    return float(v)


def _positive_number(raw: dict, key: str, file: Path, default: float, name: Optional[str] = None) -> float:
    return _number(raw, key, file, default, name, positive=True)


ROPE_NUMBERS = ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "attention_factor",
                "mscale", "mscale_all_dim")


def _token_id(raw: dict, key: str, file: Path):
    """An id or a list of ids (eos), or None; anything else would fail later, far from its cause."""
    v = raw.get(key)
    ids = v if isinstance(v, list) else [v]
    if v is not None and not all(is_int(t) and t >= 0 for t in ids):
        raise CheckpointError(f"{file}: field '{key}' must be a token id (an integer >= 0) or a list of them, "
                              f"got {v!r}")
    return v


ROPE_TYPES = ("default", "dynamic", "llama3", "linear", "yarn")


MAX_POSITIONS = {"llama": 2048, "mistral": 131072, "qwen2": 32768, "qwen3": 32768}  # transformers' defaults


def _rope(raw: dict, file: Path, max_positions: int) -> tuple[float, Optional[dict]]:
    """(rope_theta, rope_scaling) from v4 fields (rope_theta, rope_scaling) or v5 `rope_parameters`.

    Dynamic NTK scaling (transformers recomputes the frequencies once a sequence passes
    max_position_embeddings) is the default RoPE up to that length, the most specpipe lets a request use.

    llama3 and yarn take original_max_position_embeddings from the top level of config.json, else from
    max_position_embeddings, when the RoPE dict does not name it (as transformers does)."""
    key = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"  # transformers 5: rope_scaling wins
    rp = raw.get(key) or {}
    if not isinstance(rp, dict) or any(isinstance(v, dict) for v in rp.values()):
        raise CheckpointError(f"{file}: field '{key}' must be one dict of RoPE settings (per-layer-type RoPE "
                              f"is not supported), got {rp!r}")
    # transformers 5 fills rope_parameters' rope_theta from the top level only when the dict lacks one
    theta = _positive_number(rp, "rope_theta", file, 0.0, f"{key}.rope_theta") or \
        _positive_number(raw, "rope_theta", file, 10000.0)
    kind = rp.get("rope_type", rp.get("type", "default"))
    if kind not in ROPE_TYPES:
        named = "rope_type" if "rope_type" in rp else "type"  # Phi-3 and older configs say `type`
        raise CheckpointError(f"{file}: field '{key}.{named}' is {kind!r}, which specpipe does not implement "
                              f"(valid: {', '.join(ROPE_TYPES)})")
    factor = rp.get("factor")
    derived = kind == "yarn" and "factor" in rp and factor is None  # DeepSeek-style: set from the lengths below
    if kind != "default" and not derived and (
            not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 0):
        what = "is missing" if factor is None else f"must be a positive number, got {factor!r}"
        raise CheckpointError(f"{file}: field '{key}.factor' {what} (required for rope_type {kind!r})")
    # null is absent, as in transformers (the top-level field wins over the RoPE dict's)
    partial = _positive_number(raw, "partial_rotary_factor", file, None) or \
        _positive_number(rp, "partial_rotary_factor", file, 1.0, f"{key}.partial_rotary_factor")
    if partial != 1.0:
        raise CheckpointError(f"{file}: field 'partial_rotary_factor' is {partial:g}; it must be 1.0 (partial RoPE, "
                              f"rotating only part of each head, is not supported)")
    if kind in ("default", "dynamic"):  # dynamic NTK only rescales beyond max_position_embeddings, which
        return theta, None               # requests may not pass (make_requests): it is the default RoPE here
    scaling = {k: v for k, v in rp.items() if k != "rope_theta"}
    for name in ROPE_NUMBERS:
        _number(scaling, name, file, name=f"{key}.{name}")
    if kind in ("llama3", "yarn"):  # the pretraining length: transformers 5 lets a top-level field win over the
        # dict's (Phi-3 saves it there), and falls back to max_position_embeddings
        orig = "original_max_position_embeddings"
        scaling[orig] = int_field(raw, orig, file) if raw.get(orig) is not None else \
            int_field(scaling, orig, file, name=f"{key}.{orig}") if scaling.get(orig) is not None else \
            max_positions
    if derived:  # transformers 5: a yarn `factor: null` is max_position_embeddings / the pretraining length
        scaling["factor"] = max_positions / scaling[orig]
    return theta, scaling


def _window(raw: dict, family: str, layers: int, file: Path) -> tuple[Optional[int], Optional[list]]:
    """(sliding_window, layer_types) with Hugging Face's semantics for each family."""
    if family == "mistral":  # HF Mistral applies the window to every layer; MistralConfig's default is 4096
        none = raw.get("sliding_window", 4096) is None  # an explicit null: no window
        window = None if none else int_field(raw, "sliding_window", file, 4096)
        if raw.get("layer_types") is None or window is None:
            return window, None
        # with layer_types, transformers loads a mistral config as Ministral: the window applies to the layers
        # that list sliding_attention only (Ministral-8B alternates them)
        types = _layer_types(raw["layer_types"], layers, file)
        return (window, types) if "sliding_attention" in types else (None, None)
    if family not in ("qwen2", "qwen3") or not raw.get("use_sliding_window") or raw.get("sliding_window") is None:
        return None, None
    first = raw.get("max_window_layers", 28)
    if not is_int(first) or first < 0:
        raise CheckpointError(f"{file}: field 'max_window_layers' must be an integer >= 0, got {first!r}")
    types = _layer_types(raw.get("layer_types") or ["sliding_attention" if i >= first else "full_attention"
                                                    for i in range(layers)], layers, file)
    if "sliding_attention" not in types:
        return None, None
    return int_field(raw, "sliding_window", file), types


def _layer_types(types, layers: int, file: Path) -> list:
    """config.json's layer_types, checked: one 'full_attention' or 'sliding_attention' per layer."""
    if not isinstance(types, list) or len(types) != layers:
        raise CheckpointError(f"{file}: field 'layer_types' has {len(types) if isinstance(types, list) else types!r} "
                              f"entries but num_hidden_layers={layers}")
    odd = next((t for t in types if t not in ("sliding_attention", "full_attention")), None)
    if odd is not None:
        raise CheckpointError(f"{file}: field 'layer_types' holds {odd!r}; specpipe implements 'full_attention' and "
                              f"'sliding_attention' layers")
    return list(types)


def parse_config(raw: dict, file: Path, draft: bool = False) -> LlamaConfig:
    """A :class:`LlamaConfig` from a Llama / Mistral / Qwen2 / Qwen3 (or EAGLE head) ``config.json`` dict."""
    family = _family(raw, file, draft)
    quant = raw.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else quant
        raise CheckpointError(f"{file}: field 'quantization_config' says this checkpoint is quantized "
                              f"(quant_method={method!r}); specpipe loads unquantized weights (float32, bfloat16 or "
                              f"float16 safetensors). Use the model's unquantized release, or dequantize it with "
                              f"transformers (from_pretrained, then save_pretrained) first")
    if raw.get("hidden_act", "silu") not in ("silu", "swish"):
        raise CheckpointError(f"{file}: field 'hidden_act' is {raw['hidden_act']!r} (only silu is supported)")
    if raw.get("mlp_bias") and family != "llama":
        raise CheckpointError(f"{file}: field 'mlp_bias' is true, which {family} models do not have (Llama's only)")
    # Qwen2: q/k/v biases always, no o_proj bias; Llama and Qwen3: attention_bias puts a bias on all four
    qkv_bias = family == "qwen2" or (family in ("llama", "qwen3") and bool(raw.get("attention_bias")))
    o_bias = family in ("llama", "qwen3") and bool(raw.get("attention_bias"))
    layers = int_field(raw, "num_hidden_layers", file, 1 if draft else None)
    heads = int_field(raw, "num_attention_heads", file)
    # HF's defaults when absent (MistralConfig's is 8); an explicit null is num_attention_heads in every family
    kv_heads = heads if "num_key_value_heads" in raw and raw["num_key_value_heads"] is None else \
        int_field(raw, "num_key_value_heads", file, 8 if family == "mistral" else heads)
    if heads % kv_heads:
        raise CheckpointError(f"{file}: field 'num_key_value_heads' is {kv_heads}, which does not divide "
                              f"num_attention_heads={heads} (grouped-query attention shares each KV head among "
                              f"a whole number of query heads)")
    hidden = int_field(raw, "hidden_size", file)
    # transformers' defaults when config.json has none: Qwen3Config's head_dim is 128, the others derive it
    head_dim = raw.get("head_dim") if raw.get("head_dim") is not None else 128 if family == "qwen3" else \
        hidden // heads
    if not is_int(head_dim) or head_dim < 2 or head_dim % 2:
        raise CheckpointError(f"{file}: field 'head_dim' (or hidden_size / num_attention_heads) is {head_dim!r}; "
                              f"RoPE needs a positive even head dimension")
    # absent or null: the family's transformers default (LlamaConfig 2048, MistralConfig 131072, Qwen 32768)
    max_positions = int_field(raw, "max_position_embeddings", file) if raw.get("max_position_embeddings") \
        is not None else MAX_POSITIONS.get(family, 4096)
    theta, scaling = _rope(raw, file, max_positions)
    window, types = _window(raw, family, layers, file)
    eos = _token_id(raw, "eos_token_id", file)
    extra = {"architecture": (raw.get("architectures") or [None])[0], "family": family, "source": str(file.parent)}
    if isinstance(eos, list):
        extra["eos_token_ids"], eos = eos, (eos[0] if eos else None)
    if family == "llama" and not draft and is_int(raw.get("sliding_window")) and raw["sliding_window"] > 0:
        extra["unapplied_sliding_window"] = raw["sliding_window"]  # load_hf says so
    return LlamaConfig(
        vocab_size=int_field(raw, "vocab_size", file), hidden_size=hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        intermediate_size=int_field(raw, "intermediate_size", file), head_dim=head_dim,
        rms_norm_eps=_positive_number(raw, "rms_norm_eps", file, 1e-6), rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)), attention_bias=qkv_bias,
        o_proj_bias=o_bias, qk_norm=family == "qwen3", mlp_bias=bool(raw.get("mlp_bias")),
        sliding_window=window, layer_types=types, bos_token_id=_token_id(raw, "bos_token_id", file), eos_token_id=eos,
        extra=extra)
