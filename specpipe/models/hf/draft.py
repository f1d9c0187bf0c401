"""Load EAGLE-1/2 and EAGLE-3 draft heads (safetensors or PyTorch state dicts) for an already loaded target."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from specpipe.models.eagle import EagleHead
from specpipe.models.eagle3 import Eagle3Head
from specpipe.models.hf.config import int_field, parse_config, read_config
from specpipe.models.hf.errors import CheckpointError
from specpipe.models.hf.weights import fill, finish, read_tensors, weight_files
from specpipe.models.llama import LlamaConfig, LlamaForCausalLM
from specpipe.notes import logger

log = logger(__name__)


def load_draft_folder(folder: Path, target: LlamaForCausalLM, dtype: torch.dtype, device) -> nn.Module:
    """EagleHead or Eagle3Head, chosen by `architectures` (…Eagle3…) or by ``midlayer.*`` keys."""
    raw = read_config(folder)
    file = folder / "config.json"
    raw = _from_speculators(raw, file)
    arch = str(raw.get("architectures") or "").lower()
    if "dflash" in arch or "dflash_config" in raw:
        why = f"architectures {raw.get('architectures')}" if "dflash" in arch else "field 'dflash_config'"
        raise CheckpointError(f"{file}: a DFlash drafter ({why}): it drafts a whole block of tokens in one forward "
                              f"by denoising masked positions, reading the target's hidden states through its own KV, "
                              f"and specpipe's drafters are EAGLE-1/2/3 heads (one token per forward), n-gram, suffix "
                              f"and standalone LMs; use an EAGLE-3 head of this target, or draft=ngram / draft=suffix, "
                              f"which need no weights")
    tensors, origin = read_tensors(weight_files(folder), dtype)
    _drop_parallel_draft_heads(raw, file, tensors, origin)
    layers = {n.split(".")[1] for n in tensors if n.startswith("layers.") and n.count(".") > 1}
    # an EAGLE-3 head whose config does not say so (no "Eagle3" architecture, vLLM's layers.0.* naming): its first
    # layer's hidden_norm, or a reduced vocabulary's maps, are EAGLE-3's alone
    eagle3 = ("eagle3" in arch or any(n.startswith("midlayer.") for n in tensors)
              or "layers.0.hidden_norm.weight" in tensors or "d2t" in tensors or "t2d" in tensors)
    if not eagle3 and "fc.weight" not in tensors and len(layers) > 1 and (
            "lm_head.weight" in tensors or "embed_tokens.weight" in tensors):
        raise CheckpointError(f"{folder}: a whole causal LM ({len(layers)} decoder layers, no EAGLE 'fc' projection), "
                              f"not an EAGLE head; to draft with a small LM of the target's tokenizer use draft="
                              f"standalone draft.path={folder}, or give the EAGLE head's folder as draft.path")
    if eagle3:
        if not any(n.startswith("midlayer.") for n in tensors):  # vLLM's name for the one decoder layer
            for n in [n for n in tensors if n.startswith("layers.0.")]:
                new = "midlayer." + n.removeprefix("layers.0.")
                tensors[new] = tensors.pop(n)
                if n in origin:
                    origin[new] = origin.pop(n)
        return _load_eagle3(raw, file, target, tensors, origin, device, dtype)
    return _load_eagle(raw, file, target, tensors, origin, device)


def _drop_parallel_draft_heads(raw: dict, file: Path, tensors: dict, origin: dict) -> None:
    """NVIDIA Model Optimizer's EAGLE + Medusa heads (`eagle_config.parallel_draft_step` > 1) add Medusa heads
    (`parallel_draft_heads.*`) that guess further tokens from the EAGLE layer's output. The EAGLE layer itself
    is trained step by step as any EAGLE head (the first logits of each training step are its own), so it
    drafts here as one; the extra heads are set aside, and the note says so."""
    extra = [n for n in tensors if n.startswith("parallel_draft_heads.")]
    if not extra:
        return
    for n in extra:
        del tensors[n]
        origin.pop(n, None)
    eagle_config = raw.get("eagle_config")
    step = eagle_config.get("parallel_draft_step") if isinstance(eagle_config, dict) else None
    heads = len({n.split(".")[1] for n in extra if n.split(".")[1].isdigit()})
    log.info(f"specpipe: note: {file.parent} holds {heads or 'its'} Medusa-style parallel draft head"
             f"{'' if heads == 1 else 's'} (parallel_draft_heads.*{f', parallel_draft_step={step}' if step else ''}) "
             f"beside its EAGLE layer; specpipe drafts with the EAGLE layer, one token per forward, as it was trained, "
             f"and does not use those heads")


def _from_speculators(raw: dict, file: Path) -> dict:
    """vLLM's `speculators` format (`speculators_model_type`, e.g. RedHatAI's *.speculator.eagle3 heads): the
    decoder layer's fields sit under `transformer_layer_config`, the EAGLE-3 fields at the top, and
    norm_before_residual defaults to true (vLLM's rule for this format)."""
    kind = raw.get("speculators_model_type")
    if kind is None:
        return raw
    layer = raw.get("transformer_layer_config")
    if kind != "eagle3" or not isinstance(layer, dict):
        raise CheckpointError(f"{file}: a speculators-format head of type {kind!r}"
                              f"{'' if isinstance(layer, dict) else ' without a transformer_layer_config object'}; "
                              f"specpipe loads speculators heads of type 'eagle3' (and EAGLE-1/2 or EAGLE-3 heads in "
                              f"the EAGLE/SpecForge layout)")
    out = {**layer, "architectures": ["LlamaForCausalLMEagle3"],
           "norm_before_residual": raw.get("norm_before_residual", True)}
    for key in ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids", "eagle_config",
                *EAGLE31_FLAGS):
        if raw.get(key) is not None:
            out[key] = raw[key]
    return out


