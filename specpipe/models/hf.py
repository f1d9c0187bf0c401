"""Load Llama / Mistral / Qwen2 / Qwen3 targets and EAGLE heads from Hugging Face folders.

A folder holds config.json and model.safetensors (or model.safetensors.index.json + shards); keys
lose their leading ``model.``. Folders with only PyTorch weights (pytorch_model.bin, or its index and
shards, as the original EAGLE heads ship) are read with ``torch.load(weights_only=True)``: torch's
restricted unpickler, which builds tensors and plain containers and refuses any other object (so a
crafted file cannot run code), the same rule HF transformers applies. Models are built on the meta
device and the checkpoint tensors are assigned (no random init). Problems raise a one-paragraph :class:`CheckpointError` naming the file
and the field or tensor.
"""
from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open
from torch import Tensor, nn

from specpipe.models.llama import LlamaConfig, LlamaForCausalLM, Rotary
from specpipe.models.hf_save import config_to_hf, save_eagle, save_target, to_dtype  # noqa: F401  (public API)
from specpipe.models.pair import ModelPair
from specpipe.errors import SpecpipeError
from specpipe.schema import is_int, sampling_problem

TARGET_ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                "Qwen3ForCausalLM": "qwen3"}
TORCH_SUFFIXES = (".bin", ".pt", ".pth")  # read with torch.load(weights_only=True)
PICKLE_SUFFIXES = (".ckpt", ".pkl")  # training checkpoints / arbitrary pickles: never opened


class CheckpointError(SpecpipeError, ValueError):
    """A model folder that cannot be loaded; the message names the file and the field or tensor."""


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
        assert isinstance(raw, dict), "expected a JSON object at the top level"
    except (json.JSONDecodeError, UnicodeDecodeError, AssertionError) as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from None
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
        raise CheckpointError(f"{file}: field 'architectures' is {raw.get('architectures')!r}: an EAGLE draft head, not "
                              f"a whole model; give its folder as draft.path with draft=eagle (model.path, and "
                              f"draft.path of draft=standalone, take a causal LM: {', '.join(TARGET_ARCHS)})")
    if arch is None and mt is not None:  # the model type is what says which model this is
        raise CheckpointError(f"{file}: field 'model_type' is {mt!r} (and 'architectures' is missing), a model "
                              f"specpipe cannot load (valid: {', '.join(TARGET_ARCHS.values())}; architectures "
                              f"{', '.join(TARGET_ARCHS)})")
    raise CheckpointError(f"{file}: field 'architectures' is {raw.get('architectures')!r}, an architecture specpipe "
                          f"cannot load (valid: {', '.join(TARGET_ARCHS)})")


def _int_field(raw: dict, key: str, file: Path, default: Optional[int] = None, name: Optional[str] = None) -> int:
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
        scaling[orig] = _int_field(raw, orig, file) if raw.get(orig) is not None else \
            _int_field(scaling, orig, file, name=f"{key}.{orig}") if scaling.get(orig) is not None else \
            max_positions
    if derived:  # transformers 5: a yarn `factor: null` is max_position_embeddings / the pretraining length
        scaling["factor"] = max_positions / scaling[orig]
    return theta, scaling


