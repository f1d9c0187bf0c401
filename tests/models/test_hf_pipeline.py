"""HF folders of the newer Llama-family variants (Qwen3: q/k norms, head_dim != hidden/heads, YaRN, tied;
Llama with attention biases) decode through `run()` with an EAGLE head saved next to them, greedily, to
exactly what transformers' `generate` gives."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from helpers import compose
from specpipe.run import run
from specpipe.models.eagle import EagleHead
from specpipe.models.hf.load import load_draft, load_target
from specpipe.models.hf.save import save_eagle

MAX_NEW = 12


def random_head(target, seed: int) -> EagleHead:
    """An EAGLE head built from the target's own config (so a Qwen3 head keeps q/k norms)."""
    head = EagleHead(copy.deepcopy(target.config), target).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) / p.shape[-1] ** 0.5)
        h = target.config.hidden_size
        head.fc.weight[:, :h] += torch.eye(h, dtype=head.fc.weight.dtype)  # accepts some drafts
    return head


@pytest.mark.parametrize("variant", ["qwen3_yarn_tied", "llama_bias_yarn"])
def test_eagle_decode_equals_transformers_generate(make_hf_model, edit_config, tmp_path, variant):
    model = make_hf_model(variant, seed=11).double()
    folder = tmp_path / "target"
    model.save_pretrained(folder)
    edit_config(folder, specpipe_tokenizer={"type": "byte", "vocab_size": 300, "eos_token_id": 299})
    target = load_target(folder, dtype="float64")
    head_dir = save_eagle(random_head(target, seed=12), tmp_path / "eagle")
    reloaded = load_draft(head_dir, target, dtype="float64")
    assert (reloaded.layers[0].self_attn.q_norm is not None) == (variant.startswith("qwen3"))

    g = torch.Generator().manual_seed(13)
    prompts = [torch.randint(0, 299, (n,), generator=g).tolist() for n in (3, 9, 17, 30)]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in prompts))
    cfg = compose("model=hf", f"model.path={folder}", f"draft.path={head_dir}", "device.dtype=float64",
                  f"workload.prompts_file={path}", f"workload.max_new_tokens={MAX_NEW}", "workload.batch_size=4",
                  "draft.topk=2", "draft.num_steps=3", "speculation=static")  # (drafts verified: commits checked)
    out = run(cfg, quiet=True)
    assert out["metrics"]["num_errors"] == 0
    assert out["metrics"]["accept_length_mean"] > 1  # some drafts accepted: multi-token commits checked too

    with torch.no_grad():
        for p, req in zip(prompts, out["requests"]):
            ref = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),  # else
                                 max_new_tokens=MAX_NEW, do_sample=False, num_beams=1,  # HF masks id 0 as padding
                                 eos_token_id=299, pad_token_id=0)[0, len(p):].tolist()
            assert req.output_ids == ref, (variant, p)


def test_sampling_from_the_models_generation_config(make_hf_model, edit_config, tmp_path):
    from specpipe.models.hf.errors import CheckpointError
    from specpipe.models.hf.generation import generation_sampling

    folder = tmp_path / "target"
    make_hf_model("qwen3_bias_window", seed=14).save_pretrained(folder)
    edit_config(folder, specpipe_tokenizer={"type": "byte", "vocab_size": 300, "eos_token_id": 299})
    gen = folder / "generation_config.json"
    gen.write_text(json.dumps({"do_sample": True, "temperature": 0.6, "top_k": -1, "eos_token_id": 299}))
    assert generation_sampling(folder) == {"temperature": 0.6, "top_k": 0}  # only what the file sets
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt_ids": [5, 6, 7]}) + "\n")
    base = ["model=hf", f"model.path={folder}", "draft=ngram", f"workload.prompts_file={path}",
            "workload.max_new_tokens=4", "sampling.top_p=0.9"]
    m = run(compose(*base, "sampling.from_model=true"), quiet=True)["metrics"]
    assert m["sampling"] == {"temperature": 0.6, "top_p": 0.9, "top_k": 0, "repetition_penalty": 1.0,
                             "min_p": 0.0, "source": str(gen), "per_request": 0}
    # `config` is the job's own (resume=true compares it with the job's), from_model=true included
    assert m["config"]["sampling"]["temperature"] == 0.0 and m["config"]["sampling"]["from_model"] is True
    assert run(compose(*base), quiet=True)["metrics"]["sampling"]["temperature"] == 0.0  # off by default

    gen.write_text(json.dumps({"do_sample": True, "temperature": 0.6, "min_p": 0.1}))
    assert generation_sampling(folder) == {"temperature": 0.6, "min_p": 0.1}  # HF's MinPLogitsWarper: applied
    gen.write_text(json.dumps({"do_sample": False, "temperature": 0.6}))
    assert generation_sampling(folder) == {"temperature": 0.0}
    gen.write_text(json.dumps({"do_sample": False, "temperature": 0.6, "repetition_penalty": 1.1}))
    assert generation_sampling(folder) == {"temperature": 0.0, "repetition_penalty": 1.1}  # HF: greedy too
    gen.write_text(json.dumps({"temperature": "hot"}))
    with pytest.raises(CheckpointError, match="field 'temperature' is 'hot'"):
        generation_sampling(folder)


def test_api_sampling_wins_over_the_models(make_hf_model, edit_config, tmp_path):
    from specpipe import SpecPipe

    folder = tmp_path / "target"
    make_hf_model("llama", seed=15).save_pretrained(folder)
    edit_config(folder, specpipe_tokenizer={"type": "byte", "vocab_size": 300, "eos_token_id": 299})
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.8}))
    sp = SpecPipe("model=hf", f"model.path={folder}", "draft=ngram", "sampling.from_model=true")
    sp.generate([[5, 6, 7]], max_new_tokens=3)
    assert (sp.metrics["sampling"]["temperature"], sp.metrics["sampling"]["top_p"]) == (0.6, 0.8)
    sp.generate([[5, 6, 7]], max_new_tokens=3, temperature=1.2)  # the call's value; the model's top_p stays
    assert (sp.metrics["sampling"]["temperature"], sp.metrics["sampling"]["top_p"]) == (1.2, 0.8)


@pytest.mark.parametrize("draft", ["none", "ngram", "eagle"])
def test_repetition_penalty_equals_transformers_generate(make_hf_model, edit_config, tmp_path, draft):
    """HF's repetition penalty, greedy: each verified tree node is penalized for its own context (prompt,
    output, and the drafts on its path), so every drafter commits what generate(repetition_penalty=) gives;
    per prompt too, next to prompts without one."""
    model = (make_hf_model("llama_bias_yarn", seed=11) if draft == "eagle"
             else make_hf_model("llama", seed=16)).double()
    folder = tmp_path / "target"
    model.save_pretrained(folder)
    edit_config(folder, specpipe_tokenizer={"type": "byte", "vocab_size": 300, "eos_token_id": 299})
    g = torch.Generator().manual_seed(17)
    prompts = [(torch.randint(0, 40, (n,), generator=g).tolist() * 3)[: 3 * n] for n in (3, 5, 8, 11)]
    penalties = [1.3, None, 2.0, 0.7]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt_ids": p, **({"repetition_penalty": r} if r else {})}) + "\n"
                            for p, r in zip(prompts, penalties)))
    extra = []
    if draft == "eagle":
        target = load_target(folder, dtype="float64")
        extra = [f"draft.path={save_eagle(random_head(target, seed=12), tmp_path / 'eagle')}", "draft.topk=2",
                 "draft.num_steps=3"]
    cfg = compose("model=hf", f"model.path={folder}", f"draft={draft}", "device.dtype=float64", *extra,
                  f"workload.prompts_file={path}", f"workload.max_new_tokens={MAX_NEW}", "workload.batch_size=4",
                  "speculation=static")
    out = run(cfg, quiet=True)
    (tmp_path / "plain.jsonl").write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in prompts))
    plain = run(compose("model=hf", f"model.path={folder}", "draft=none", "device.dtype=float64",
                        f"workload.prompts_file={tmp_path / 'plain.jsonl'}", f"workload.max_new_tokens={MAX_NEW}"),
                quiet=True)
    assert out["metrics"]["num_errors"] == 0 and out["metrics"]["sampling"]["per_request"] == 3
    if draft != "none":
        assert out["metrics"]["accept_length_mean"] > 1
    changed = 0
    with torch.no_grad():
        for p, r, req in zip(prompts, penalties, out["requests"]):
            ref = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),  # else
                                 max_new_tokens=MAX_NEW, do_sample=False, num_beams=1,  # HF masks id 0 as padding
                                 repetition_penalty=r or 1.0, eos_token_id=299, pad_token_id=0)[0, len(p):].tolist()
            assert req.output_ids == ref, (draft, r, p)
            changed += r is not None and ref != plain["requests"][req.index].output_ids
    assert changed >= 2  # the penalty really changed these outputs


@pytest.mark.parametrize("draft", ["none", "ngram"])
def test_logprobs_are_the_targets_raw_log_probabilities(make_hf_model, edit_config, tmp_path, draft):
    """workload.logprobs: each output token's log-probability under the target's raw logits (before any
    repetition penalty or temperature), for single-token and multi-token (speculative) commits alike;
    checked against transformers' own forward over prompt + output."""
    model = make_hf_model("llama", seed=16).double()
    folder = tmp_path / "target"
    model.save_pretrained(folder)
    edit_config(folder, specpipe_tokenizer={"type": "byte", "vocab_size": 300, "eos_token_id": 299})
    g = torch.Generator().manual_seed(17)
    prompts = [(torch.randint(0, 40, (n,), generator=g).tolist() * 3)[: 3 * n] for n in (3, 5, 8, 11)]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt_ids": p, **({"repetition_penalty": 0.5} if i == 1 else {})}) + "\n"
                            for i, p in enumerate(prompts)))
    out = run(compose("model=hf", f"model.path={folder}", f"draft={draft}", "device.dtype=float64",
                      f"workload.prompts_file={path}", f"workload.max_new_tokens={MAX_NEW}", "workload.logprobs=true",
                      "workload.batch_size=4", "speculation=static"), quiet=True)
    if draft == "ngram":
        assert out["metrics"]["accept_length_mean"] > 1
    with torch.no_grad():
        for p, req in zip(prompts, out["requests"]):
            seq = torch.tensor([p + req.output_ids])
            ref = torch.log_softmax(model(seq).logits[0, len(p) - 1: -1], -1)
            want = ref.gather(1, torch.tensor(req.output_ids)[:, None])[:, 0]
            got = torch.tensor(req.logprobs, dtype=torch.float64)
            assert len(req.logprobs) == len(req.output_ids) == MAX_NEW
            assert torch.allclose(got, want, atol=1e-5, rtol=0), (p, (got - want).abs().max().item())  # HF: fp32 RoPE
    assert run(compose("model=hf", f"model.path={folder}", "draft=none", "device.dtype=float64",
                       f"workload.prompts_file={path}", "workload.max_new_tokens=2"), quiet=True)[
        "requests"][0].logprobs is None  # off by default


