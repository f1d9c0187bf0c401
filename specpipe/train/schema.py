"""Typed config of `python -m specpipe.train`: the primary config (conf/train.yaml beside this file), the `head`
group's options (EAGLE-3, EAGLE-1) and the ranges every value must keep.

The train app reuses the decoder's `model` and `device` groups (their schemas are specpipe.config.schema's); its
own settings live here, so a typo or a bad value is one paragraph and exit 2 before any torch import.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

HEAD_KINDS = ("eagle3", "eagle1")
LAYOUTS = ("specforge", "speculators")  # EAGLE-3 folders: SpecForge/sglang (midlayer.*) or vLLM speculators
SOURCES = ("stdlib", "docs")  # built-in corpora: the interpreter's stdlib .py files, specpipe's docs/*.md
CHAT_MODES = ("auto", "never")


@dataclass
class HeadConf:
    kind: str = MISSING  # eagle3 | eagle1 (the option's own; choose it with head=...)
    ce_weight: float = 1.0  # weight of the soft cross-entropy against the target's distribution
    hidden_weight: float = 0.0  # weight of the smooth-L1 loss on the target's next hidden (EAGLE-1)
    noise: float = 0.2  # uniform noise added to the target's features, as a multiple of their std (EAGLE's)


@dataclass
class Eagle3HeadConf(HeadConf):
    kind: str = "eagle3"
    draft_vocab_size: int = 8192  # most frequent target tokens the draft scores (capped at the vocabulary)
    aux_layers: Optional[list] = None  # target layers read (layer i's output); null: EAGLE-3's 1, N/2-1, N-4
    layout: str = "specforge"  # specforge (sglang, SpecForge: midlayer.*) | speculators (vLLM: layers.0.*)
    norm_before_residual: bool = False  # the midlayer's residual is the normed hidden (speculators' default true)


@dataclass
class Eagle1HeadConf(HeadConf):
    kind: str = "eagle1"
    ce_weight: float = 0.1
    hidden_weight: float = 1.0


@dataclass
class DataConf:
    sources: list = field(default_factory=lambda: list(SOURCES))  # built-in corpora (stdlib, docs)
    dirs: list = field(default_factory=list)  # more folders of text (.py .md .txt .rst), read recursively
    # characters read from the corpora (sources in an order a hash fixes; null: all): more than the feature budget
    # takes in an hour on a CPU, and it bounds the memory the token ids take
    max_chars: Optional[int] = 4_000_000
    chat: str = "auto"  # auto: render text as chats through the target's chat template when it has one | never
    chunk_chars: int = 1800  # text is cut into pieces of about this many characters, at line ends
    seq_len: int = 1024  # tokens per training window (longer sequences are cut)
    heldout_mod: int = 64  # a source file is held out when a hash of its name % heldout_mod == 0
    max_train_tokens: Optional[int] = None  # cap on the training tokens (null: the time and memory budgets decide)
    max_feature_gb: float = 4.0  # memory the target's features may take
    soft_topk: int = 32  # target probabilities kept per position as soft labels
    distill_share: float = 0.3  # share of train.minutes for self-distillation (the target's own continuations)
    distill_new_tokens: int = 192  # tokens the target generates per distillation prompt
    distill_batch: int = 32  # requests decoded together
    distill_temperature: float = 0.8  # half of the prompts are sampled at this temperature, half greedy
    self_asked: float = 0.5  # share of distillation requests the target writes itself (chat targets: data.py)
    feature_share: float = 0.25  # share of train.minutes for the target's forward over the data


@dataclass
class LoopConf:
    minutes: float = 10.0  # wall-clock budget of the whole run: data, features, training, evaluation
    max_steps: Optional[int] = None  # stop after this many optimizer steps (0: save the initialised head)
    batch_tokens: int = 1024  # tokens per optimizer step (more, smaller steps: a short budget learns more)
    steps: int = 3  # draft steps trained (the head fed its own hidden, EAGLE-3's training-time test)
    step_decay: float = 0.8  # loss weight of draft step j: step_decay**j
    lr: float = 1e-3
    warmup: float = 0.05  # warmup, as a share of the training time
    lr_floor: float = 0.1  # final learning rate, as a share of lr (cosine decay)
    weight_decay: float = 0.0
    clip: float = 1.0  # gradient norm clip
    autocast: bool = True  # bf16 autocast, fp32 master weights (CPU: only with AVX512-BF16 or AMX, else float32)
    checkpoint_minutes: float = 5.0  # save a checkpoint (and the head) into out/checkpoint this often
    eval_share: float = 0.1  # share of train.minutes kept for the held-out evaluation at the end


@dataclass
class EvalConf:
    steps: int = 6  # draft depth of the simulated acceptance (the report's per-position rates)
    heldout_prompts: int = 16  # held-out prompts whose greedy continuations measure acceptance
    heldout_tokens: int = 32768  # held-out corpus tokens the top-1 agreement reads
    decode_prompts: int = 8  # prompts decoded through specpipe with the saved head (0: skip)
    prompt_set: str = "auto"  # built-in set for that decode (auto: chat for a chat model, else heldout)
    max_new_tokens: int = 96


@dataclass
class TrainConfig:
    model: Any = MISSING
    device: Any = MISSING
    head: Any = MISSING
    data: DataConf = field(default_factory=DataConf)
    train: LoopConf = field(default_factory=LoopConf)
    eval: EvalConf = field(default_factory=EvalConf)
    out: str = MISSING  # the head's folder: config.json, model.safetensors, train_report.json, checkpoint/
    resume: bool = False  # go on from out/checkpoint (the data, the head and its optimizer)
    seed: int = 0


def register_train_schemas() -> None:
    """The train app's schemas in Hydra's ConfigStore (base_train, head/base_eagle3, head/base_eagle1), beside the
    decoder's (model, device) that its config reuses."""
    from specpipe.config.schema import register_schemas

    register_schemas()
    cs = ConfigStore.instance()
    if "base_train.yaml" in cs.repo:  # once per process, as register_schemas
        return
    cs.store(name="base_train", node=TrainConfig)
    cs.store(group="head", name="base_eagle3", node=Eagle3HeadConf)
    cs.store(group="head", name="base_eagle1", node=Eagle1HeadConf)


