"""model.dtype=auto: a checkpoint runs in its own dtype, read as transformers' from_pretrained(dtype="auto")
reads it."""
from __future__ import annotations

import json

import pytest
import torch

from specpipe.api import SpecPipe
from specpipe.errors import SpecpipeError
from specpipe.models.hf.dtypes import checkpoint_dtype
from specpipe.models.hf.save import save_target
from specpipe.models.random_tiny import build_random_tiny


@pytest.fixture(scope="module")
def fp16_folder(tmp_path_factory):
    """A random target saved with float16 weights and a config.json that names no dtype."""
    pair = build_random_tiny(num_layers=1, hidden_size=32, intermediate_size=64)
    folder = save_target(pair.target, pair.tokenizer, tmp_path_factory.mktemp("fp16") / "m", dtype="float16")
    raw = json.loads((folder / "config.json").read_text())
    assert "dtype" not in raw and "torch_dtype" not in raw
    return folder


def edit(folder, **fields):
    raw = json.loads((folder / "config.json").read_text())
    for k, v in fields.items():
        raw.pop(k, None) if v is None else raw.__setitem__(k, v)
    (folder / "config.json").write_text(json.dumps(raw))


def test_the_config_names_it_else_the_weights_do(fp16_folder, tmp_path):
    assert checkpoint_dtype(fp16_folder) == "float16"  # no field: the first floating-point tensor's
    edit(fp16_folder, torch_dtype="bfloat16")
    try:
        assert checkpoint_dtype(fp16_folder) == "bfloat16"
        edit(fp16_folder, dtype="float32")  # transformers 5's name wins
        assert checkpoint_dtype(fp16_folder) == "float32"
        edit(fp16_folder, dtype="auto", torch_dtype="torch.bfloat16")  # not a dtype; the prefixed form is
        assert checkpoint_dtype(fp16_folder) == "bfloat16"
    finally:
        edit(fp16_folder, dtype=None, torch_dtype=None)


def test_model_dtype_auto_loads_the_checkpoints_dtype(fp16_folder):
    weight = lambda sp: next(sp.pair.target.parameters()).dtype  # noqa: E731
    args = ("model=hf", f"model.path={fp16_folder}", "draft=none", "workload.max_new_tokens=4")
    assert weight(SpecPipe(*args)) == torch.float32  # the default: device.dtype
    auto = SpecPipe(*args, "model.dtype=auto")
    assert weight(auto) == torch.float16
    out = auto.generate(["hello"])[0]
    assert out.error is None and len(out.output_ids) > 0
    assert weight(SpecPipe("model.dtype=auto", "draft=none")) == torch.bfloat16  # the shipped pair says bfloat16


def test_a_bad_model_dtype_names_auto_among_the_valid_values():
    with pytest.raises(SpecpipeError, match=r"model.dtype='half'.*auto"):
        SpecPipe("model.dtype=half")