def _window(raw: dict, family: str, layers: int, file: Path) -> tuple[Optional[int], Optional[list]]:
    """(sliding_window, layer_types) with Hugging Face's semantics for each family."""
    if family == "mistral":  # HF Mistral applies the window to every layer; MistralConfig's default is 4096
        none = raw.get("sliding_window", 4096) is None  # an explicit null: no window
        window = None if none else _int_field(raw, "sliding_window", file, 4096)
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
    return _int_field(raw, "sliding_window", file), types


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
    layers = _int_field(raw, "num_hidden_layers", file, 1 if draft else None)
    heads = _int_field(raw, "num_attention_heads", file)
    # HF's defaults when absent (MistralConfig's is 8); an explicit null is num_attention_heads in every family
    kv_heads = heads if "num_key_value_heads" in raw and raw["num_key_value_heads"] is None else \
        _int_field(raw, "num_key_value_heads", file, 8 if family == "mistral" else heads)
    if heads % kv_heads:
        raise CheckpointError(f"{file}: field 'num_key_value_heads' is {kv_heads}, which does not divide "
                              f"num_attention_heads={heads} (grouped-query attention shares each KV head among "
                              f"a whole number of query heads)")
    hidden = _int_field(raw, "hidden_size", file)
    # transformers' defaults when config.json has none: Qwen3Config's head_dim is 128, the others derive it
    head_dim = raw.get("head_dim") if raw.get("head_dim") is not None else 128 if family == "qwen3" else \
        hidden // heads
    if not is_int(head_dim) or head_dim < 2 or head_dim % 2:
        raise CheckpointError(f"{file}: field 'head_dim' (or hidden_size / num_attention_heads) is {head_dim!r}; "
                              f"RoPE needs a positive even head dimension")
    # absent or null: the family's transformers default (LlamaConfig 2048, MistralConfig 131072, Qwen 32768)
    max_positions = _int_field(raw, "max_position_embeddings", file) if raw.get("max_position_embeddings") \
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
        vocab_size=_int_field(raw, "vocab_size", file), hidden_size=hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        intermediate_size=_int_field(raw, "intermediate_size", file), head_dim=head_dim,
        rms_norm_eps=_positive_number(raw, "rms_norm_eps", file, 1e-6), rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)), attention_bias=qkv_bias,
        o_proj_bias=o_bias, qk_norm=family == "qwen3", mlp_bias=bool(raw.get("mlp_bias")),
        sliding_window=window, layer_types=types, bos_token_id=_token_id(raw, "bos_token_id", file), eos_token_id=eos,
        extra=extra)


def indexed_shards(folder: Path, index: Path, kind: str) -> list[Path]:
    """The shard files an HF index (`weight_map`: tensor -> file) lists, all present."""
    try:
        wmap = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise CheckpointError(f"{index}: not a valid {kind} index ({e})") from None
    if not isinstance(wmap, dict) or not wmap:
        raise CheckpointError(f"{index}: field 'weight_map' is missing or empty")
    odd = next(((k, v) for k, v in wmap.items() if not isinstance(v, str) or not v), None)
    if odd is not None:
        raise CheckpointError(f"{index}: field 'weight_map' maps {odd[0]!r} to {odd[1]!r}; every tensor maps to "
                              f"the name of its shard file (e.g. \"model-00001-of-00002.safetensors\")")
    shards = sorted(set(wmap.values()))
    for s in shards:
        if not (folder / s).is_file():
            raise CheckpointError(f"{index}: field 'weight_map' lists shard '{s}' but {folder / s} does not "
                                  f"exist (an incomplete download?)")
    return [folder / s for s in shards]


SAFETENSORS_DTYPES = {"F32": "float32", "F64": "float64", "BF16": "bfloat16", "F16": "float16"}


def checkpoint_dtype(folder: str | Path) -> str:
    """The dtype a folder's weights are meant to run in, as transformers' ``from_pretrained(dtype="auto")``
    reads it: config.json's ``dtype`` (transformers 5) or ``torch_dtype``, else the first floating-point
    tensor of its safetensors, else float32."""
    folder = Path(folder)
    raw = read_config(folder)
    for key in ("dtype", "torch_dtype"):
        value = raw.get(key)
        if isinstance(value, str) and value.removeprefix("torch.") in SAFETENSORS_DTYPES.values():
            return value.removeprefix("torch.")
    try:
        files = [f for f in weight_files(folder) if f.suffix == ".safetensors"]
    except CheckpointError:
        files = []
    for file in files[:1]:
        try:
            with open(file, "rb") as fh:
                size = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(min(size, 100_000_000)))
        except (OSError, ValueError):
            break  # a damaged file is named by the loader
        for name, entry in header.items():
            if name != "__metadata__" and isinstance(entry, dict) and entry.get("dtype") in SAFETENSORS_DTYPES:
                return SAFETENSORS_DTYPES[entry["dtype"]]
    return "float32"


