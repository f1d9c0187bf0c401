"""New EAGLE heads for a target (specpipe's own modules, so what trains is what `draft.path` loads), their draft
vocabulary, and the folders they are saved as.

EAGLE-3 (`models/eagle3.py`): fc over three target layers, the midlayer, a norm and an lm_head over a reduced
draft vocabulary. The draft vocabulary is the `draft_vocab_size` most frequent target tokens of the training data,
in ascending id order, as SpecForge builds it: `d2t[d] = id - d` (draft id d is target id d + d2t[d]) and `t2d` the
target-side mask; its lm_head starts from the target's rows for those tokens (and its norm from the target's,
scaled to logits of std 1). EAGLE-1 (`models/eagle.py`): fc over
[embedding, final hidden] and one decoder layer; embeddings and lm_head are the target's.

Layouts: `specforge` writes what SpecForge saves and sglang loads (architectures LlamaForCausalLMEagle3, midlayer.*,
eagle_config.eagle_aux_hidden_state_layer_ids); `speculators` what vLLM's speculators library saves
(speculators_model_type eagle3, transformer_layer_config, layers.0.*, aux ids in vLLM's convention: +1).
"""
from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor, nn

from specpipe.models.eagle import EagleHead
from specpipe.models.eagle3 import Eagle3Head, default_aux_layers
from specpipe.models.hf.save import config_to_hf, save_eagle
from specpipe.models.llama import LlamaForCausalLM


def head_config(target: LlamaForCausalLM):
    """The target's config for a one-layer head: full attention, no sparse attention, nothing tied (an EAGLE-3
    lm_head over a reduced vocabulary is the head's own)."""
    cfg = copy.deepcopy(target.config)
    cfg.num_hidden_layers, cfg.tie_word_embeddings = 1, False
    cfg.sliding_window, cfg.layer_types, cfg.sparse_top_k = None, None, None
    return cfg


def draft_vocab(counts: Tensor, size: int) -> Tensor:
    """The `size` most frequent token ids (ties: the lower id), ascending."""
    order = torch.sort(counts, descending=True, stable=True).indices[:min(size, counts.numel())]
    return order.sort().values.to(torch.int64)


def vocab_maps(ids: Tensor, vocab: int) -> tuple[Tensor, Tensor]:
    """(d2t [Vd] int64, t2d [V] bool) for the draft vocabulary `ids` (ascending target ids)."""
    d2t = ids - torch.arange(ids.numel())
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d


def _init(module: nn.Module, gen: torch.Generator) -> None:
    """N(0, 0.02) weights, residual outputs scaled by 1/sqrt(2), norms at 1, biases 0 (GPT-2's scheme)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                std = 0.02 / math.sqrt(2) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def new_head(hc, target: LlamaForCausalLM, ids: Optional[Tensor], seed: int) -> nn.Module:
    """A freshly initialised head for `target` (`hc`: the head config; `ids`: EAGLE-3's draft vocabulary)."""
    cfg, gen = head_config(target), torch.Generator().manual_seed(seed)
    if hc.kind == "eagle1":
        head = EagleHead(cfg, target, num_layers=1, fc_bias=True)
        _init(head, gen)
        return head
    aux = list(hc.aux_layers) if hc.aux_layers is not None else default_aux_layers(target.config.num_hidden_layers)
    head = Eagle3Head(cfg, target, draft_vocab_size=int(ids.numel()), aux_layers=aux,
                      norm_before_residual=bool(hc.norm_before_residual))
    _init(head, gen)
    d2t, t2d = vocab_maps(ids, cfg.vocab_size)
    with torch.no_grad():
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
        w = target.lm_head.weight.detach()[ids].float()
        head.lm_head.weight.copy_(w)
        # the target's final norm, scaled so that the random start gives logits of std 1: at the target's own
        # scale (std 6.5 for SmolLM2) its confident random guesses started the cross-entropy near 28
        g = target.norm.weight.detach().float()
        probe = torch.randn(256, cfg.hidden_size, generator=gen)
        head.norm.weight.copy_(g / ((probe * g) @ w.T).std().clamp_min(1e-6))
    return head


def trainable(head: nn.Module) -> list:
    """The head's own parameters (the target's shared embedding and lm_head stay frozen, and out of the list)."""
    return [p for p in head.parameters() if p.requires_grad]


def save_head(head: nn.Module, folder: Path, layout: str, target: LlamaForCausalLM, steps: int) -> Path:
    """Write config.json + model.safetensors (bf16 weights) in `layout`."""
    folder = Path(folder)
    if not isinstance(head, Eagle3Head):
        save_eagle(head, folder, dtype="bfloat16")
        _edit_config(folder, lambda c: c.update(architectures=[c["architectures"][0] + "Eagle"]))
        return folder
    if layout == "specforge":
        return save_eagle(head, folder, dtype="bfloat16")
    return save_speculators(head, folder, target, steps)


def _edit_config(folder: Path, edit) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config, indent=2) + "\n")


def save_speculators(head: Eagle3Head, folder: Path, target: LlamaForCausalLM, steps: int) -> Path:
    """vLLM speculators' EAGLE-3 layout: the layer's fields under transformer_layer_config, tensors layers.0.*,
    aux ids as the input of layer j (layer i's output is j = i + 1), norm_before_residual written out (its
    default there is true)."""
    from safetensors.torch import save_file

    from specpipe.models.hf.save import unfused

    folder.mkdir(parents=True, exist_ok=True)
    layer = config_to_hf(head.config)
    layer.update(num_hidden_layers=1 + len(head.layers))
    tc = target.config
    config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
              "draft_vocab_size": head.draft_vocab_size, "norm_before_residual": head.midlayer.norm_before_residual,
              "target_hidden_size": tc.hidden_size, "transformer_layer_config": layer,
              "eagle_aux_hidden_state_layer_ids": [i + 1 for i in head.aux_layers],
              "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                     "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": steps}],
                                     "verifier": {"name_or_path": tc.extra.get("source"),
                                                  "architectures": [config_to_hf(tc)["architectures"][0]]}}}
    tensors = {}
    for n, t in unfused(head.state_dict()).items():
        t = t.detach().to("cpu", torch.bfloat16 if t.is_floating_point() else t.dtype).contiguous().clone()
        tensors["layers.0." + n.removeprefix("midlayer.") if n.startswith("midlayer.") else n] = t
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder
