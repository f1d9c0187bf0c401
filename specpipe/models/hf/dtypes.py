"""Dtype names: the ones specpipe accepts, and the one a folder's weights are meant to run in."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from specpipe.models.hf.config import read_config
from specpipe.models.hf.errors import CheckpointError
from specpipe.models.hf.weights import weight_files

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
          "float64": torch.float64}  # float64: exact-equivalence tests


def to_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    """A torch dtype from its name (float32, bfloat16, float16, or short forms); None is float32."""
    if isinstance(dtype, torch.dtype) or dtype is None:
        return dtype or torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported (valid: float32, bfloat16, float16, float64)")
    return DTYPES[dtype]


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
