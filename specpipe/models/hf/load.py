"""Load Llama / Mistral / Qwen2 / Qwen3 targets and EAGLE heads from Hugging Face folders: the model
group's `_target_`s (load_hf, load_tiny) and the loaders the run and the tests call."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from torch import nn

from specpipe.models.hf.config import TARGET_ARCHS, parse_config, read_config
from specpipe.models.hf.draft import load_draft_folder
from specpipe.models.hf.dtypes import to_dtype
from specpipe.models.hf.errors import CheckpointError
from specpipe.models.hf.generation import UNAPPLIED_SAMPLING, unapplied_generation_settings
from specpipe.models.hf.tokenizer import load_tokenizer
from specpipe.models.hf.weights import fill, finish, read_tensors, weight_files
from specpipe.models.llama import LlamaForCausalLM
from specpipe.models.pair import ModelPair
from specpipe.notes import logger

log = logger(__name__)


def load_target(path: str | Path, dtype: str | torch.dtype = "float32",
                device: str | torch.device = "cpu") -> LlamaForCausalLM:
    """A Llama / Mistral / Qwen2 / Qwen3 target from a Hugging Face folder."""
    folder = Path(path)
    raw = read_config(folder)
    cfg = parse_config(raw, folder / "config.json")
    tensors, origin = read_tensors(weight_files(folder), to_dtype(dtype))
    eagle = "fc.weight" if "fc.weight" in tensors else next((n for n in tensors if n.startswith("midlayer.")), None)
    if eagle is not None:
        raise CheckpointError(f"{folder}: an EAGLE draft head (it holds '{eagle}'), not a whole model; give its folder "
                              "as draft.path with draft=eagle (model.path, and "
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
    return load_draft_folder(Path(path), target, to_dtype(dtype), device)


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
        log.info(f"specpipe: note: {folder / 'generation_config.json'} sets "
                 f"{', '.join(f'{k}={v!r}' for k, v in unapplied.items())}, which specpipe does not apply{how} "
                 f"({hf}), so outputs can differ from HF's")
    window = target.config.extra.get("unapplied_sliding_window")
    if window is not None:
        log.info(f"specpipe: note: {folder / 'config.json'} sets sliding_window={window} on a Llama model, whose "
                 f"attention has no window (vLLM ignores the field too), so every layer attends to the whole context; "
                 f"transformers' generate trims its cache to the window, so its outputs can differ past {window} "
                 f"tokens")
    draft = load_draft(draft_path, target, dtype, device) if draft_path is not None else None
    return ModelPair(target, draft, tokenizer, name=name or folder.name)


TINY_TARGET = Path(__file__).resolve().parents[2] / "assets" / "tiny" / "target"


def load_tiny(dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
              draft_path: Optional[str | Path] = None) -> ModelPair:
    """The trained byte-level pair shipped in specpipe/assets/tiny/{target,eagle}."""
    root = TINY_TARGET.parent
    if not (root / "target" / "config.json").is_file():
        raise CheckpointError(f"{root / 'target'}: the shipped tiny model is missing; build it with "
                              f"python scripts/train_tiny.py --out {root}")
    return load_hf(root / "target", draft_path or root / "eagle", dtype, device, name="tiny")