def weight_files(folder: str | Path) -> list[Path]:
    """The weight files of a folder: safetensors first, else PyTorch state dicts; refuses general pickles."""
    folder = Path(folder)
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        return indexed_shards(folder, index, "safetensors")
    found = sorted(folder.glob("*.safetensors"))
    if found:
        return found
    torch_single, torch_index = folder / "pytorch_model.bin", folder / "pytorch_model.bin.index.json"
    if torch_single.is_file():
        return [torch_single]
    if torch_index.is_file():
        return indexed_shards(folder, torch_index, "PyTorch")
    found = sorted(p for p in folder.iterdir() if p.suffix in TORCH_SUFFIXES and p.is_file() and not trainer_file(p))
    if found:
        return found
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:  # never opened: a general pickle can run code when loaded
        raise CheckpointError(
            f"{folder / pickles[0]}: only {', '.join(pickles)} found; specpipe reads model.safetensors or PyTorch "
            f"state dicts (pytorch_model.bin, *.pt, *.pth, loaded with torch.load(weights_only=True)), never general "
            f"pickles (.ckpt, .pkl), because unpickling them can execute arbitrary code. Export the model's state "
            f"dict to model.safetensors (or save_pretrained with transformers) in an environment you trust")
    raise CheckpointError(f"{single}: file not found; {folder} holds no weights (expected model.safetensors, "
                          f"model.safetensors.index.json with its shards, or a PyTorch state dict: pytorch_model.bin or "
                          f"its .index.json, *.pt, *.pth)")


def trainer_file(p: Path) -> bool:
    """State a transformers Trainer saves next to the weights of a checkpoint-N folder (never weights)."""
    return p.name in ("training_args.bin", "optimizer.pt", "scheduler.pt", "scaler.pt") or \
        p.name.startswith("rng_state")


def read_tensors(files: list[Path], dtype: torch.dtype) -> tuple[dict[str, Tensor], dict[str, tuple[Path, str]]]:
    """name -> tensor (floats converted to ``dtype``) and name -> (file, key); drops the ``model.`` prefix."""
    tensors, origin = {}, {}
    for f in files:
        for key, t in (torch_state_dict(f) if f.suffix in TORCH_SUFFIXES else safetensors_items(f)):
            name = key[len("model."):] if key.startswith("model.") else key
            if name.endswith("rotary_emb.inv_freq"):
                continue
            tensors[name] = t.to(dtype) if t.is_floating_point() else t
            origin[name] = (f, key)
    return tensors, origin


