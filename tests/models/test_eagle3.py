"""EAGLE-3 heads: a random head in the SafeAILab / SpecForge key format loads, drafts and round-trips."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from specpipe.models.attention_batch import extend_batch
from specpipe.models.eagle3 import Eagle3Head, default_aux_layers
from specpipe.models.hf.errors import CheckpointError
from specpipe.models.hf.load import load_draft
from specpipe.models.hf.save import save_eagle
from specpipe.models.random_tiny import build_random_tiny

H, V, VD, HEADS, KV, HD, INTER = 64, 258, 100, 4, 2, 16, 96
AUX = [0, 1, 3]


def _eagle3_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors with the key names and shapes of an EAGLE-3 checkpoint."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"fc.weight": (H, 3 * H), "norm.weight": (H,), "lm_head.weight": (VD, H),
              "midlayer.input_layernorm.weight": (H,), "midlayer.hidden_norm.weight": (H,),
              "midlayer.post_attention_layernorm.weight": (H,),
              "midlayer.self_attn.q_proj.weight": (HEADS * HD, 2 * H),
              "midlayer.self_attn.k_proj.weight": (KV * HD, 2 * H),
              "midlayer.self_attn.v_proj.weight": (KV * HD, 2 * H), "midlayer.self_attn.o_proj.weight": (H, HEADS * HD),
              "midlayer.mlp.gate_proj.weight": (INTER, H), "midlayer.mlp.up_proj.weight": (INTER, H),
              "midlayer.mlp.down_proj.weight": (H, INTER)}
    sd = {k: (1 + 0.1 * torch.randn(s, generator=g)) if len(s) == 1 else torch.randn(s, generator=g) / s[1] ** 0.5
          for k, s in shapes.items()}
    ids = torch.randperm(V, generator=g)[:VD].sort().values  # target ids of the draft vocab
    sd["d2t"] = ids - torch.arange(VD)
    sd["t2d"] = torch.zeros(V, dtype=torch.bool).index_fill_(0, ids, True)
    return {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in sd.items()}  # stored as bf16


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """RMSNorm by hand (eps 1e-5, the configs' rms_norm_eps)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.float()


def _config() -> dict:
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H, "vocab_size": V,
            "draft_vocab_size": VD, "num_hidden_layers": 1, "num_attention_heads": HEADS, "num_key_value_heads": KV,
            "intermediate_size": INTER, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX}}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(target, head folder, raw tensors)."""
    target = build_random_tiny(num_layers=4).target
    folder = tmp_path_factory.mktemp("eagle3")
    sd = _eagle3_tensors()
    save_file(sd, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(_config()))
    return target, folder, sd


def test_default_aux_layers():
    assert default_aux_layers(32) == [1, 15, 28]
    assert default_aux_layers(4) == [1, 1, 0] and default_aux_layers(2) == [1, 0, 0]


@torch.no_grad()
def test_loads_and_drafts(setup):
    target, folder, sd = setup
    head = load_draft(folder, target)
    assert isinstance(head, Eagle3Head) and head.aux_layers == AUX and head.fc.weight.dtype == torch.float32
    ids = torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(1))
    final, aux = head.capture(target, ids)
    assert torch.equal(final, target(ids)) and aux.shape == (2, 7, 3 * H)
    hidden = head(ids, aux)  # [B, Q, H]
    for step in range(2):  # the second step feeds the head's own hidden back
        logits = head.logits(hidden)
        assert logits.shape == (2, 7, V)
        finite = torch.isfinite(logits)
        assert torch.equal(finite.all(0).all(0), sd["t2d"]) and torch.equal(finite.any(0).any(0), sd["t2d"])
        top = logits.argmax(-1)
        assert ((top >= 0) & (top < V)).all() and sd["t2d"][top].all()
        assert torch.equal(top, head.to_target(head.draft_logits(hidden).argmax(-1)))
        hidden = head(top, hidden)


@torch.no_grad()
def test_single_token_matches_reference(setup):
    """With one token attention returns v, so the layer is plain matmuls over the checkpoint tensors."""
    target, folder, sd = setup
    head = load_draft(folder, target)
    w = {k: v.float() for k, v in sd.items()}
    tok = torch.tensor([[5]])
    aux = torch.randn(1, 1, 3 * H, generator=torch.Generator().manual_seed(2))
    h = aux @ w["fc.weight"].T
    x = torch.cat((_rms(target.embed_tokens(tok), w["midlayer.input_layernorm.weight"]),
                   _rms(h, w["midlayer.hidden_norm.weight"])), -1)
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(1, 1, KV, HD).repeat_interleave(HEADS // KV, 2)
    h = h + v.reshape(1, 1, HEADS * HD) @ w["midlayer.self_attn.o_proj.weight"].T
    m = _rms(h, w["midlayer.post_attention_layernorm.weight"])
    h = h + (F.silu(m @ w["midlayer.mlp.gate_proj.weight"].T) * (m @ w["midlayer.mlp.up_proj.weight"].T)) \
        @ w["midlayer.mlp.down_proj.weight"].T
    assert (head(tok, aux) - h).abs().max() < 1e-4
    ref = _rms(h, w["norm.weight"]) @ w["lm_head.weight"].T  # [1, 1, VD]
    assert torch.equal(head.logits(head(tok, aux))[0, 0].argmax(), ref[0, 0].argmax() + sd["d2t"][ref[0, 0].argmax()])


@torch.no_grad()
def test_kv_pool_matches_plain_forward(setup):
    target, folder, _ = setup
    head = load_draft(folder, target)
    ids = torch.randint(0, V, (1, 9), generator=torch.Generator().manual_seed(3))
    aux = head.capture(target, ids)[1]  # [1, 9, 3H]
    plain = head(ids, aux)
    head.setup_kv(20)
    table = torch.arange(1, 10)[None]
    one, rows = torch.ones(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    pre = head(ids[:, :6], aux[:, :6], extend_batch(table, rows, 0 * one, 6 * one, 6, 6))
    assert (pre - plain[:, :6]).abs().max() < 1e-5
    for p in range(6, 9):
        out = head(ids[:, p:p + 1], aux[:, p:p + 1], extend_batch(table, rows, p * one, one, 1, p + 1))
        assert (out[:, 0] - plain[:, p]).abs().max() < 1e-5


@torch.no_grad()
def test_save_eagle_round_trip(setup, tmp_path):
    target, folder, _ = setup
    head = load_draft(folder, target)
    save_eagle(head, tmp_path, dtype="float32")
    again = load_draft(tmp_path, target)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"] and raw["draft_vocab_size"] == VD
    ids = torch.randint(0, V, (1, 5), generator=torch.Generator().manual_seed(4))
    aux = head.capture(target, ids)[1]
    assert again.aux_layers == AUX and torch.equal(again.logits(again(ids, aux)), head.logits(head(ids, aux)))


def test_errors(setup, tmp_path):
    target, _, good = setup
    (tmp_path / "config.json").write_text(json.dumps(_config()))
    f = tmp_path / "model.safetensors"
    cases = [({"d2t": good["d2t"] + V}, "'d2t'"), ({"fc.weight": torch.zeros(H, 2 * H)}, "'fc.weight'"),
             ({"d2t": None, "t2d": None}, "'d2t' is missing"),
             ({"d2t": None, "t2d": torch.ones(V, dtype=torch.bool)}, "'d2t' is missing"),  # t2d names V ids, not VD
             ({"lm_head.weight": torch.zeros(VD + 1, H)}, "draft_vocab_size=100")]
    for change, needle in cases:
        sd = {**good, **change}
        save_file({k: v for k, v in sd.items() if v is not None}, str(f))
        with pytest.raises(CheckpointError, match=needle):
            load_draft(tmp_path, target)


def _write(folder, config: dict, sd: dict):
    folder.mkdir(exist_ok=True)
    save_file(sd, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@torch.no_grad()
def test_vllm_top_level_aux_ids_name_the_input_of_a_layer(setup, tmp_path):
    """vLLM (and speculators) read `eagle_aux_hidden_state_layer_ids` at the top level, as the residual stream
    entering layer j: layer j-1's output, the embeddings for j=0. Ignoring the field drafted from the wrong layers."""
    target, _, sd = setup
    config = {k: v for k, v in _config().items() if k != "eagle_config"}
    head = load_draft(_write(tmp_path / "vllm", {**config, "eagle_aux_hidden_state_layer_ids": [0, 2, 3]}, sd), target)
    assert head.aux_layers == [-1, 1, 2]
    ids = torch.randint(0, V, (1, 6), generator=torch.Generator().manual_seed(5))
    _, aux = head.capture(target, ids)
    x, outs = target.embed_tokens(ids), []
    for layer in target.layers:  # the residual stream after each layer, by hand
        outs.append(x := layer(x, *target.rotary(torch.arange(6)[None], x.dtype), None, target.kv))
    assert torch.equal(aux, torch.cat((target.embed_tokens(ids), outs[1], outs[2]), -1))
    both = {**config, "eagle_aux_hidden_state_layer_ids": [0, 2, 3],
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX}}
    assert load_draft(_write(tmp_path / "both", both, sd), target).aux_layers == AUX  # sglang's field wins
    save_eagle(head, tmp_path / "saved", dtype="float32")
    assert load_draft(tmp_path / "saved", target).aux_layers == [-1, 1, 2]  # the embeddings survive a round trip
    with pytest.raises(CheckpointError, match=r"'eagle_aux_hidden_state_layer_ids' is \[1, 5\].*\[0, 4\]"):
        load_draft(_write(tmp_path / "bad", {**config, "eagle_aux_hidden_state_layer_ids": [1, 5]}, sd), target)


