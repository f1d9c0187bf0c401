"""The token sequences a head trains and is measured on: corpus pieces (through the chat template where the target
has one) and self-distillation, the target's own continuations decoded by specpipe (`specpipe.run.run`, plain
decoding, half greedy and half sampled), within the share of the time budget `data.distill_share` gives.

Held out: the pieces of held-out sources, and the target's greedy continuations of held-out prompts, whose
generated part is exactly what the target emits (the simulated acceptance reads it; `Seq.score_from` marks it).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from omegaconf import DictConfig, open_dict

from specpipe.notes import logger
from specpipe.train.corpus import (as_chat, distill_messages, everyday_requests, is_heldout, pieces, read_text,
                                   sources, stable_hash, title_of)

log = logger(__name__)


@dataclass
class Seq:
    ids: list  # token ids
    # the first position whose target distribution is a label (0: all; a continuation: the prompt's last position,
    # whose distribution gives the first generated token)
    score_from: int = 0
    origin: str = "corpus"  # corpus | greedy | sampled


@dataclass
class Data:
    train: list = field(default_factory=list)  # [Seq]
    heldout: list = field(default_factory=list)  # corpus pieces of held-out sources
    heldout_greedy: list = field(default_factory=list)  # greedy continuations of held-out prompts
    stats: dict = field(default_factory=dict)


def uses_chat(cfg: DictConfig, tokenizer) -> bool:
    return cfg.data.chat == "auto" and getattr(tokenizer, "chat_template", None) is not None


def encode_piece(tokenizer, chat: bool, messages: list) -> list:
    """A conversation's ids through the chat template, or the assistant's text as is."""
    from specpipe.workload.tokenizer import encode_rendered

    if chat:
        return encode_rendered(tokenizer, tokenizer.chat_template.render(messages, add_generation_prompt=False))
    return tokenizer.encode(messages[-1]["content"])


def corpus(cfg: DictConfig, tokenizer) -> tuple[list, list, list]:
    """(train Seqs, held-out Seqs, distillation requests as (text, source kind, held out)) from the corpora."""
    chat, d = uses_chat(cfg, tokenizer), cfg.data
    train, held, asks, chars = [], [], [], 0
    found = sources(list(d.sources), list(d.dirs))
    if d.max_chars is not None:  # a sample of the sources, the same for every run
        found.sort(key=lambda s: stable_hash("source", s.name))
    for src in found:
        out = is_heldout(src.name, d.heldout_mod)  # (held-out sources are read whatever data.max_chars says)
        if not out and d.max_chars is not None and chars >= d.max_chars:
            continue
        text = read_text(src.path)
        if text is None:
            continue
        chars += 0 if out else len(text)
        title = title_of(src, text)
        for i, piece in enumerate(pieces(text, d.chunk_chars)):
            ids = encode_piece(tokenizer, chat, as_chat(src, title, piece, i))
            (held if out else train).append(Seq(ids, 0, "corpus"))
            if chat:
                asks.append((distill_messages(src, title, piece, i), src.kind, out))
            else:  # a context to continue: the piece's first part, cut at a line end
                head = "".join(piece.splitlines(keepends=True)[:max(3, piece.count("\n") // 3)])
                asks.append((head, src.kind, out))
    asks.sort(key=lambda a: stable_hash(cfg.seed, a[0]))
    if chat:  # a chat model is asked more than code and docs: every third request is an everyday one
        n = sum(1 for a in asks if not a[2])
        everyday = [(t, "chat", is_heldout(t, d.heldout_mod)) for t in everyday_requests(n // 2 + 1, cfg.seed)]
        m = min(len(everyday), len(asks) // 2)
        asks = [a for i in range(m) for a in (everyday[i], asks[2 * i], asks[2 * i + 1])] + asks[2 * m:] + everyday[m:]
    return train, held, asks


def decode_config(cfg: DictConfig, overrides: list[str], values: Optional[dict] = None,
                  layout: str = "row") -> DictConfig:
    """A config of `python -m specpipe` for the train config's target and device, with `overrides`, then `values`
    (dotted key -> value, set after composing: a path is never parsed as override grammar). `layout`: the
    weights' (`device.weight_layout`, fixed: `auto` would time every shape on every call)."""
    from omegaconf import OmegaConf

    from specpipe.config.build import group_targets
    from specpipe.config.compose import compose_config

    option = next(o for o, t in group_targets("model").items() if t == cfg.model._target_)
    main = compose_config([f"model={option}", f"device.weight_layout={layout}", f"seed={cfg.seed}", *overrides])
    with open_dict(main):
        for k in cfg.model:
            main.model[k] = cfg.model[k]
        for k in cfg.device:
            if k != "weight_layout":
                main.device[k] = cfg.device[k]
        for k, v in (values or {}).items():
            OmegaConf.update(main, k, v)
    return main