def test_a_standalone_draft_padded_to_another_vocab_size(make_hf_model, edit_config, tmp_path):
    """Checkpoints that share a tokenizer pad their vocabularies differently (Qwen2.5-7B: 152064, 0.5B: 151936).
    The draft here is the target itself, padded: with 16 more ids, whose large rows would win most argmaxes
    unless dropped; with 16 fewer, which it must never draft. Both decode the target's greedy text and accept
    nearly every draft; the sampled chain (rejection sampling over the draft's probabilities) runs too."""
    from safetensors.torch import load_file, save_file

    small = tmp_path / "v300"
    make_hf_model("llama", seed=21).save_pretrained(small)
    edit_config(small, specpipe_tokenizer={"type": "byte", "vocab_size": 300, "eos_token_id": 299})
    g = torch.Generator().manual_seed(22)

    def padded(name: str, rows: int, scale: float):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text((small / "config.json").read_text())
        sd = load_file(small / "model.safetensors")
        for key in ("model.embed_tokens.weight", "lm_head.weight"):
            w = sd[key]
            sd[key] = w[:rows] if rows <= len(w) else torch.cat([w, scale * torch.randn(rows - len(w), w.shape[1],
                                                                                          generator=g)])
        save_file(sd, folder / "model.safetensors")
        edit_config(folder, vocab_size=rows)
        return folder

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": [7 * i + j for j in range(5)]}) + "\n" for i in range(3)))

    def decode(target, *extra):
        return run(compose("model=hf", f"model.path={target}", "device.dtype=float64",
                           f"workload.prompts_file={prompts}",
                           f"workload.max_new_tokens={MAX_NEW}", "workload.ignore_eos=true", "speculation=static",
                           *extra), quiet=True)  # (every draft verified: "accept nearly every draft" is checked)

    # a draft whose 16 extra ids would win; a target whose 16 extra ids the smaller draft cannot propose
    for target, draft in ((small, padded("v316_draft", 316, 3.0)), (padded("v316_target", 316, 0.01), small)):
        plain = decode(target, "draft=none")
        spec = decode(target, "draft=standalone", f"draft.path={draft}", "draft.topk=1", "draft.num_steps=3")
        assert [r.output_ids for r in spec["requests"]] == [r.output_ids for r in plain["requests"]]
        assert spec["metrics"]["num_errors"] == 0 and spec["metrics"]["accept_length_mean"] > 3
        sampled = decode(target, "draft=standalone", f"draft.path={draft}", "draft.topk=1", "draft.num_steps=3",
                         "sampling.temperature=1.0")
        assert sampled["metrics"]["num_errors"] == 0
        assert all(len(r.output_ids) == MAX_NEW and max(r.output_ids) < 316 for r in sampled["requests"])
    with pytest.raises(Exception, match="vocab_size 280 is smaller than the target's tokenizer \\(300 tokens\\)"):
        decode(small, "draft=standalone", f"draft.path={padded('v280', 280, 0)}")


def test_a_standalone_draft_of_another_tokenizer_or_an_eagle_head_is_refused_by_name(make_hf_model, tmp_path):
    """A draft whose tokenizer.json numbers tokens otherwise passed every size check and was never accepted; an
    EAGLE head given as a standalone draft was "an architecture specpipe cannot load", and a whole LM given as an
    EAGLE head "missing model.fc.weight", without saying which drafter takes it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    def tokenizer(folder, order):
        tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(order)}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.save(str(folder / "tokenizer.json"))

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    target, draft = tmp_path / "target", tmp_path / "draft"
    make_hf_model("llama", seed=31).save_pretrained(target)
    make_hf_model("llama", seed=32).save_pretrained(draft)
    tokenizer(target, alphabet)
    tokenizer(draft, alphabet[1:] + alphabet[:1])  # the same tokens, numbered one apart

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "def f(x):"}) + "\n")

    def decode(*extra):
        return run(compose("model=hf", f"model.path={target}", "workload.max_new_tokens=4",
                           f"workload.prompts_file={prompts}", *extra), quiet=True)

    from specpipe.errors import ConfigError
    from specpipe.models.hf.errors import CheckpointError
    from specpipe.models.hf.load import load_hf

    with pytest.raises(ConfigError, match=r"standalone draft's tokenizer.json numbers tokens otherwise than the "
                                          r"target's \(256 of its 256 tokens differ"):
        decode("draft=standalone", f"draft.path={draft}")
    tokenizer(draft, alphabet)
    out = decode("draft=standalone", f"draft.path={draft}")  # the same numbering: fine
    assert out["metrics"]["num_errors"] == 0, out["metrics"]["request_errors"]
    head = tmp_path / "head"
    save_eagle(random_head(load_hf(target).target, 33), head, dtype="float32")
    with pytest.raises(CheckpointError, match=r"an EAGLE draft head .*, not a whole model; give its folder "
                                              r"as draft.path with draft=eagle"):
        decode("draft=standalone", f"draft.path={head}")
    with pytest.raises(CheckpointError, match=r"a whole causal LM \(2 decoder layers, no EAGLE 'fc' projection\), not "
                                              r"an EAGLE head; .*use draft=standalone"):
        decode("draft=eagle", f"draft.path={draft}")


def test_an_eagle1_head_with_q_k_v_biases_loads_them(make_hf_model, tmp_path):
    """EAGLE-1 heads for Qwen2 targets say `"qkv_bias": true` under a Llama architecture (SafeAILab's cnets1:
    q/k/v biases, no o bias); they were refused for an unexpected q_proj.bias. A head whose config does not say
    so but whose tensors carry the biases loads them too; one that says so without them names the missing one."""
    from specpipe.models.hf.errors import CheckpointError
    from specpipe.models.hf.save import _write, config_to_hf, unfused

    model = make_hf_model("llama", seed=3).double()
    model.save_pretrained(tmp_path / "target")
    target = load_target(tmp_path / "target", dtype="float64")
    cfg = copy.deepcopy(target.config)
    cfg.attention_bias, cfg.o_proj_bias = True, False
    head = EagleHead(cfg, target).double()
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()), dtype=p.dtype))
    tensors = {k: v.contiguous() for k, v in unfused(head.state_dict()).items()}
    plain = config_to_hf(target.config)
    plain.update(num_hidden_layers=1, bias=True)
    for name, config in (("said", {**plain, "qkv_bias": True}), ("unsaid", plain)):
        loaded = load_draft(_write(tmp_path / name, config, tensors), target, dtype="float64")
        attn = loaded.layers[0].self_attn
        assert torch.equal(attn.q_proj.bias, head.layers[0].self_attn.q_proj.bias) and attn.o_proj.bias is None
        assert torch.equal(attn.v_proj.bias, head.layers[0].self_attn.v_proj.bias), name
    without = {k: v for k, v in tensors.items() if not k.endswith("_proj.bias")}
    with pytest.raises(CheckpointError, match="q_proj.bias"):
        load_draft(_write(tmp_path / "missing", {**plain, "qkv_bias": True}, without), target, dtype="float64")


def test_an_eagle1_head_scores_drafts_with_the_targets_lm_head_even_when_it_stores_one(make_hf_model, tmp_path):
    """SafeAILab's EAGLE-1/2, sglang and vLLM always use the target's lm_head for an EAGLE-1/2 head; an
    lm_head.weight saved in the head's file (here a different one) was used instead."""
    model = make_hf_model("llama", seed=4).double()
    model.save_pretrained(tmp_path / "target")
    target = load_target(tmp_path / "target", dtype="float64")
    folder = save_eagle(random_head(target, seed=5), tmp_path / "eagle")
    from safetensors.torch import load_file, save_file

    sd = load_file(str(folder / "model.safetensors"))
    sd["lm_head.weight"] = torch.randn(target.lm_head.weight.shape, dtype=torch.float64)
    save_file(sd, str(folder / "model.safetensors"))
    head = load_draft(folder, target, dtype="float64")
    h = torch.randn(2, 3, target.config.hidden_size, dtype=torch.float64)
    assert torch.equal(head.logits(h), target.logits(h))