@torch.no_grad()
def test_speculators_format_loads_like_the_eagle_layout(setup, tmp_path):
    """RedHatAI-style heads for vLLM: layer fields under transformer_layer_config, tensors named layers.0.*,
    norm_before_residual true unless the file says otherwise."""
    target, folder, sd = setup
    ref = load_draft(_write(tmp_path / "ref", {**_config(), "norm_before_residual": True}, sd), target)
    layer = {k: v for k, v in _config().items() if k not in ("architectures", "draft_vocab_size", "eagle_config")}
    spec = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "draft_vocab_size": VD,
            "transformer_layer_config": layer, "eagle_aux_hidden_state_layer_ids": [a + 1 for a in AUX],
            "speculators_config": {"algorithm": "eagle3", "proposal_methods": [{"speculative_tokens": 3}],
                                   "verifier": {"name_or_path": "x", "architectures": ["LlamaForCausalLM"]}}}
    renamed = {k.replace("midlayer.", "layers.0."): v for k, v in sd.items()}
    head = load_draft(_write(tmp_path / "spec", spec, renamed), target)
    assert head.aux_layers == AUX and head.midlayer.norm_before_residual
    ids = torch.randint(0, V, (1, 5), generator=torch.Generator().manual_seed(6))
    aux = ref.capture(target, ids)[1]
    assert torch.equal(head.logits(head(ids, aux)), ref.logits(ref(ids, aux)))
    with pytest.raises(CheckpointError, match="input_norm.weight' is missing"):  # norm_before_fc needs its norm
        load_draft(_write(tmp_path / "fc", {**spec, "norm_before_fc": True}, renamed), target)
    with pytest.raises(CheckpointError, match="speculators-format head of type 'mlp_speculator'"):
        load_draft(_write(tmp_path / "mlp", {**spec, "speculators_model_type": "mlp_speculator"}, renamed), target)


