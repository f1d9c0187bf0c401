"""Prompt items -> `Request`s, and what the requests ask of the run: how many run together, whether any samples,
the KV pool they need, the seed each draws from."""
from __future__ import annotations

from typing import Optional, Sequence

from specpipe.allocators.base import PoolDemand
from specpipe.config.schema import GREEDY_TEMPERATURE, SAMPLING_RULES, draft_schema
from specpipe.config.validate import one_request_slots
from specpipe.decode.request import Request
from specpipe.decode.sampling import request_seed
from specpipe.decode.stop_strings import StopStrings
from specpipe.stages.hot_buffers import buffer_slots
from specpipe.workload.prompts import UNSUPPORTED_FIELDS
from specpipe.workload.tokenizer import encode_rendered, prompt_context, render_chat

MAX_BYTES_PER_TOKEN = 1024  # no tokenizer's piece is longer: a prompt beyond that many per context token cannot fit


def make_requests(items: list[dict], tokenizer, max_new_tokens: int, max_position: int, vocab_size: int,
                  stop: Sequence[str] = (), ignore_eos: bool = False,
                  sampling: tuple = (0.0, 1.0, 0, 1.0, 0.0), logprobs: bool = False) -> list[Request]:
    """One Request per prompt; a bad prompt becomes that request's error, never the run's. `stop`: stop
    strings of every request (a prompt's own "stop" adds to them); `ignore_eos` drops them all.
    `sampling`: the run's (temperature, top_p, top_k, repetition_penalty, min_p), completed by a prompt's own where it
    sets some."""
    reqs = []
    for i, it in enumerate(items):
        r = Request(i, it.get("prompt", ""), [], it.get("max_new_tokens", max_new_tokens),
                    speculate=it.get("speculate", True), max_spec_tokens=it.get("max_spec_tokens"),
                    constraint=it.get("constraint"))
        own = it.get("sampling")
        if own:
            r.sampling = tuple(own.get(k, v) for k, v in zip(SAMPLING_RULES, sampling))
        stops = [] if ignore_eos else list(dict.fromkeys([*stop, *it.get("stop", ())]))
        reqs.append(r)
        if "error" in it:
            r.finish_reason, r.error = "error", it["error"]
            continue
        error = (refusal(r, it, (r.sampling or sampling)[0], max_new_tokens,
                         {"logprobs": logprobs, "ignore_eos": ignore_eos})
                 or read_prompt(r, it, tokenizer, max_position, vocab_size)
                 or set_stops(r, it, tokenizer, max_position, vocab_size, stops, ignore_eos))
        if error:
            r.finish_reason, r.error = "error", error
    for r, it in zip(reqs, items):  # an error found here names the prompt as the parse errors do ("line 3: ...")
        if r.error and "error" not in it and it.get("where"):
            r.error = f"{it['where']}: {r.error}"
    return reqs


def refusal(r: Request, it: dict, temperature: float, max_new_tokens: int, run_wide: dict) -> Optional[str]:
    """Why a prompt's own settings cannot run in this run (None if they can)."""
    if it.get("do_sample") is not None and it["do_sample"] != (temperature >= GREEDY_TEMPERATURE):
        return (f'field "do_sample"={str(it["do_sample"]).lower()} disagrees with the temperature '
                f"{temperature:g} it would run with, so it would be ignored; give the prompt its own "
                f'"temperature" (0 is greedy)')
    off = [k for k in it.get("run_wide", ()) if not run_wide[k]]
    if off:  # a prompt's "logprobs": true / "ignore_eos": true in a run that does not: it would do nothing
        return (f'field "{off[0]}"=true is not supported per prompt and would be ignored; '
                f"{UNSUPPORTED_FIELDS[off[0]][1]}")
    if r.max_new_tokens > max_new_tokens:
        return (f"max_new_tokens={r.max_new_tokens} is above the run's workload.max_new_tokens="
                f"{max_new_tokens}, which sizes the KV cache; raise workload.max_new_tokens (the API: "
                f"generate(max_new_tokens=...)) to allow it")
    return None