def prompt_ids(tokenizer, text: str, chat: bool, room: int) -> Optional[list]:
    """A request's ids: a chat's through the template (None when longer than `room`), a text's last `room`."""
    from specpipe.workload.tokenizer import encode_chat

    if chat:
        ids = encode_chat(tokenizer, [{"role": "user", "content": text}])[1]
        return ids if len(ids) <= room else None
    return tokenizer.encode(text)[-room:]


def decode_plain(cfg: DictConfig, pair, items: list, new_tokens: int, batch: int) -> list:
    """The target's requests for `items` (specpipe.run.run, draft=none), its KV pool freed after: the features'
    forwards need none. The weights run oneDNN-packed where the device can (CPU; elsewhere `packed` is `row`):
    on SmolLM2 at batch 32 (2 cores) that decoded 1.32x row-major's tokens/s (scripts/bench_distill.py). They
    stay packed until `prepare_data` lays them out row-major again for the features (whose long prefills run
    faster so)."""
    from specpipe.run import run

    main = decode_config(cfg, ["draft=none", f"workload.max_new_tokens={new_tokens}", f"workload.batch_size={batch}"],
                         layout="packed")
    reqs = run(main, quiet=True, pair=pair, items=items)["requests"]
    pair.target.kv = None
    return reqs


def generate(cfg: DictConfig, pair, asks: list, chat: bool, new_tokens: int, batch: int, temperature: float,
             seed: int) -> list[Seq]:
    """The target's continuations of `asks` (plain decoding through specpipe.run.run), every other one sampled at
    `temperature` (0: all greedy): prompt + output as a Seq whose labels start at the prompt's last position.
    Prompts are cut (texts) or left out (chats) to leave room for `new_tokens` in the target's context."""

    room = pair.target.config.max_position_embeddings - new_tokens - 1
    items = []
    for i, (text, _, _) in enumerate(asks):
        ids = prompt_ids(pair.tokenizer, text, chat, room) if room > 0 else None
        if ids:
            items.append({"prompt_ids": ids, "sampling": {"temperature": temperature if i % 2 else 0.0},
                          "seed": seed + i})
    if not items:
        return []
    reqs = decode_plain(cfg, pair, items, new_tokens, batch)
    return [Seq(list(r.prompt_ids) + list(r.output_ids), max(1, len(r.prompt_ids) - 1),
                "sampled" if it["sampling"]["temperature"] else "greedy")
            for r, it in zip(reqs, items) if r.error is None and r.output_ids]


def query_prefix(tokenizer) -> Optional[list]:
    """The ids a chat template writes before a user's words (its system turn, the user turn's opener), or None
    when the template puts nothing that ends before them."""
    from specpipe.workload.tokenizer import encode_rendered

    template, mark = getattr(tokenizer, "chat_template", None), "\x00USER\x00"
    if template is None:
        return None
    try:
        text = template.render([{"role": "user", "content": mark}], add_generation_prompt=False)
    except Exception as e:  # a template that refuses a lone user turn: no requests of its own, the rest goes on
        log.info(f"specpipe.train: note: the chat template does not render a lone user turn ({e}); "
                 f"data.self_asked is left out")
        return None
    cut = text.find(mark)
    return encode_rendered(tokenizer, text[:cut]) if cut > 0 else None


def self_asked(cfg: DictConfig, pair, n: int, seed: int, avoid: frozenset) -> list[tuple]:
    """Up to `n` requests the target writes itself: sampled (temperature 1, top-p 0.95) from its chat template's
    user-turn opener (Magpie's way), kept when the turn ended within 64 tokens. A chat model's own idea of a user
    is far more varied than a list of subjects (a SmolLM2 head trained on templated requests agreed with the
    target on 43 % of its held-out templated continuations, 24 % of the hand-written chat set's). Requests in
    `avoid` (the built-in prompt sets, normalised) are dropped, so no measured prompt is trained on."""

    prefix = query_prefix(pair.tokenizer) if n > 0 else None
    if not prefix:
        return []
    items = [{"prompt_ids": prefix, "sampling": {"temperature": 1.0, "top_p": 0.95}, "seed": seed + i}
             for i in range(n)]
    reqs = decode_plain(cfg, pair, items, 64, n)
    texts = [pair.tokenizer.decode(r.output_ids).strip() for r in reqs if r.error is None and r.finish_reason == "stop"]
    return [(t, "chat", False) for t in texts if len(t) >= 8 and " ".join(t.lower().split()) not in avoid]