def _match(cfg: LlamaConfig, target: LlamaForCausalLM, file: Path, names: tuple[str, ...]) -> None:
    for name in names:
        mine, theirs = getattr(cfg, name), getattr(target.config, name)
        if mine != theirs:
            where = target.config.extra.get("source", "the loaded target")
            raise CheckpointError(f"{file}: field '{name}' is {mine} but the target ({where}) has {name}={theirs}; "
                                  f"this draft head was made for a different target model")


def _has_qk_norm(tensors: dict) -> bool:
    """Heads trained from a Qwen3 layer keep its per-head q/k norms; the config does not always say so."""
    return any(n.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")) for n in tensors)


def _attention_biases(raw: dict, cfg: LlamaConfig, tensors: dict) -> None:
    """q/k/v (and o) biases of a head: EAGLE-1's `qkv_bias` field (its Qwen2 heads carry `"qkv_bias": true`
    under a Llama architecture, and SafeAILab's reference gives q/k/v a bias then, o none), or bias tensors the
    head was trained with (a head from a Qwen2 layer keeps them whatever the config says)."""
    cfg.attention_bias = cfg.attention_bias or bool(raw.get("qkv_bias")) or \
        any(n.endswith("self_attn.q_proj.bias") for n in tensors)
    cfg.o_proj_bias = cfg.o_proj_bias or any(n.endswith("self_attn.o_proj.bias") for n in tensors)


def _fields(raw: dict, cfg: LlamaConfig, **more) -> dict:
    return {**raw, "head_dim": cfg.head_dim, "num_key_value_heads": cfg.num_key_value_heads, **more}


def _load_eagle(raw, file, target, tensors, origin, device) -> EagleHead:
    """EAGLE-1/2: fc (2H -> H, with bias) + layers.N.* + shared embed / lm_head. Layer 0 has no input norm in
    SafeAILab's EAGLE (and sglang / vLLM); a head trained with one saves `layers.0.input_layernorm.weight`, and
    then it is applied, not refused."""
    cfg = parse_config(raw, file, draft=True)
    cfg.qk_norm = _has_qk_norm(tensors)
    _attention_biases(raw, cfg, tensors)
    _match(cfg, target, file, ("hidden_size", "vocab_size"))
    # an lm_head in the file is not this head's: SafeAILab's EAGLE-1/2, sglang and vLLM all score drafts with the
    # target's lm_head (the head has none of its own; a copy saved with it is ignored)
    tensors.pop("lm_head.weight", None)
    with torch.device("meta"):
        head = EagleHead(cfg, target, num_layers=cfg.num_hidden_layers, fc_bias="fc.bias" in tensors,
                         own_embed="embed_tokens.weight" in tensors,
                         first_input_norm="layers.0.input_layernorm.weight" in tensors)
    fill(head, tensors, origin, file, _fields(raw, cfg), device, what="EAGLE head")
    return finish(head, cfg, device)


def _aux_layers(raw: dict, file: Path, n: int):
    """The target layers whose outputs the head reads (-1: the embeddings), or None for the defaults.

    Two conventions name them. sglang / SpecForge / EAGLE put ids in `eagle_config`: id i is layer i's output.
    vLLM and speculators put them at the top level: id j is the residual stream entering layer j, i.e. layer
    j-1's output (j=0: the embeddings, j=N: the last layer's output). When both are given, `eagle_config`
    wins, as in sglang."""
    def ints(aux, lo, hi):
        return isinstance(aux, list) and aux and all(isinstance(i, int) and not isinstance(i, bool)
                                                     and lo <= i <= hi for i in aux)
    eagle_config = raw.get("eagle_config")
    if eagle_config is not None and not isinstance(eagle_config, dict):
        raise CheckpointError(f"{file}: field 'eagle_config' is {eagle_config!r}; expected an object such as "
                              f'{{"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}} (or leave it out for the '
                              f"EAGLE-3 default layers)")
    aux = (eagle_config or {}).get("eagle_aux_hidden_state_layer_ids")
    if aux is not None:
        if not ints(aux, 0, n - 1):
            raise CheckpointError(f"{file}: field 'eagle_config.eagle_aux_hidden_state_layer_ids' is {aux!r}; "
                                  f"expected a list of target layer indices in [0, {n - 1}] (layer i's output)")
        return aux
    aux = raw.get("eagle_aux_hidden_state_layer_ids")
    if aux is None:
        return None
    if not ints(aux, 0, n):
        raise CheckpointError(f"{file}: field 'eagle_aux_hidden_state_layer_ids' is {aux!r}; expected a list of "
                              f"target layer indices in [0, {n}] (vLLM's convention: j is the input of layer j, "
                              f"{n} the last layer's output)")
    return [j - 1 for j in aux]


EAGLE31_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")


def _flag(raw: dict, file: Path, name: str, default: bool = False, top_level: bool = True) -> bool:
    """A boolean head switch: at the top level (speculators; only where `top_level`) or in eagle_config (sglang,
    vLLM and NVIDIA's heads read it there); `default` when absent."""
    eagle_config = raw.get("eagle_config") if isinstance(raw.get("eagle_config"), dict) else {}
    key, value = (name, raw[name]) if top_level and raw.get(name) is not None else \
        (f"eagle_config.{name}", eagle_config.get(name))
    if value is None:
        return default
    if not isinstance(value, bool):
        raise CheckpointError(f"{file}: field '{key}' is {value!r}; expected true or false")
    return value


def _vocab_maps(raw, file, cfg, tensors, origin, vd: int) -> None:
    """Fill in / check d2t (draft id -> offset to target id) and t2d (target id in draft vocab)."""
    vocab = cfg.vocab_size
    if "d2t" not in tensors:
        t2d = tensors.get("t2d")
        if vd != vocab and t2d is not None and t2d.dim() == 1 and t2d.shape[0] == vocab and int(t2d.bool().sum()) == vd:
            # only the target-side mask: the draft vocab is its ids in ascending order, as EAGLE-3's training
            # scripts build both maps (d2t = used ids - arange)
            tensors["d2t"] = torch.nonzero(t2d.bool())[:, 0] - torch.arange(vd)
            origin["d2t"] = origin.get("t2d", (file, "t2d"))
        elif vd != vocab:  # fill() reports the missing tensor
            return
        else:
            tensors["d2t"] = torch.zeros(vd, dtype=torch.int64)
    d2t = tensors["d2t"]
    f, key = origin.get("d2t", (file, "d2t"))
    if d2t.is_floating_point() or d2t.dtype == torch.bool or d2t.dim() != 1 or d2t.shape[0] != vd:
        raise CheckpointError(f"{f}: tensor '{key}' must be an integer vector of length draft_vocab_size={vd}, "
                              f"got {d2t.dtype} {list(d2t.shape)}")
    ids = torch.arange(vd) + d2t.long()
    if ids.min() < 0 or ids.max() >= vocab:
        raise CheckpointError(f"{f}: tensor '{key}' maps draft ids outside the target vocab (vocab_size={vocab})")
    tensors["d2t"] = d2t.long()
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    tensors["t2d"] = tensors["t2d"].bool() if "t2d" in tensors else t2d


def _load_eagle3(raw, file, target, tensors, origin, device, dtype) -> Eagle3Head:
    """EAGLE-3: midlayer.* (layers.1.* ... for a head of several layers) + fc (3*Ht -> H) + norm + lm_head (draft
    vocab) + d2t / t2d."""
    parallel = next((n for n in tensors if n.split(".")[-1] == "mask_hidden"), None)
    if parallel is not None or raw.get("parallel_drafting") is True:  # P-EAGLE (vLLM >= 0.16 runs it)
        why = f"tensor '{origin.get(parallel, (file, parallel))[1]}'" if parallel else "field 'parallel_drafting' true"
        raise CheckpointError(f"{file}: a parallel-drafting (P-EAGLE) head ({why}): it was trained to draft all its "
                              f"tokens in one forward, masked positions standing in for the hidden states it has not "
                              f"seen, and specpipe drafts one step per forward, feeding each step's hidden to the "
                              f"next, which such a head was not trained for; use an EAGLE-3 head of this target")
    cfg = parse_config(raw, file, draft=True)
    cfg.qk_norm = _has_qk_norm(tensors)
    _attention_biases(raw, cfg, tensors)
    tc = target.config
    _match(cfg, target, file, ("vocab_size",))
    own_embed = "embed_tokens.weight" in tensors
    if not own_embed and cfg.hidden_size != tc.hidden_size:  # it would embed tokens with the target's table
        raise CheckpointError(f"{file}: field 'hidden_size' is {cfg.hidden_size} and the head has no "
                              f"embed_tokens.weight of its own, so it would embed tokens with the target's table, "
                              f"whose width is {tc.hidden_size}; a head of another width needs its own embeddings")
    th = int_field(raw, "target_hidden_size", file, default=tc.hidden_size) if raw.get("target_hidden_size") \
        is not None else tc.hidden_size
    if th != tc.hidden_size:
        raise CheckpointError(f"{file}: field 'target_hidden_size' is {th} but the target has hidden_size="
                              f"{tc.hidden_size}")
    for i in range(1, cfg.num_hidden_layers):  # vLLM builds a hidden_norm into every layer; only layer 0 uses it
        tensors.pop(f"layers.{i}.hidden_norm.weight", None)
    vd = raw.get("draft_vocab_size") or cfg.vocab_size
    if not isinstance(vd, int) or not 0 < vd <= cfg.vocab_size:
        raise CheckpointError(f"{file}: field 'draft_vocab_size' is {vd!r}; expected 1..vocab_size={cfg.vocab_size}")
    if "lm_head.weight" not in tensors and vd == cfg.vocab_size:
        tensors["lm_head.weight"] = target.lm_head.weight.detach().to("cpu", dtype)  # lm_head shared
    _vocab_maps(raw, file, cfg, tensors, origin, vd)
    # false: a head trained on the target's final hidden (NVIDIA Model Optimizer's *-Eagle3-v2 heads)
    use_aux = _flag(raw, file, "use_aux_hidden_state", default=True, top_level=False)
    if use_aux:
        aux = _aux_layers(raw, file, tc.num_hidden_layers)
    else:  # the target's final hidden goes in as is, so the widths must agree; an fc saved anyway is unused (vLLM)
        aux = None
        if cfg.hidden_size != tc.hidden_size:
            raise CheckpointError(f"{file}: field 'eagle_config.use_aux_hidden_state' is false, so the head reads the "
                                  f"target's final hidden without an fc projection, but its hidden_size is "
                                  f"{cfg.hidden_size} and the target's {tc.hidden_size}")
        for n in [n for n in tensors if n.startswith(("fc.", "fc_norm.", "input_norm."))]:
            del tensors[n]
    with torch.device("meta"):
        head = Eagle3Head(cfg, target, draft_vocab_size=vd, target_hidden_size=th, aux_layers=aux,
                          fc_bias="fc.bias" in tensors, own_embed=own_embed,
                          norm_before_residual=bool(raw.get("norm_before_residual", False)),
                          use_aux_hidden_state=use_aux, **{f: _flag(raw, file, f) for f in EAGLE31_FLAGS})
    fields = _fields(raw, cfg, draft_vocab_size=vd, target_hidden_size=th)
    what = f"EAGLE-3 head (aux layers {head.aux_layers})" if use_aux else \
        "EAGLE-3 head (use_aux_hidden_state false: no fc)"
    fill(head, tensors, origin, file, fields, device, what=what)
    return finish(head, cfg, device)
