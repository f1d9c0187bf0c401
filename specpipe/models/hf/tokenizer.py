"""A model folder's tokenizer: ``specpipe_tokenizer`` in config.json, else tokenizer.json (built as transformers
builds it from tokenizer_config.json), with its EOS ids and chat template."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from specpipe.models.hf.config import read_config
from specpipe.models.hf.errors import CheckpointError
from specpipe.models.hf.generation import eos_ids, generation_config
from specpipe.models.llama import LlamaConfig
from specpipe.workload.chat_template import ChatTemplateError, load_chat_template
from specpipe.workload.tokenizer import (
    HFTokenizer,
    tokenizer_class_built,
    tokenizer_from_description,
    transformers_pipeline,
)


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
    try:  # a broken template fails only the requests that give "messages"
        tok.chat_template, tok.chat_template_error = load_chat_template(
            folder, tokenizer_class_built(getattr(tok, "pipeline", None))), None
    except ChatTemplateError as e:
        tok.chat_template, tok.chat_template_error = None, str(e)
    if tok.vocab_size > cfg.vocab_size:
        raise CheckpointError(f"{folder}: the tokenizer has {tok.vocab_size} tokens but config.json field "
                              f"'vocab_size' is {cfg.vocab_size}")
    return tok