def builtin_requests() -> frozenset:
    """The user turns of the built-in chat and code sets, normalised: what `self_asked` must not train on."""
    from specpipe.workload.prompts import CHAT_SETS, chat_set

    return frozenset(" ".join(m["content"].lower().split()) for name in CHAT_SETS for it in chat_set(name)
                     for m in it.get("messages", []) if m.get("role") == "user")


def distill(cfg: DictConfig, pair, asks: list, chat: bool, seconds: float, tick: Callable) -> list[Seq]:
    """Continuations of the training asks until `seconds` are spent (half greedy, half sampled); a batch is not
    started when the last one says it would not finish in time. With a chat template, `data.self_asked` of each
    batch are requests the target wrote itself (`self_asked`)."""
    d, t0, out, took = cfg.data, time.perf_counter(), [], 0.0
    todo = [a for a in asks if not a[2]]
    own = min(d.distill_batch, round(d.self_asked * d.distill_batch)) if chat and query_prefix(pair.tokenizer) else 0
    avoid = builtin_requests() if own else frozenset()
    at = 0
    while at < len(todo) or own:
        left = seconds - (time.perf_counter() - t0)
        if left <= 0 or took > left:
            break
        t1 = time.perf_counter()
        seed = cfg.seed * 1000003 + len(out) * 7 + at
        batch = self_asked(cfg, pair, own, seed, avoid) + todo[at:at + d.distill_batch - own]
        at += d.distill_batch - own
        if not batch:
            break
        out += generate(cfg, pair, batch, chat, d.distill_new_tokens, d.distill_batch, d.distill_temperature, seed)
        took = time.perf_counter() - t1
        tick(time.perf_counter() - t0, f"{len(out)} continuations, {sum(len(s.ids) for s in out) / 1e3:.0f}k tok")
    return out


def prepare_data(cfg: DictConfig, pair, seconds: float, tick: Optional[Callable] = None) -> Data:
    """Corpus pieces, the held-out prompts' greedy continuations, then self-distillation within `seconds`."""
    tick = tick or (lambda *a: None)
    try:
        return _prepare(cfg, pair, seconds, tick)
    finally:  # the decodes packed the weights; the features and the head's copies read them row-major
        from specpipe.devices.weight_layout import unpack_weights

        unpack_weights([pair.target])


def _prepare(cfg: DictConfig, pair, seconds: float, tick: Callable) -> Data:
    t0 = time.perf_counter()
    chat = uses_chat(cfg, pair.tokenizer)
    train, held, asks = corpus(cfg, pair.tokenizer)
    if not train:
        from specpipe.errors import ConfigError

        raise ConfigError(f"the corpora data.sources={list(cfg.data.sources)} data.dirs={list(cfg.data.dirs)} hold "
                          f"no training text (every source is empty, unreadable or held out)")
    held_asks = [a for a in asks if a[2]][:cfg.eval.heldout_prompts]
    greedy = generate(cfg, pair, held_asks, chat, cfg.eval.max_new_tokens, cfg.data.distill_batch, 0.0,
                      cfg.seed + 7) if held_asks else []
    tick(time.perf_counter() - t0, f"{len(greedy)} held-out continuations")
    own = distill(cfg, pair, asks, chat, seconds - (time.perf_counter() - t0), tick) if cfg.data.distill_share else []
    stats = {"chat_template": chat, "corpus_pieces": len(train), "corpus_tokens": sum(len(s.ids) for s in train),
             "distill_sequences": len(own), "distill_tokens": sum(len(s.ids) for s in own),
             "distill_greedy": sum(s.origin == "greedy" for s in own),
             "distill_sampled": sum(s.origin == "sampled" for s in own),
             "heldout_pieces": len(held), "heldout_prompts": len(greedy),
             "heldout_generated_tokens": sum(len(s.ids) - s.score_from for s in greedy),
             "seconds": round(time.perf_counter() - t0, 1)}
    return Data(train=own + train, heldout=held, heldout_greedy=greedy, stats=stats)


def data_state(data: Data) -> dict:
    """The data as tensors and plain values (a checkpoint loads it with torch.load(weights_only=True))."""
    import torch

    def pack(seqs):
        return {"ids": [torch.tensor(s.ids, dtype=torch.int32) for s in seqs],
                "score_from": [s.score_from for s in seqs], "origin": [s.origin for s in seqs]}
    return {"train": pack(data.train), "heldout": pack(data.heldout), "heldout_greedy": pack(data.heldout_greedy),
            "stats": data.stats}


def data_from_state(state: dict) -> Data:
    def unpack(p):
        return [Seq(t.tolist(), f, o) for t, f, o in zip(p["ids"], p["score_from"], p["origin"])]
    return Data(unpack(state["train"]), unpack(state["heldout"]), unpack(state["heldout_greedy"]), state["stats"])