@pytest.mark.parametrize("how", ["tensor", "field"])
def test_a_parallel_drafting_head_is_named_as_such(setup, tmp_path, how):
    """P-EAGLE heads (vLLM's parallel drafting) carry a learned `mask_hidden`; drafting step by step would feed
    them hidden states they were not trained on. It was refused as "unexpected tensor" with no hint why."""
    target, _, sd = setup
    config, tensors = _config(), dict(sd)
    if how == "tensor":
        tensors["mask_hidden"] = torch.zeros(1, len(AUX) * H)
    else:
        config["parallel_drafting"] = True
    with pytest.raises(CheckpointError, match="parallel-drafting \\(P-EAGLE\\) head \\(" +
                       ("tensor 'mask_hidden'" if how == "tensor" else "field 'parallel_drafting' true")):
        load_draft(_write(tmp_path / "p", config, tensors), target)


@torch.no_grad()
def test_a_model_optimizer_eagle_medusa_head_drafts_with_its_eagle_layer(setup, tmp_path, capsys):
    """NVIDIA Model Optimizer exports EAGLE heads trained with parallel_draft_step > 1 with Medusa heads beside the
    EAGLE layer (`parallel_draft_heads.{i}.medusa_layers.{j}.linear.*`, `parallel_draft_heads.lm_head.weight`).
    The EAGLE layer is trained step by step like any head, so it drafts as one; the load used to stop at
    "unexpected tensor"."""
    target, _, sd = setup
    plain = {k.replace("midlayer.", "layers.0."): v for k, v in sd.items()}  # Model Optimizer's names
    config = _config()
    config["eagle_config"] = {**config["eagle_config"], "parallel_draft_step": 3, "parallel_draft_heads_num_layers": 1,
                              "use_aux_hidden_state": True, "use_last_layernorm": True}
    medusa = dict(plain)
    for i in range(2):
        medusa[f"parallel_draft_heads.{i}.medusa_layers.0.linear.weight"] = torch.randn(H, H)
        medusa[f"parallel_draft_heads.{i}.medusa_layers.0.linear.bias"] = torch.randn(H)
    medusa["parallel_draft_heads.lm_head.weight"] = torch.randn(VD, H)
    ref = load_draft(_write(tmp_path / "plain", _config(), plain), target)
    assert "Medusa" not in capsys.readouterr().err
    head = load_draft(_write(tmp_path / "medusa", config, medusa), target)
    err = capsys.readouterr().err
    assert "2 Medusa-style parallel draft heads" in err and "parallel_draft_step=3" in err, err
    ids = torch.randint(0, V, (1, 5), generator=torch.Generator().manual_seed(7))
    aux = ref.capture(target, ids)[1]
    assert torch.equal(head.logits(head(ids, aux)), ref.logits(ref(ids, aux)))