def _in(errors: list, key: str, value, ok: bool, words: str) -> None:
    if not ok:
        errors.append(f"{key}={value!r} {words}")


def train_problems(cfg) -> list[str]:
    """Every value of the train app's own settings out of its range (the model's and device's are the decoder's
    rules: specpipe.config.validate)."""
    e: list[str] = []
    h, d, t, v = cfg.head, cfg.data, cfg.train, cfg.eval
    from omegaconf import OmegaConf

    own = {Eagle3HeadConf: "eagle3", Eagle1HeadConf: "eagle1"}.get(OmegaConf.get_type(h), h.kind)
    _in(e, "head.kind", h.kind, h.kind == own and h.kind in HEAD_KINDS,
        f"is the option's own; choose the head with head={'|'.join(HEAD_KINDS)} and leave head.kind alone")
    for key in ("ce_weight", "hidden_weight", "noise"):
        _in(e, f"head.{key}", h[key], h[key] >= 0, "must be >= 0")
    if h.ce_weight == 0 and h.hidden_weight == 0:
        e.append("head.ce_weight and head.hidden_weight are both 0: the head would learn nothing")
    if h.kind == "eagle3":
        _in(e, "head.draft_vocab_size", h.draft_vocab_size, h.draft_vocab_size >= 1, "must be >= 1")
        _in(e, "head.layout", h.layout, h.layout in LAYOUTS, f"is unknown (valid: {', '.join(LAYOUTS)})")
        aux = h.aux_layers
        _in(e, "head.aux_layers", aux, aux is None or (len(aux) >= 1 and all(isinstance(i, int) and i >= 0
                                                                              for i in aux)),
            "must be a list of target layer indices (layer i's output), e.g. [1,14,26], or null for EAGLE-3's")
    bad = [s for s in d.sources if s not in SOURCES]
    _in(e, "data.sources", list(d.sources), not bad, f"names unknown corpora {bad} (valid: {', '.join(SOURCES)})")
    _in(e, "data.chat", d.chat, d.chat in CHAT_MODES, f"is unknown (valid: {', '.join(CHAT_MODES)})")
    for key, lo in (("chunk_chars", 64), ("seq_len", 16), ("heldout_mod", 2), ("soft_topk", 1),
                    ("distill_new_tokens", 1), ("distill_batch", 1)):
        _in(e, f"data.{key}", d[key], d[key] >= lo, f"must be >= {lo}")
    _in(e, "data.max_chars", d.max_chars, d.max_chars is None or d.max_chars >= 1, "must be >= 1 or null")
    _in(e, "data.max_train_tokens", d.max_train_tokens, d.max_train_tokens is None or d.max_train_tokens >= 1,
        "must be >= 1 or null")
    _in(e, "data.max_feature_gb", d.max_feature_gb, d.max_feature_gb > 0, "must be > 0")
    _in(e, "data.distill_temperature", d.distill_temperature, d.distill_temperature >= 0, "must be >= 0")
    _in(e, "data.self_asked", d.self_asked, 0 <= d.self_asked <= 1, "must be in [0, 1]")
    for key in ("distill_share", "feature_share"):
        _in(e, f"data.{key}", d[key], 0 <= d[key] < 1, "must be in [0, 1)")
    _in(e, "train.minutes", t.minutes, t.minutes > 0, "must be > 0 (the wall-clock budget of the whole run)")
    _in(e, "train.max_steps", t.max_steps, t.max_steps is None or t.max_steps >= 0, "must be >= 0 or null")
    for key, lo in (("batch_tokens", 16), ("steps", 1)):
        _in(e, f"train.{key}", t[key], t[key] >= lo, f"must be >= {lo}")
    _in(e, "train.steps", t.steps, t.steps <= 16, "must be <= 16 (deeper drafts are hardly ever accepted)")
    _in(e, "train.lr", t.lr, t.lr > 0, "must be > 0")
    for key in ("step_decay", "warmup", "lr_floor", "eval_share"):
        _in(e, f"train.{key}", t[key], 0 <= t[key] <= 1, "must be in [0, 1]")
    _in(e, "train.weight_decay", t.weight_decay, t.weight_decay >= 0, "must be >= 0")
    _in(e, "train.clip", t.clip, t.clip > 0, "must be > 0")
    _in(e, "train.checkpoint_minutes", t.checkpoint_minutes, t.checkpoint_minutes > 0, "must be > 0")
    if d.distill_share + d.feature_share + t.eval_share >= 0.95:
        e.append(f"data.distill_share + data.feature_share + train.eval_share = "
                 f"{d.distill_share + d.feature_share + t.eval_share:g} leaves no time to train; keep it below 0.95")
    for key, lo in (("steps", 1), ("heldout_prompts", 1), ("heldout_tokens", 1), ("decode_prompts", 0),
                    ("max_new_tokens", 1)):
        _in(e, f"eval.{key}", v[key], v[key] >= lo, f"must be >= {lo}")
    _in(e, "eval.prompt_set", v.prompt_set, v.prompt_set in ("auto", "heldout", "chat", "code", "code_prefixes"),
        "is unknown (valid: auto, heldout, chat, code, code_prefixes)")
    if not str(cfg.out).strip():
        e.append("out is empty; give the folder the head is written to, e.g. out=heads/my-eagle3")
    return e
