"""The loaded model pair of a process: loading it once for every job of an in-process sweep (and every call of
the API), the draft model the run drafts with, and the settings the loaded model decides or bounds.

Which draft model a run needs is its drafter's schema's `drafts_with` (`config.drafts`): the EAGLE head loaded
with the target (draft.path: its folder), a causal LM of its own (draft.path), or none.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch
from omegaconf import DictConfig, OmegaConf

from specpipe.config.build import build
from specpipe.config.schema import DRAFT_HEAD, DRAFT_MODEL, draft_schema, draft_schemas
from specpipe.errors import ConfigError

_PAIR_CACHE: dict = {}  # weights kept across the jobs of an in-process sweep
MODEL_LOADS = [0]  # how many times weights were loaded in this process (tests check sweeps reuse them)


def folder_state(path: Optional[str]) -> tuple:
    """(name, size, mtime) of a checkpoint folder's files and its subfolders' (an EAGLE head kept inside): a
    folder re-saved in place between two runs of one process (a notebook, an eval during training) is loaded
    again rather than served from the cache."""
    if not path:
        return ()
    out = []
    try:
        for top in os.scandir(Path(path).expanduser()):
            entries = os.scandir(top.path) if top.is_dir() else (top,)
            for e in entries:
                if e.is_file():
                    st = e.stat()
                    out.append((os.path.relpath(e.path, path), st.st_size, st.st_mtime_ns))
    except OSError:
        return ()  # loading it reports what is wrong
    return tuple(sorted(out))


def model_dtype(cfg: DictConfig) -> str:
    """The dtype the weights run in: model.dtype, else device.dtype. model.dtype=auto takes the checkpoint's own,
    as transformers' from_pretrained(dtype="auto") does (`models.hf.dtypes.checkpoint_dtype`); a model built in
    memory (random_tiny) has none and takes device.dtype."""
    want = cfg.model.get("dtype")
    if want != "auto":
        return want or cfg.device.dtype
    from specpipe.models.hf.dtypes import checkpoint_dtype
    from specpipe.models.hf.load import TINY_TARGET

    target = str(cfg.model.get("_target_", ""))
    if target.endswith(".load_hf"):
        return checkpoint_dtype(os.path.expanduser(str(cfg.model.path)))
    if target.endswith(".load_tiny"):
        return checkpoint_dtype(TINY_TARGET)
    return cfg.device.dtype


def drafts_with(cfg: DictConfig) -> Optional[str]:
    """The draft model the configured drafter drafts with: DRAFT_HEAD, DRAFT_MODEL or None."""
    return draft_schema(cfg.draft).drafts_with


def load_pair(cfg: DictConfig, dtype: str, device):
    """Build the model pair, or reuse it when an earlier job of this process loaded the same one (the same
    settings, and the same files in its folders)."""
    draft_path = cfg.draft.path if drafts_with(cfg) == DRAFT_HEAD else None
    key = (OmegaConf.to_yaml(cfg.model), dtype, str(device.torch_device), draft_path,
           folder_state(cfg.model.get("path")), folder_state(draft_path))
    if key not in _PAIR_CACHE:
        _PAIR_CACHE.clear()  # keep one pair: sweeps over models should not pile up weights
        MODEL_LOADS[0] += 1
        with torch.random.fork_rng(devices=[]):  # module constructors' initial weights (then loaded over) draw
            _PAIR_CACHE[key] = build(cfg.model, "model", dtype=dtype, device=str(device.torch_device),
                                     draft_path=draft_path)
    return _PAIR_CACHE[key]


def first_layer_copy(target):
    """A self-speculative draft for test models: the target truncated to its first layer (weights shared)."""
    import copy

    small = copy.copy(target)
    small.config = copy.copy(target.config)
    small.config.num_hidden_layers = 1
    small._modules = dict(target._modules)
    small.layers = torch.nn.ModuleList(list(target.layers)[:1])
    small.kv = None
    return small


def ensure_draft_model(cfg: DictConfig, pair, dtype: str, device) -> None:
    """With a drafter that drafts with a model of its own (DRAFT_MODEL): the pair's standalone model is the one
    draft.path names (loaded once). The EAGLE head (DRAFT_HEAD) comes with the pair (`load_pair`)."""
    source = (cfg.draft.path, folder_state(cfg.draft.path))
    if drafts_with(cfg) == DRAFT_MODEL and (getattr(pair, "standalone", None) is None
                                            or getattr(pair, "standalone_source", None) != source):
        with torch.random.fork_rng(devices=[]):  # as in load_pair: the caller's random stream is theirs
            load_standalone(cfg, pair, dtype, device)
        pair.standalone_source = source


def drafting_models(cfg: DictConfig, pair) -> list:
    """The pair's draft models this run drafts with (an EAGLE head, a standalone model, or none). The other
    stays loaded for a later job of an in-process sweep, and its KV pool is let go: a GPU holding it would
    run out of memory where the job alone fits."""
    used = {DRAFT_HEAD: pair.draft, DRAFT_MODEL: getattr(pair, "standalone", None)}.get(drafts_with(cfg))
    for model in (pair.draft, getattr(pair, "standalone", None)):
        if model is not None and model is not used:
            model.kv = None
    return [used] if used is not None else []


def load_standalone(cfg: DictConfig, pair, dtype: str, device) -> None:
    """The standalone drafter's model: draft.path, or for random_tiny the target's first layer."""
    if cfg.draft.path is not None:
        from specpipe.models.hf.load import load_target

        pair.standalone = load_target(cfg.draft.path, dtype=dtype, device=str(device.torch_device))
    elif cfg.model._target_.endswith("build_random_tiny"):
        pair.standalone = first_layer_copy(pair.target)
    else:
        raise ConfigError(f"draft={draft_schema(cfg.draft).label(cfg.draft)} needs draft.path=DIR: a small causal LM "
                          "folder (config.json + safetensors) with the same tokenizer as the target (see `make "
                          "train-tiny` in docs/checkpoints.md)")
    check_same_vocabulary(cfg.draft.path, pair.tokenizer)
    own, tokens = pair.standalone.config.vocab_size, pair.tokenizer.vocab_size
    if own < tokens:
        raise ConfigError(f"draft.path={cfg.draft.path!r}: the standalone draft's vocab_size {own} is smaller than "
                          f"the target's tokenizer ({tokens} tokens); it must share the target's tokenizer (a "
                          f"vocabulary padded to another size is fine)")
    pair.standalone.fit_vocab(pair.target.config.vocab_size)  # padded differently: score the target's ids


def check_same_vocabulary(draft_path, tokenizer) -> None:
    """A standalone draft proposes token ids: its folder's tokenizer.json must give each token the target's id (a
    draft of another family, or a vocabulary trained apart, passed every size check and was never accepted)."""
    target = getattr(tokenizer, "_tok", None)
    theirs = Path(str(draft_path)) / "tokenizer.json" if draft_path is not None else None
    if target is None or theirs is None or not theirs.is_file():
        return
    try:
        from tokenizers import Tokenizer

        vocab = Tokenizer.from_file(str(theirs)).get_vocab(with_added_tokens=True)
    except Exception:  # the draft's tokenizer is never used to encode: an unreadable one is not its problem
        return
    ours = target.get_vocab(with_added_tokens=True)
    moved = sorted((i, t) for t, i in vocab.items() if t in ours and ours[t] != i)
    if moved:
        i, t = moved[0]
        raise ConfigError(f"draft.path={str(draft_path)!r}: the standalone draft's tokenizer.json numbers tokens "
                          f"otherwise than the target's ({len(moved)} of its {len(vocab)} tokens differ, e.g. {t!r} is "
                          f"{i} there and {ours[t]} in the target's), so its proposals would name other tokens; use "
                          f"a draft trained with the target's tokenizer (a smaller model of the same family)")


def model_sampling(cfg: DictConfig, pair) -> tuple[DictConfig, str]:
    """cfg with sampling.* from the model's generation_config.json when sampling.from_model is set;
    and where the settings came from ("config", or that file)."""
    from specpipe.models.hf.generation import generation_sampling

    source = pair.target.config.extra.get("source")
    if not cfg.sampling.get("from_model") or source is None:
        return cfg, "config"
    found = generation_sampling(Path(source))
    if not found:
        return cfg, "config (the model folder sets no sampling)"
    return OmegaConf.merge(cfg, {"sampling": found}), str(Path(source) / "generation_config.json")


def check_context(cfg: DictConfig, pair, max_new_tokens: bool = True) -> None:
    """Settings the model's context bounds: workload.max_new_tokens (prompt and output share it;
    `max_new_tokens=False` leaves that one to the call that decodes) and allocator.page_size."""
    ctx = pair.target.config.max_position_embeddings
    if max_new_tokens and cfg.workload.max_new_tokens >= ctx:
        raise ConfigError(f"workload.max_new_tokens={cfg.workload.max_new_tokens} leaves no room for a prompt in "
                          f"the model's context of {ctx} tokens (max_position_embeddings); use at most {ctx - 1}")
    ps = cfg.allocator.page_size
    if ps > ctx:  # a page holds one request's tokens: the rest of it is never written (a 2**20 page: 12M slots)
        raise ConfigError(f"allocator.page_size={ps} is larger than the model's context of {ctx} tokens "
                          f"(max_position_embeddings), so most of every page would never be written; use a power "
                          f"of two up to {1 << (ctx.bit_length() - 1)} (16 to 128 are usual)")


def no_head_message(pair, label: str) -> str:
    """Why a drafter that drafts with an EAGLE head cannot run on `pair`, and the drafters that can."""
    others = [f"draft={o}" for o, s in draft_schemas().items() if s.drafts_with != DRAFT_HEAD]
    return (f"draft={label} needs an EAGLE head, but model {pair.name!r} has none; give draft.path=DIR or use "
            f"{', '.join(others[:-1])} or {others[-1]}")


def check_draft_model(cfg: DictConfig, pair) -> None:
    """The draft model the drafter needs is there, and draft.topk fits its vocabulary (model drafters pick that many
    tokens of it per expansion; an n-gram topk counts matches, not vocabulary entries)."""
    d, kind = cfg.draft, drafts_with(cfg)
    if kind == DRAFT_HEAD and pair.draft is None:
        raise ConfigError(no_head_message(pair, draft_schema(d).label(d)))
    if kind is None:
        return
    model = pair.draft if kind == DRAFT_HEAD else getattr(pair, "standalone", None)
    vocab = getattr(model, "draft_vocab_size", None) or pair.target.config.vocab_size
    if d.topk > vocab:
        raise ConfigError(f"draft.topk={d.topk} is larger than the draft's vocabulary of {vocab} tokens; use "
                          f"draft.topk<={vocab} (4 to 10 is typical)")