@pytest.mark.parametrize("how", ["architectures", "field"])
def test_a_dflash_drafter_is_named_as_such(setup, tmp_path, how):
    """DFlash drafters (block diffusion, z-lab / Model Optimizer exports) draft a block per forward; as an EAGLE
    head they failed on whichever tensor came first."""
    target, _, sd = setup
    config = {**_config(), "architectures": ["DFlashDraftModel"]} if how == "architectures" else \
        {**_config(), "dflash_config": {"mask_token_id": 5, "target_layer_ids": [1, 2]}}
    with pytest.raises(CheckpointError, match="a DFlash drafter .*" + ("DFlashDraftModel" if how == "architectures"
                                                                     else "field 'dflash_config'")):
        load_draft(_write(tmp_path / "d", config, sd), target)


def test_a_wider_head_without_its_own_embeddings_is_named_as_such(setup, tmp_path):
    target, _, sd = setup
    with pytest.raises(CheckpointError, match="hidden_size' is 96 and the head has no embed_tokens.weight"):
        load_draft(_write(tmp_path / "w", {**_config(), "hidden_size": 96, "target_hidden_size": H}, sd), target)


@pytest.mark.parametrize("field,value,message", [
    ("eagle_config", [1], r"field 'eagle_config' is \[1\]; expected an object"),
    ("eagle_config", "x", r"field 'eagle_config' is 'x'; expected an object"),
    ("target_hidden_size", float(H), rf"'target_hidden_size' must be a positive integer, got {float(H)}"),
    ("target_hidden_size", str(H), rf"'target_hidden_size' must be a positive integer, got '{H}'"),
])
def test_config_fields_of_the_wrong_type_are_named(setup, tmp_path, field, value, message):
    """A list for eagle_config crashed the load with AttributeError, a float target_hidden_size with a TypeError from
    torch, and a string one gave "is 64 but the target has hidden_size=64"."""
    target, _, sd = setup
    with pytest.raises(CheckpointError, match=message):
        load_draft(_write(tmp_path / "bad", {**_config(), field: value}, sd), target)