def safetensors_items(f: Path):
    try:
        handle = safe_open(str(f), framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own error type for corrupt headers
        raise CheckpointError(f"{f}: cannot be read as safetensors ({e})") from None
    with handle:
        for key in handle.keys():
            yield key, handle.get_tensor(key)


def torch_state_dict(f: Path) -> list:
    """(name, tensor) of a PyTorch state dict file, read by torch's restricted (weights-only) unpickler."""
    try:
        sd = torch.load(str(f), map_location="cpu", weights_only=True)
    except Exception as e:  # UnpicklingError for anything but tensors and plain containers, or a broken file
        if isinstance(e, pickle.UnpicklingError) and "weights only" in str(e).lower():
            why = "it holds Python objects besides tensors, which the weights-only loader refuses to build"
        else:
            import re

            text = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip()
            why = text.splitlines()[0][:160] if text else type(e).__name__
        raise CheckpointError(f"{f}: cannot be read as a PyTorch state dict with torch.load(weights_only=True) "
                              f"({why}); give model.safetensors or a plain state dict of tensors") from None
    if not isinstance(sd, dict) or not all(isinstance(k, str) and isinstance(v, Tensor) for k, v in sd.items()):
        raise CheckpointError(f"{f}: not a flat state dict (name -> tensor); found {type(sd).__name__}"
                              f"{' with non-tensor entries' if isinstance(sd, dict) else ''}. Save "
                              f"model.state_dict() (or model.safetensors) instead of a training checkpoint")
    return list(sd.items())


# tensor name part -> the config fields that set its shape (first match wins)
_QO, _KV = ("hidden_size", "num_attention_heads", "head_dim"), ("hidden_size", "num_key_value_heads", "head_dim")
_EMB, _HEAD = ("vocab_size", "hidden_size"), ("vocab_size", "draft_vocab_size", "hidden_size")
HINTS = (("embed_tokens", _EMB), ("lm_head", _HEAD), ("q_norm", ("head_dim",)), ("k_norm", ("head_dim",)), ("q_proj", _QO), ("o_proj", _QO), ("k_proj", _KV), ("v_proj", _KV),
         ("mlp", ("hidden_size", "intermediate_size")), ("fc", ("hidden_size", "target_hidden_size")),
         ("norm", ("hidden_size",)), ("d2t", ("draft_vocab_size",)), ("t2d", ("vocab_size",)))


def _hint(name: str, fields: dict) -> str:
    keys = next((ks for part, ks in HINTS if part in name), ("hidden_size",))
    return ", ".join(f"{k}={fields[k]}" for k in keys if fields.get(k) is not None)


def fill(module: nn.Module, tensors: dict[str, Tensor], origin: dict, cfg_file: Path, fields: dict,
         device: str | torch.device, what: str = "model") -> None:
    """Check names and shapes of ``tensors`` against ``module`` (built on meta) and assign them."""
    expected = module.state_dict(keep_vars=True)
    seen: dict[int, str] = {}
    tied = {n for n, p in expected.items() if seen.setdefault(id(p), n) != n}  # second name of a shared tensor
    files = sorted({str(f) for f, _ in origin.values()}) or [str(cfg_file.parent)]
    prefix = "model." if any(key.startswith("model.") for _, key in origin.values()) else ""
    for name in expected:  # missing tensors first, then unexpected or misshapen ones
        if name not in tensors and name not in tied:
            key = name if name.startswith("lm_head.") else prefix + name
            raise CheckpointError(f"{', '.join(files)}: tensor '{key}' is missing; the {what} that {cfg_file} "
                                  f"describes ({_hint(name, fields)}) needs it")
    for name, t in tensors.items():
        file, key = origin.get(name, (files[0], name))
        if name not in expected:
            raise CheckpointError(f"{file}: unexpected tensor '{key}'; the {what} that {cfg_file} describes has no "
                                  f"such parameter (is this the right architecture / config.json?)")
        if tuple(t.shape) != tuple(expected[name].shape):
            raise CheckpointError(f"{file}: tensor '{key}' has shape {list(t.shape)} but {cfg_file} "
                                  f"({_hint(name, fields)}) needs {list(expected[name].shape)}")
        if expected[name].is_floating_point() and not t.is_floating_point():
            raise CheckpointError(f"{file}: tensor '{key}' holds {t.dtype} values where a floating-point weight "
                                  f"belongs (a quantized checkpoint?); specpipe loads float32, bfloat16 or float16 "
                                  f"weights")
    load = {n: t.to(device) for n, t in tensors.items() if n not in tied}
    module.load_state_dict(load, strict=False, assign=True)


def finish(module: nn.Module, cfg: LlamaConfig, device) -> nn.Module:
    module.rotary = Rotary(cfg).to(device)  # non-persistent buffer, was built on meta
    bad = [n for n, t in list(module.named_parameters()) + list(module.named_buffers()) if t.is_meta]
    assert not bad, f"parameters left unloaded: {bad}"
    return module.eval()


def load_target(path: str | Path, dtype: str | torch.dtype = "float32",
                device: str | torch.device = "cpu") -> LlamaForCausalLM:
    """A Llama / Mistral / Qwen2 / Qwen3 target from a Hugging Face folder."""
    folder = Path(path)
    raw = read_config(folder)
    cfg = parse_config(raw, folder / "config.json")
    tensors, origin = read_tensors(weight_files(folder), to_dtype(dtype))
    eagle = "fc.weight" if "fc.weight" in tensors else next((n for n in tensors if n.startswith("midlayer.")), None)
    if eagle is not None:
        raise CheckpointError(f"{folder}: an EAGLE draft head (it holds '{eagle}'), not a whole model; give its folder as draft.path with draft=eagle (model.path, and "
                              f"draft.path of draft=standalone, take a causal LM: {', '.join(TARGET_ARCHS)})")
    if cfg.tie_word_embeddings and "embed_tokens.weight" not in tensors and "lm_head.weight" in tensors:
        # a tied model saved with safetensors' save_model keeps one name of the shared tensor, the first in sorted
        # order (lm_head.weight): transformers ties the embeddings to it
        tensors["embed_tokens.weight"] = tensors.pop("lm_head.weight")
        origin["embed_tokens.weight"] = origin.pop("lm_head.weight")
    head, emb = tensors.get("lm_head.weight"), tensors.get("embed_tokens.weight")
    if cfg.tie_word_embeddings and head is not None and emb is not None and not torch.equal(head, emb):
        cfg.tie_word_embeddings = False  # a stored lm_head that differs is used, as transformers 5 does
        cfg.extra["untied_lm_head"] = True
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    fields = {**raw, "head_dim": cfg.head_dim, "num_key_value_heads": cfg.num_key_value_heads}
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # some tied checkpoints store the copy too
    fill(model, tensors, origin, folder / "config.json", fields, device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return finish(model, cfg, device)


def load_draft(path: str | Path, target: LlamaForCausalLM, dtype: str | torch.dtype = "float32",
               device: str | torch.device = "cpu") -> nn.Module:
    """An EAGLE-1/2 head (:class:`EagleHead`) or EAGLE-3 head (:class:`Eagle3Head`) for ``target``."""
    from specpipe.models.hf_draft import load_draft_folder

    return load_draft_folder(Path(path), target, to_dtype(dtype), device)


def generation_config(folder: Path) -> dict:
    """A folder's generation_config.json as a dict; {} without the file."""
    gen = Path(folder) / "generation_config.json"
    if not gen.is_file():
        return {}
    try:
        raw = json.loads(gen.read_text(encoding="utf-8"))
        assert isinstance(raw, dict), "expected a JSON object"
    except (OSError, ValueError, AssertionError) as e:
        raise CheckpointError(f"{gen}: not a valid generation config ({e})") from None
    return raw


def eos_ids(folder: Path, cfg: LlamaConfig) -> list[int]:
    """The ids that end a request: generation_config.json's `eos_token_id` (an int or a list) where it names
    one, else config.json's. HF `generate` reads config.json only when the file is missing, so a
    generation_config.json without `eos_token_id` makes it decode past EOS; vLLM, like specpipe, still stops there.

    Instruct models often list several there (Llama-3: <|end_of_text|>, <|eom_id|>, <|eot_id|>) while
    config.json names only one."""
    ids = list(cfg.extra.get("eos_token_ids") or ([cfg.eos_token_id] if cfg.eos_token_id is not None else []))
    own = generation_config(folder).get("eos_token_id")
    own = [own] if isinstance(own, int) else own or []
    if not all(map(is_int, own)):
        raise CheckpointError(f"{folder / 'generation_config.json'}: field 'eos_token_id' must be an integer or a "
                              f"list of integers, got {own!r}")
    return list(dict.fromkeys(own or ids))


def generation_sampling(folder: Path) -> dict:
    """The sampling settings a folder's generation_config.json sets (temperature, top_p, top_k,
    repetition_penalty, min_p; do_sample=false is greedy), as vLLM applies them: only the keys present. {} without
    the file."""
    raw = generation_config(folder)
    greedy = raw.get("do_sample") is False
    out = {"temperature": 0.0} if greedy else {}
    for key in ("temperature", "top_p", "top_k", "repetition_penalty", "min_p"):
        v = raw.get(key)
        if v is None or (greedy and key != "repetition_penalty"):  # HF penalizes repeats when greedy too
            continue
        if key == "top_k" and is_int(v) and v < 0:
            v = 0  # vLLM's -1: off
        if sampling_problem(key, v):
            raise CheckpointError(f"{Path(folder) / 'generation_config.json'}: field '{key}' is {v!r}, not a usable "
                                  f"{key} (it {sampling_problem(key, v)})")
        out[key] = v if key == "top_k" else float(v)
    return out


# generation_config.json settings HF generate applies (greedy too) that specpipe does not: key -> its neutral value
UNAPPLIED_GENERATION = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "encoder_repetition_penalty": 1.0,
                        "min_new_tokens": None, "min_length": 0, "bad_words_ids": None, "suppress_tokens": None,
                        "begin_suppress_tokens": None, "forced_bos_token_id": None, "forced_eos_token_id": None,
                        "sequence_bias": None, "num_beams": 1, "penalty_alpha": None}
# ... and those HF applies only when sampling (the run reports them only when it samples)
UNAPPLIED_SAMPLING = {"typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0}


def unapplied_generation_settings(folder: Path) -> dict:
    """The settings of a folder's generation_config.json that change HF's outputs and specpipe does not apply."""
    raw = generation_config(folder)
    return {k: raw[k] for k, neutral in {**UNAPPLIED_GENERATION, **UNAPPLIED_SAMPLING}.items()
            if raw.get(k) not in (None, neutral, [], {})}


def tokenizer_config(folder: Path, raw: dict) -> dict:
    """tokenizer_config.json's fields that choose how transformers builds the tokenizer (`tokenizer_class`,
    `legacy`, `add_prefix_space`), with config.json's `tokenizer_class` as its fallback; {} without the file.
    A file that is there but unreadable is a CheckpointError: it decides how prompts are tokenized."""
    file = folder / "tokenizer_config.json"
    conf: object = {}
    if file.is_file():
        try:
            conf = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise CheckpointError(f"{file}: not valid JSON ({e}); it sets how prompts are tokenized (tokenizer "
                                  f"class, special tokens, chat template): copy it again from the model's Hugging "
                                  f"Face repo") from None
        if not isinstance(conf, dict):
            raise CheckpointError(f"{file}: expected a JSON object at the top level, got {type(conf).__name__}")
    if not conf.get("tokenizer_class") and raw.get("tokenizer_class"):
        conf = {**conf, "tokenizer_class": raw["tokenizer_class"]}
    return conf


def load_tokenizer(folder: str | Path, cfg: LlamaConfig, raw: Optional[dict] = None):
    """``specpipe_tokenizer`` in config.json, else tokenizer.json, else a CheckpointError."""
    from specpipe.tokenizer import HFTokenizer, tokenizer_from_description, transformers_pipeline

    folder = Path(folder)
    raw = read_config(folder) if raw is None else raw
    desc = raw.get("specpipe_tokenizer")
    if desc is not None:
        try:
            tok = tokenizer_from_description(desc, folder)
        except Exception as e:
            raise CheckpointError(f"{folder / 'config.json'}: field 'specpipe_tokenizer' ({desc!r}) does not "
                                  f"describe a usable tokenizer: {e}") from None
        if generation_config(folder).get("eos_token_id") is not None:  # what ends a request, as for tokenizer.json
            eos = eos_ids(folder, cfg)
            tok.eos_token_ids = tuple(eos)
            if tok.eos_token_id is None and eos:
                tok.eos_token_id = eos[0]
    elif (folder / "tokenizer.json").is_file():
        eos = eos_ids(folder, cfg)
        how = tokenizer_config(folder, raw)
        try:
            rebuild = transformers_pipeline((folder / "tokenizer.json").read_text(encoding="utf-8", errors="replace"),
                                            how, raw.get("model_type"))
            tok = HFTokenizer(folder / "tokenizer.json", eos_token_id=eos[0] if eos else None,
                              bos_token_id=cfg.bos_token_id, eos_token_ids=eos, pipeline=rebuild,
                              split_special_tokens=how.get("split_special_tokens") is True)
        except Exception as e:  # the tokenizers package's own words, with the file named
            raise CheckpointError(f"{folder / 'tokenizer.json'}: not a tokenizer file the `tokenizers` package can "
                                  f"read ({str(e) or type(e).__name__}); copy tokenizer.json again from the model's "
                                  f"Hugging Face repo") from None
    else:
        raise CheckpointError(f"{folder / 'tokenizer.json'}: file not found, and config.json has no "
                              f"'specpipe_tokenizer' field; copy tokenizer.json from the model's Hugging Face repo "
                              f"into {folder}")
    from specpipe.chat_template import ChatTemplateError, load_chat_template
    from specpipe.tokenizer import tokenizer_class_built

    try:  # a broken template fails only the requests that give "messages"
        tok.chat_template, tok.chat_template_error = load_chat_template(
            folder, tokenizer_class_built(getattr(tok, "pipeline", None))), None
    except ChatTemplateError as e:
        tok.chat_template, tok.chat_template_error = None, str(e)
    if tok.vocab_size > cfg.vocab_size:
        raise CheckpointError(f"{folder}: the tokenizer has {tok.vocab_size} tokens but config.json field "
                              f"'vocab_size' is {cfg.vocab_size}")
    return tok


def load_hf(path: str | Path, draft_path: Optional[str | Path] = None, dtype: str | torch.dtype = "float32",
            device: str | torch.device = "cpu", name: Optional[str] = None) -> ModelPair:
    """Target (+ EAGLE head when ``draft_path`` is given) + tokenizer from Hugging Face folders."""
    folder = Path(path)
    target = load_target(folder, dtype, device)
    tokenizer = load_tokenizer(folder, target.config)
    unapplied = unapplied_generation_settings(folder)
    if unapplied:  # say so once, where the weights load: outputs will differ from HF generate's
        target.config.extra["unapplied_generation_settings"] = unapplied
        how = " unless sampling.from_model=true" if list(unapplied) == ["repetition_penalty"] else ""
        when = [k for k in unapplied if k in UNAPPLIED_SAMPLING]
        hf = "HF generate does, greedy included" if not when else "HF generate does when sampling" \
            if len(when) == len(unapplied) else f"HF generate does, greedy included ({', '.join(when)}: when sampling)"
        print(f"specpipe: note: {folder / 'generation_config.json'} sets "
              f"{', '.join(f'{k}={v!r}' for k, v in unapplied.items())}, which specpipe does not apply{how} "
              f"({hf}), so outputs can differ from HF's", file=sys.stderr)
    window = target.config.extra.get("unapplied_sliding_window")
    if window is not None:
        print(f"specpipe: note: {folder / 'config.json'} sets sliding_window={window} on a Llama model, whose "
              f"attention has no window (vLLM ignores the field too), so every layer attends to the whole context; "
              f"transformers' generate trims its cache to the window, so its outputs can differ past {window} tokens",
              file=sys.stderr)
    draft = load_draft(draft_path, target, dtype, device) if draft_path is not None else None
    return ModelPair(target, draft, tokenizer, name=name or folder.name)


TINY_TARGET = Path(__file__).resolve().parents[1] / "assets" / "tiny" / "target"


def load_tiny(dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
              draft_path: Optional[str | Path] = None) -> ModelPair:
    """The trained byte-level pair shipped in specpipe/assets/tiny/{target,eagle}."""
    root = TINY_TARGET.parent
    if not (root / "target" / "config.json").is_file():
        raise CheckpointError(f"{root / 'target'}: the shipped tiny model is missing; build it with "
                              f"python scripts/train_tiny.py --out {root}")
    return load_hf(root / "target", draft_path or root / "eagle", dtype, device, name="tiny")