def read_prompt(r: Request, it: dict, tokenizer, max_position: int, vocab_size: int) -> Optional[str]:
    """r.prompt and r.prompt_ids from the item's ids, chat messages or text; why they cannot be read (or None)."""
    if "prompt_ids" in it:
        r.prompt_ids = list(it["prompt_ids"])
        bad = [t for t in r.prompt_ids if not 0 <= t < vocab_size]
        if bad:
            return f"prompt_ids {bad[:5]} are outside the vocabulary (valid: 0..{vocab_size - 1})"
        r.prompt = tokenizer.decode(r.prompt_ids)  # what the ids read as, for completions.jsonl and the API
        return None
    chat = "messages" in it
    if chat:  # rendered with the model's chat template; the text is kept as the prompt
        try:
            r.prompt = render_chat(tokenizer, it["messages"], **it.get("chat", {}))
        except (ValueError, TypeError) as e:  # ChatTemplateError included
            return f"the chat cannot be turned into a prompt: {e}"
    if len(r.prompt) > MAX_BYTES_PER_TOKEN * max_position:  # tokenizing 100 MB costs seconds and gigabytes
        return (f"prompt of {len(r.prompt)} characters is far more than the model's context of "
                f"{max_position} tokens holds (no token spans {MAX_BYTES_PER_TOKEN} characters); shorten it")
    try:
        r.prompt_ids = encode_rendered(tokenizer, r.prompt) if chat else tokenizer.encode(r.prompt)
    except (ValueError, TypeError) as e:  # TypeError: the tokenizers package's word for text it cannot take
        return f"the {'chat cannot be turned into a prompt' if chat else 'prompt cannot be tokenized'}: {e}"
    return None


def set_stops(r: Request, it: dict, tokenizer, max_position: int, vocab_size: int, stops: list,
              ignore_eos: bool) -> Optional[str]:
    """The request's stop ids and stop strings; why it cannot run (bad stop ids, an empty or too long prompt)."""
    bad = [t for t in it.get("stop_token_ids", ()) if t >= vocab_size]
    if bad:
        return f"stop_token_ids {bad[:5]} are outside the vocabulary (valid: 0..{vocab_size - 1})"
    if not ignore_eos:
        r.stop_ids = frozenset(it.get("stop_token_ids", ()))
    if not r.prompt_ids:
        return "empty prompt: nothing to continue from"
    if len(r.prompt_ids) + r.max_new_tokens > max_position:
        return (f"prompt of {len(r.prompt_ids)} tokens plus max_new_tokens={r.max_new_tokens} exceeds the "
                f"model's context of {max_position} tokens")
    if stops:
        special = getattr(tokenizer, "special_token_id", lambda s: None)
        r.stop_strings = StopStrings(stops, tokenizer.decode, [i for i in map(special, stops) if i is not None],
                                     prompt_context(tokenizer.decode, r.prompt_ids),
                                     silent_ids=getattr(tokenizer, "special_ids", ()),
                                     silent_from=getattr(tokenizer, "id_limit", None))
    return None


def running_batch(cfg, reqs: list[Request]) -> int:
    """How many requests can run together: `batch_size`, but never more than the run has.

    Per-row buffers, the draft state and the weight-layout timing are sized from it, so a batch_size far
    above the number of prompts (100000 for 2) costs nothing extra."""
    live = sum(not r.finished for r in reqs)  # requests that failed to parse never run
    return max(1, min(cfg.workload.batch_size, live))


def any_sampled(cfg, reqs: list[Request]) -> bool:
    """Whether any request samples (the run's temperature, or a prompt's own): the greedy-only fast paths
    are then off and greedy requests ride the sampling path as one-hots (the same tokens)."""
    G = GREEDY_TEMPERATURE
    return cfg.sampling.temperature >= G or any(r.sampling is not None and r.sampling[0] >= G for r in reqs)


def pool_demand(cfg, reqs: list[Request], pair) -> PoolDemand:
    """What the requests ask of the KV pools: `batch_size` of the longest at full length (its prompt plus what
    `config.validate.one_request_slots` reserves for new tokens, one verify tree and draft scratch), and a hot
    buffer per row for a top-k sparse target (the top_k + local keys it reads per query, HotBufferBook's)."""
    ps = cfg.allocator.page_size
    live = [len(r.prompt_ids) for r in reqs if not r.finished] or [1]
    c = pair.target.config
    sparse = getattr(c, "sparse_top_k", None)
    row = one_request_slots(cfg)
    if forced_chains(cfg, reqs):  # draft=none verifies the grammar's forced chains: a tree of their length
        row += -(-(cfg.grammar.max_forced_tokens + 1) // ps) * ps
    return PoolDemand(rows=running_batch(cfg, reqs), row_slots=-(-max(live) // ps) * ps + row,
                      context=c.max_position_embeddings,
                      hot_buffer_slots=buffer_slots((sparse or 0) + getattr(c, "sparse_local", 0), ps))


def forced_chains(cfg, reqs: list[Request]) -> bool:
    """draft=none verifies forced chains through the speculative loop (a constrained request, grammar.jump_forward)."""
    g = cfg.get("grammar")
    return (g is not None and bool(g.jump_forward) and not draft_schema(cfg.draft).speculates
            and any(r.constraint is not None and not r.finished for r in reqs))


def seed_requests(cfg, reqs: list[Request], items: list[dict]) -> None:
    """Each request's own sampling seed: a prompt's "seed", else one derived from the run's and its index."""
    base_seed = cfg.sampling.seed if cfg.sampling.seed is not None else cfg.seed
    for r, it in zip(reqs, items):
        r.seed = request_seed(base_seed, r.index, it.get("seed"))