@torch.no_grad()
def test_a_head_without_aux_hidden_states_reads_the_targets_final_hidden(setup, tmp_path):
    """`eagle_config.use_aux_hidden_state: false` (NVIDIA's *-Eagle3-v2 heads): no aux layers and no fc; the
    target's final hidden goes into the midlayer as is. Loading one as an aux head refused it (an fc of the
    wrong width) or, with an fc saved beside it, drafted from the wrong features."""
    target, _, sd = setup
    config = {**_config(), "eagle_config": {"use_aux_hidden_state": False}}
    plain = {k: v for k, v in sd.items() if not k.startswith("fc.")}
    head = load_draft(_write(tmp_path / "v2", config, plain), target)
    assert head.aux_layers == [] and head.fc is None
    ids = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(7))
    final, features = head.capture(target, ids)
    assert torch.equal(final, target(ids)) and torch.equal(features, final)
    # the midlayer over the final hidden: the same layer as an aux head's whose fc output is that hidden
    aux_head = load_draft(_write(tmp_path / "aux", _config(), sd), target)
    aux_head.fc = None
    assert torch.equal(head(ids, final), aux_head.midlayer(aux_head.embed(ids), final,
                                                           *aux_head.rotary(torch.arange(6)[None].expand(2, 6),
                                                                            final.dtype), None, None))
    # an fc saved anyway is not used (vLLM skips it too)
    again = load_draft(_write(tmp_path / "with_fc", config, sd), target)
    assert again.fc is None and torch.equal(again(ids, final), head(ids, final))
    save_eagle(head, tmp_path / "saved", dtype="float32")
    raw = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert raw["eagle_config"] == {"use_aux_hidden_state": False}
    saved = load_draft(tmp_path / "saved", target)
    assert saved.fc is None and torch.equal(saved.logits(saved(ids, final)), head.logits(head(ids, final)))
    with pytest.raises(CheckpointError, match=r"'eagle_config.use_aux_hidden_state' is 'no'; expected true"):
        load_draft(_write(tmp_path / "bad", {**_config(), "eagle_config": {"use_aux_hidden_state": "no"}}, sd), target)
    wide = {**plain, "embed_tokens.weight": torch.zeros(V, 96)}
    with pytest.raises(CheckpointError, match="use_aux_hidden_state' is false.*hidden_size is 96 and the target's 64"):
        load_draft(_write(tmp_path / "wide", {**config, "hidden_size": 96}, wide), target)


