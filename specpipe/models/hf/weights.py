"""Read a model folder's weights and assign them to a module built on the meta device.

A folder holds model.safetensors (or model.safetensors.index.json + shards); keys lose their leading
``model.``. Folders with only PyTorch weights (pytorch_model.bin, or its index and shards, as the original
EAGLE heads ship) are read with ``torch.load(weights_only=True)``: torch's restricted unpickler, which builds
tensors and plain containers and refuses any other object (so a crafted file cannot run code), the same rule
HF transformers applies. Models are built on the meta device and the checkpoint tensors are assigned (no
random init); a missing, unexpected or misshapen tensor raises a :class:`CheckpointError` naming the file and
the tensor.
"""
from __future__ import annotations

import json
import pickle
import warnings
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor, nn

from specpipe.models.hf.errors import CheckpointError
from specpipe.models.llama import LlamaConfig, Rotary

TORCH_SUFFIXES = (".bin", ".pt", ".pth")  # read with torch.load(weights_only=True)
PICKLE_SUFFIXES = (".ckpt", ".pkl")  # training checkpoints / arbitrary pickles: never opened


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
                          f"model.safetensors.index.json with its shards, or a PyTorch state dict: pytorch_model.bin "
                          f"or its .index.json, *.pt, *.pth)")


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
        with warnings.catch_warnings(record=True) as said:  # torch's warnings on a pickle it then refuses
            warnings.simplefilter("always")
            sd = torch.load(str(f), map_location="cpu", weights_only=True)
    except Exception as e:  # UnpicklingError for anything but tensors and plain containers, or a broken file
        if isinstance(e, pickle.UnpicklingError) and "unsupported global" in str(e).lower():
            why = "it holds Python objects besides tensors, which the weights-only loader refuses to build"
        elif isinstance(e, pickle.UnpicklingError) and "weights only" in str(e).lower():
            why = "it is not a pickle of tensors that the weights-only loader can read: a general pickle, or no " \
                  "pickle at all"
        else:
            import re

            text = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip()
            why = text.splitlines()[0][:160] if text else type(e).__name__
        raise CheckpointError(f"{f}: cannot be read as a PyTorch state dict with torch.load(weights_only=True) "
                              f"({why}); give model.safetensors or a plain state dict of tensors") from None
    for w in said:  # a file that loads: its warnings still reach the user
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if not isinstance(sd, dict) or not all(isinstance(k, str) and isinstance(v, Tensor) for k, v in sd.items()):
        raise CheckpointError(f"{f}: not a flat state dict (name -> tensor); found {type(sd).__name__}"
                              f"{' with non-tensor entries' if isinstance(sd, dict) else ''}. Save "
                              f"model.state_dict() (or model.safetensors) instead of a training checkpoint")
    return list(sd.items())


# tensor name part -> the config fields that set its shape (first match wins)
_QO, _KV = ("hidden_size", "num_attention_heads", "head_dim"), ("hidden_size", "num_key_value_heads", "head_dim")
_EMB, _HEAD = ("vocab_size", "hidden_size"), ("vocab_size", "draft_vocab_size", "hidden_size")
HINTS = (("embed_tokens", _EMB), ("lm_head", _HEAD), ("q_norm", ("head_dim",)), ("k_norm", ("head_dim",)),
         ("q_proj", _QO), ("o_proj", _QO), ("k_proj", _KV), ("v_proj", _KV),
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