def test_an_eagle1_head_trained_with_a_layer0_input_norm_applies_it(tmp_path):
    """SafeAILab's EAGLE skips layer 0's input norm; a head that saved `layers.0.input_layernorm.weight` was
    trained with one. It was refused as an unexpected tensor; it now loads and normalizes fc's output."""
    from safetensors.torch import load_file, save_file

    from specpipe.models.random_tiny import build_random_tiny

    pair = build_random_tiny(num_layers=1, hidden_size=32, intermediate_size=64)
    target = pair.target
    folder = save_eagle(random_head(target, seed=6), tmp_path / "eagle")
    plain = load_draft(folder, target)
    assert isinstance(plain.layers[0].input_layernorm, torch.nn.Identity)
    sd = load_file(str(folder / "model.safetensors"))
    norm = 0.5 + torch.rand(target.config.hidden_size, generator=torch.Generator().manual_seed(1))
    sd["layers.0.input_layernorm.weight"] = norm
    save_file(sd, str(folder / "model.safetensors"))
    head = load_draft(folder, target)
    assert torch.equal(head.layers[0].input_layernorm.weight, norm)
    ids = torch.randint(0, target.config.vocab_size, (1, 5))
    hidden = torch.randn(1, 5, target.config.hidden_size)
    x = head.fc(torch.cat((target.embed_tokens(ids), hidden), -1))
    layer = head.layers[0]
    cos, sin = head.rotary(torch.arange(5)[None], x.dtype)
    assert torch.allclose(head(ids, hidden), layer(x, cos, sin, None, None))
    assert not torch.allclose(head(ids, hidden), plain(ids, hidden))