def _layer_tensors(i: int, seed: int) -> dict[str, torch.Tensor]:
    """A plain decoder layer's tensors under layers.{i} (plus the hidden_norm vLLM builds into every layer)."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"input_layernorm.weight": (H,), "hidden_norm.weight": (H,), "post_attention_layernorm.weight": (H,),
              "self_attn.q_proj.weight": (HEADS * HD, H), "self_attn.k_proj.weight": (KV * HD, H),
              "self_attn.v_proj.weight": (KV * HD, H), "self_attn.o_proj.weight": (H, HEADS * HD),
              "mlp.gate_proj.weight": (INTER, H), "mlp.up_proj.weight": (INTER, H), "mlp.down_proj.weight": (H, INTER)}
    return {f"layers.{i}.{k}": ((1 + 0.1 * torch.randn(s, generator=g)) if len(s) == 1 else
                                torch.randn(s, generator=g) / s[1] ** 0.5).to(torch.bfloat16)
            for k, s in shapes.items()}


@torch.no_grad()
def test_a_head_of_several_layers_runs_them_all(setup, tmp_path):
    """num_hidden_layers > 1 (vLLM's multi-layer EAGLE-3: layers.0 is the midlayer, later layers are plain decoder
    layers over the residual stream). It was refused; now every layer runs, each with its own KV layer."""
    target, _, sd = setup
    vllm_names = {k.replace("midlayer.", "layers.0."): v for k, v in sd.items()}
    three = {**vllm_names, **_layer_tensors(1, 11), **_layer_tensors(2, 12)}
    head = load_draft(_write(tmp_path / "three", {**_config(), "num_hidden_layers": 3}, three), target)
    one = load_draft(_write(tmp_path / "one", _config(), sd), target)
    assert list(head.layers) == ["1", "2"]
    ids = torch.randint(0, V, (1, 7), generator=torch.Generator().manual_seed(8))
    aux = head.capture(target, ids)[1]
    cos, sin = head.rotary(torch.arange(7)[None], aux.dtype)
    want = one(ids, aux)  # the midlayer alone, then layers 1 and 2 by hand
    for i in (1, 2):
        w = {k.removeprefix(f"layers.{i}."): v.float() for k, v in three.items() if k.startswith(f"layers.{i}.")}
        want = _reference_layer(want, w, cos, sin)
    got = head(ids, aux)
    assert (got - want).abs().max() < 1e-4 and (got - one(ids, aux)).abs().max() > 1e-2
    head.setup_kv(20)  # decoding through the KV pool gives the same as the plain forward, layer by layer
    assert len(head.kv.keys) == 3
    table, one_, rows = torch.arange(1, 8)[None], torch.ones(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    pre = head(ids[:, :4], aux[:, :4], extend_batch(table, rows, 0 * one_, 4 * one_, 4, 4))
    assert (pre - got[:, :4]).abs().max() < 1e-5
    for p in range(4, 7):
        out = head(ids[:, p:p + 1], aux[:, p:p + 1], extend_batch(table, rows, p * one_, one_, 1, p + 1))
        assert (out[:, 0] - got[:, p]).abs().max() < 1e-5
    save_eagle(head, tmp_path / "saved", dtype="float32")
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["num_hidden_layers"] == 3
    again = load_draft(tmp_path / "saved", target)
    assert (again(ids, aux) - got).abs().max() < 1e-6
    with pytest.raises(CheckpointError, match="layers.2.*missing"):
        load_draft(_write(tmp_path / "short", {**_config(), "num_hidden_layers": 3},
                          {**vllm_names, **_layer_tensors(1, 11)}), target)


def _reference_layer(x, w, cos, sin):
    """A Llama decoder layer by hand (attention through F.scaled_dot_product_attention, causal)."""
    B, Q, _ = x.shape
    h = _rms(x, w["input_layernorm.weight"])
    q = (h @ w["self_attn.q_proj.weight"].T).view(B, Q, HEADS, HD)
    k = (h @ w["self_attn.k_proj.weight"].T).view(B, Q, KV, HD)
    v = (h @ w["self_attn.v_proj.weight"].T).view(B, Q, KV, HD)
    rot = lambda t: torch.cat((-t[..., HD // 2:], t[..., :HD // 2]), -1)  # noqa: E731
    q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
    k, v = k.repeat_interleave(HEADS // KV, 2), v.repeat_interleave(HEADS // KV, 2)
    a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    x = x + a.transpose(1, 2).reshape(B, Q, HEADS * HD) @ w["self_attn.o_proj.weight"].T
    m = _rms(x, w["post_attention_layernorm.weight"])
    return x + (F.silu(m @ w["mlp.gate_proj.weight"].T) * (m @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T


@torch.no_grad()
@pytest.mark.parametrize("where", ["top", "eagle_config"])
def test_eagle3_1_norms_apply_as_their_flags_say(setup, tmp_path, where):
    """EAGLE-3.1 / NVIDIA heads: norm_before_fc (one RMSNorm `input_norm` over the concatenated aux hidden before
    fc), fc_norm (an RMSNorm per aux layer, `fc_norm.i`) and norm_output (the next step reads the final norm's
    output, which the lm_head takes as is). The flags sit at the top (speculators) or in eagle_config (NVIDIA).
    norm_before_fc was refused and the other two were ignored: a head trained with them drafted garbage."""
    target, _, sd = setup
    g = torch.Generator().manual_seed(9)
    norms = {"input_norm.weight": (1 + 0.2 * torch.randn(3 * H, generator=g)).to(torch.bfloat16),
             **{f"fc_norm.{i}.weight": (1 + 0.2 * torch.randn(H, generator=g)).to(torch.bfloat16) for i in range(3)}}
    flags = {"norm_before_fc": True, "fc_norm": True, "norm_output": True}
    config = {**_config(), **flags} if where == "top" else \
        {**_config(), "eagle_config": {**_config()["eagle_config"], **flags}}
    head = load_draft(_write(tmp_path / "h", config, {**sd, **norms}), target)
    plain = load_draft(_write(tmp_path / "plain", _config(), sd), target)
    ids = torch.randint(0, V, (1, 5), generator=torch.Generator().manual_seed(10))
    aux = head.capture(target, ids)[1]
    per_layer = torch.cat([_rms(aux[..., i * H:(i + 1) * H], norms[f"fc_norm.{i}.weight"]) for i in range(3)], -1)
    fused = _rms(per_layer, norms["input_norm.weight"]) @ sd["fc.weight"].float().T
    mid = plain.midlayer(plain.embed(ids), fused, *plain.rotary(torch.arange(5)[None], fused.dtype), None, None)
    out = head(ids, aux)
    assert (out - plain.norm(mid)).abs().max() < 1e-4  # norm_output: the step's hidden is the normed one
    assert torch.equal(head.draft_logits(out), head.lm_head(out))  # and the lm_head takes it without a second norm
    assert (head(ids, out) - plain.norm(plain.midlayer(plain.embed(ids), out, *plain.rotary(
        torch.arange(5)[None], out.dtype), None, None))).abs().max() < 1e-4  # later steps skip fc and its norms
    save_eagle(head, tmp_path / "saved", dtype="float32")
    again = load_draft(tmp_path / "saved", target)
    assert (again(ids, aux) - out).abs().max() < 1e-6
    with pytest.raises(CheckpointError, match="'fc_norm.0.weight' is missing"):
        load_draft(_write(tmp_path / "missing", config, sd), target)
    with pytest.raises(CheckpointError, match="'norm_output' is 'yes'; expected true or false"):
        load_draft(_write(tmp_path / "bad", {**_config(), "norm_output": "yes"}, sd), target)


@torch.no_grad()
def test_a_head_whose_fc_is_as_wide_as_itself_skips_fc_on_its_own_hidden(setup, tmp_path):
    """One aux layer of a target as wide as the head: fc maps H -> H, so the width of the hidden cannot tell the
    target's features from the head's own output. Later draft steps (DraftForward.decode) fed the head's own hidden
    through fc again, drafting from features the head was never trained on."""
    from specpipe.stages.draft_forward import DraftForward

    target, _, sd = setup
    one = {**sd, "fc.weight": sd["fc.weight"][:, :H].contiguous()}
    head = load_draft(_write(tmp_path / "one_aux", {**_config(), "eagle_config": {
        "eagle_aux_hidden_state_layer_ids": [1]}}, one), target)
    assert head.aux_layers == [1] and head.fc.in_features == H
    ids = torch.randint(0, V, (1, 4), generator=torch.Generator().manual_seed(12))
    aux = head.capture(target, ids)[1]
    rot = head.rotary(torch.arange(4)[None], aux.dtype)
    first = head(ids, aux)  # the target's features: through fc
    assert (first - head.midlayer(head.embed(ids), head.fc(aux), *rot, None, None)).abs().max() < 1e-6
    want = head.midlayer(head.embed(ids), first, *rot, None, None)  # a later step: the own hidden as is
    _, _, got = DraftForward(head, 2).decode(ids, first, None)
    assert (got.view(1, 4, H) - want).abs().max() < 1e-6
    _, _, ext = DraftForward(head, 2).extend(ids, aux, None, torch.tensor([3]))  # the extend reads the target's
    assert (ext - first[:, 3]).abs().max() < 1e-6


@torch.no_grad()
def test_a_head_with_only_t2d_gets_d2t_from_it(setup, tmp_path):
    """Some exports keep only the target-side mask: the draft vocab is then its ids in ascending order (how EAGLE-3's
    training builds d2t), the same head as one saved with both maps."""
    target, folder, sd = setup
    head = load_draft(folder, target)
    only = load_draft(_write(tmp_path / "t2d_only", _config(), {k: v for k, v in sd.items() if k != "d2t"}), target)
    assert torch.equal(only.d2t, head.d2t) and torch.equal(only.t2d, head.t2d)
    ids = torch.randint(0, V, (1, 5), generator=torch.Generator().manual_seed(5))
    aux = head.capture(target, ids)[1]
    assert torch.equal(only.logits(only(ids, aux)), head.logits(head(ids, aux)))
    drafted = torch.arange(VD)
    assert torch.equal(only.to_target(drafted), head.to_target(drafted))


@torch.no_grad()
def test_an_eagle3_head_whose_config_does_not_say_so_loads_as_eagle3(setup, tmp_path):
    """vLLM's layers.0.* naming under a plain "LlamaForCausalLM" architecture: the layer's hidden_norm (and the
    reduced vocabulary's maps) say EAGLE-3. It went to the EAGLE-1 loader, which refused fc.weight's width."""
    target, folder, sd = setup
    head = load_draft(folder, target)
    renamed = {("layers.0." + k.removeprefix("midlayer.")) if k.startswith("midlayer.") else k: v
               for k, v in sd.items()}
    plain = _write(tmp_path / "plain", {**_config(), "architectures": ["LlamaForCausalLM"]}, renamed)
    again = load_draft(plain, target)
    assert type(again) is type(head)
    ids = torch.randint(0, V, (1, 5), generator=torch.Generator().manual_seed(6))
    aux = head.capture(target, ids)[1]
    assert torch.equal(again.logits(again(ids, aux)), head.logits(head(ids, aux)))
