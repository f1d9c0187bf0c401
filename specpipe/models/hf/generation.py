"""A folder's generation_config.json: the ids that end a request, the sampling settings it sets, and the
settings HF generate applies that specpipe does not (the run says so)."""
from __future__ import annotations

import json
from pathlib import Path

from specpipe.config.schema import is_int, sampling_problem
from specpipe.models.hf.errors import CheckpointError
from specpipe.models.llama import LlamaConfig


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
