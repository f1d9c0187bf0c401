"""run(cfg): validate, build the device, model, allocator and pipeline from config, decode, write outputs."""
from __future__ import annotations

import inspect
import json
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch
from omegaconf import DictConfig

from specpipe.build import build
from specpipe.compile_policy import parse_policy
from specpipe.metrics import Metrics, recompile_count, recompile_limit_hits
from specpipe.models.llama import fuse_projections
from specpipe.errors import ConfigError
from specpipe.pipeline import PlainPipeline, Request
from specpipe.resume import META, PARTIAL, carry_finished, model_files_digest, model_folders, partial_meta, \
    read_partial
from specpipe.proposers import EagleProposer, NgramProposer, StandaloneProposer
from specpipe.runner import run_requests
from specpipe.sampling import SamplingState, request_seed
from specpipe.schema import GREEDY_TEMPERATURE, SAMPLING_RULES
from specpipe.stages.prepare_decode import check_sparse_model, check_window_pool, target_kv_layout
from specpipe.tokenizer import encode_rendered, output_text, prompt_context, render_chat, stop_token_ids
from specpipe.spec_pipeline import SpecPipeline
from specpipe.stop_strings import StopStrings
from specpipe.validate import allocator_kind, one_request_slots, run_stop_strings, to_container, validate, \
    window_problems, window_row_slots
from specpipe.workload import load_prompts


_PAIR_CACHE: dict = {}  # weights kept across the jobs of an in-process sweep
MODEL_LOADS = [0]  # how many times weights were loaded in this process (tests check sweeps reuse them)


def folder_state(path: Optional[str]) -> tuple:
    """(name, size, mtime) of a checkpoint folder's files and its subfolders' (an EAGLE head kept inside): a
    folder re-saved in place between two runs of one process (a notebook, an eval during training) is loaded
    again rather than served from the cache."""
    if not path:
        return ()
    out = []
    try:
        for top in os.scandir(Path(path).expanduser()):
            entries = os.scandir(top.path) if top.is_dir() else (top,)
            for e in entries:
                if e.is_file():
                    st = e.stat()
                    out.append((os.path.relpath(e.path, path), st.st_size, st.st_mtime_ns))
    except OSError:
        return ()  # loading it reports what is wrong
    return tuple(sorted(out))


def model_dtype(cfg: DictConfig) -> str:
    """The dtype the weights run in: model.dtype, else device.dtype. model.dtype=auto takes the checkpoint's own,
    as transformers' from_pretrained(dtype="auto") does (`models.hf.checkpoint_dtype`); a model built in memory
    (random_tiny) has none and takes device.dtype."""
    want = cfg.model.get("dtype")
    if want != "auto":
        return want or cfg.device.dtype
    from specpipe.models.hf import TINY_TARGET, checkpoint_dtype

    target = str(cfg.model.get("_target_", ""))
    if target.endswith(".load_hf"):
        return checkpoint_dtype(os.path.expanduser(str(cfg.model.path)))
    if target.endswith(".load_tiny"):
        return checkpoint_dtype(TINY_TARGET)
    return cfg.device.dtype


def load_pair(cfg: DictConfig, dtype: str, device):
    """Build the model pair, or reuse it when an earlier job of this process loaded the same one (the same
    settings, and the same files in its folders)."""
    from omegaconf import OmegaConf

    draft_path = cfg.draft.path if cfg.draft.method == "eagle" else None
    key = (OmegaConf.to_yaml(cfg.model), dtype, str(device.torch_device), draft_path,
           folder_state(cfg.model.get("path")), folder_state(draft_path))
    if key not in _PAIR_CACHE:
        _PAIR_CACHE.clear()  # keep one pair: sweeps over models should not pile up weights
        MODEL_LOADS[0] += 1
        with torch.random.fork_rng(devices=[]):  # module constructors' initial weights (then loaded over) draw
            _PAIR_CACHE[key] = build(cfg.model, "model", dtype=dtype, device=str(device.torch_device),
                                     draft_path=draft_path)
    return _PAIR_CACHE[key]


def make_wrap(cfg: DictConfig, device, metrics: Optional[Metrics] = None):
    """The binder stages call once per branch: the branch's policy, translated by the device.

    A compiled branch that runs a model forward is timed as model time as a whole (`Metrics.model_branch`):
    the per-module timer hooks cannot run inside a compiled graph. `wrap.asked` collects the policy keys the
    stages asked for (`unapplied_policies` names the others)."""
    def wrap(stage: str, branch: str, fn):
        wrap.asked.add(f"{stage}.{branch}")
        policy = cfg.compile.get(stage, {}).get(branch) if stage in cfg.compile else None
        if policy is None:
            return fn
        parsed = parse_policy(policy)
        out = device.compile(fn, parsed, name=f"{stage}.{branch}")
        owner = getattr(fn, "__self__", None)
        if parsed.mode != "eager" and branch in getattr(owner, "model_branches", ()):
            wrap.compiled_model = wrap.compiled_model or out is not fn
            if metrics is not None:
                out = metrics.model_branch(out)
        return out
    wrap.asked = set()
    wrap.compiled_model = False  # a branch running a model forward compiles (or graphs): its weights' strides stay
    return wrap


def unapplied_policies(cfg: DictConfig, asked: set) -> list[str]:
    """Non-eager compile policies for branches this run does not have (draft=none has only verify.target_forward,
    draft=ngram no draft_topk; with draft_topk.fused, `first` is unused), said once: they run nothing."""
    out = [f"compile.{stage}.{branch}={value}" for stage, branches in cfg.compile.items()
           for branch, value in branches.items()
           if not isinstance(value, bool) and str(value).strip() != "eager" and f"{stage}.{branch}" not in asked]
    if out:
        from specpipe.report_console import drafter_name

        settable = sorted(b for b in asked if b.split(".")[0] in cfg.compile)  # (not the stages that always run eager)
        print(f"specpipe: note: {', '.join(out)}: no branch of this run (draft={drafter_name(cfg.draft)}) reads "
              f"it, so it compiles nothing (the run's branches: {', '.join(settable) or 'none, plain decoding'})",
              file=sys.stderr)
    return out


def running_batch(cfg: DictConfig, reqs: list[Request]) -> int:
    """How many requests can run together: `batch_size`, but never more than the run has.

    Per-row buffers, the draft state and the weight-layout timing are sized from it, so a batch_size far
    above the number of prompts (100000 for 2) costs nothing extra."""
    live = sum(not r.finished for r in reqs)  # requests that failed to parse never run
    return max(1, min(cfg.workload.batch_size, live))


def workload_slots(cfg: DictConfig, reqs: list[Request]) -> int:
    """A pool for `batch_size` of the longest requests at full length (prompt plus what
    `validate.one_request_slots` reserves for new tokens, one verify tree and draft scratch).

    Sizing it from the workload (rather than a fixed large pool) keeps KV memory and the pool's
    set-up time proportional to what the run can use; set allocator.num_slots to override.
    """
    ps = cfg.allocator.page_size
    live = [len(r.prompt_ids) for r in reqs if not r.finished] or [1]
    return running_batch(cfg, reqs) * (-(-max(live) // ps) * ps + one_request_slots(cfg))


def hisparse_device_slots(cfg: DictConfig, reqs: list[Request], pair) -> int:
    """allocator=hisparse's num_slots when null. HiSparseAllocator(num_slots) is the *device* pool and its logical
    (host) pool is num_slots x host_to_device_ratio, which every live token holds an id in and which the KV cache
    is sized by; so the logical pool gets the workload (what allocator=token's pool holds) and the device pool
    1/ratio of it, but never less than batch_size hot buffers (HotBufferBook's, of the model's top_k + local keys)."""
    from specpipe.stages.hot_buffers import buffer_slots

    ps, ratio = cfg.allocator.page_size, cfg.allocator.host_to_device_ratio
    c = pair.target.config
    buffer = buffer_slots((c.sparse_top_k or 0) + c.sparse_local, ps)
    return max(-(-workload_slots(cfg, reqs) // (ratio * ps)) * ps, running_batch(cfg, reqs) * buffer)


SWA_PREFILL_TOKENS = 2048  # prompt tokens a null swa_num_slots leaves each row beyond its window (sglang's chunk)


def window_pool_slots(cfg: DictConfig, reqs: list[Request], full_slots: int, context: int) -> int:
    """allocator=swa's window pool when `swa_num_slots` is null: `batch_size` rows of what one keeps there (its
    window, one step's draft and verify space) plus SWA_PREFILL_TOKENS of prompt; never more than the full pool.

    A window pool as large as the full pool saves nothing; this one stops growing with the context, so a long
    context costs sliding layers a window, not its length. A prompt up to window + 2048 tokens still prefills in
    one forward, a longer one in chunks of about 2048 (each frees what left the window before the next)."""
    ps = cfg.allocator.page_size
    row = window_row_slots(cfg, cfg.allocator.window, context) + -(-SWA_PREFILL_TOKENS // ps) * ps
    return min(full_slots, running_batch(cfg, reqs) * row)


def build_allocator(cfg: DictConfig, device, num_slots: Optional[int] = None, window_slots: Optional[int] = None):
    """The configured allocator; `num_slots` and `window_slots` stand in for a null allocator.num_slots and
    allocator.swa_num_slots."""
    kwargs = {"device": device.torch_device}
    if cfg.allocator.num_slots is None:
        kwargs["num_slots"] = num_slots
    if window_slots is not None and cfg.allocator.get("swa_num_slots") is None:
        kwargs["swa_num_slots"] = window_slots
    target = cfg.allocator._target_
    from hydra.utils import get_method
    params = inspect.signature(get_method(target)).parameters
    if "kernels" in params:
        kwargs["kernels"] = device.allocator_kernels
    return build(cfg.allocator, "allocator", **kwargs)


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
        r = Request(i, it.get("prompt", ""), [], it.get("max_new_tokens", max_new_tokens))
        own = it.get("sampling")
        if own:
            r.sampling = tuple(own.get(k, v) for k, v in zip(SAMPLING_RULES, sampling))
        stops = [] if ignore_eos else list(dict.fromkeys([*stop, *it.get("stop", ())]))
        reqs.append(r)
        if "error" in it:
            r.finish_reason, r.error = "error", it["error"]
            continue
        temperature = (r.sampling or sampling)[0]
        if it.get("do_sample") is not None and it["do_sample"] != (temperature >= GREEDY_TEMPERATURE):
            r.finish_reason = "error"
            r.error = (f'field "do_sample"={str(it["do_sample"]).lower()} disagrees with the temperature '
                       f"{temperature:g} it would run with, so it would be ignored; give the prompt its own "
                       f'"temperature" (0 is greedy)')
            continue
        off = [k for k in it.get("run_wide", ()) if not {"logprobs": logprobs, "ignore_eos": ignore_eos}[k]]
        if off:  # a prompt's "logprobs": true / "ignore_eos": true in a run that does not: it would do nothing
            from specpipe.workload import UNSUPPORTED_FIELDS

            r.finish_reason = "error"
            r.error = f'field "{off[0]}"=true is not supported per prompt and would be ignored; {UNSUPPORTED_FIELDS[off[0]][1]}'
            continue
        if r.max_new_tokens > max_new_tokens:
            r.finish_reason = "error"
            r.error = (f"max_new_tokens={r.max_new_tokens} is above the run's workload.max_new_tokens="
                       f"{max_new_tokens}, which sizes the KV cache; raise workload.max_new_tokens (the API: "
                       f"generate(max_new_tokens=...)) to allow it")
            continue
        if "prompt_ids" in it:
            r.prompt_ids = list(it["prompt_ids"])
            bad = [t for t in r.prompt_ids if not 0 <= t < vocab_size]
            if bad:
                r.finish_reason = "error"
                r.error = f"prompt_ids {bad[:5]} are outside the vocabulary (valid: 0..{vocab_size - 1})"
                continue
            r.prompt = tokenizer.decode(r.prompt_ids)  # what the ids read as, for completions.jsonl and the API
        elif "messages" in it:  # rendered with the model's chat template; the text is kept as the prompt
            try:
                r.prompt = render_chat(tokenizer, it["messages"], **it.get("chat", {}))
            except (ValueError, TypeError) as e:  # ChatTemplateError included
                r.finish_reason, r.error = "error", f"the chat cannot be turned into a prompt: {e}"
                continue
        if "prompt_ids" not in it:  # a text (a chat's rendered one too) to tokenize
            if len(r.prompt) > MAX_BYTES_PER_TOKEN * max_position:  # tokenizing 100 MB costs seconds and gigabytes
                r.finish_reason = "error"
                r.error = (f"prompt of {len(r.prompt)} characters is far more than the model's context of "
                           f"{max_position} tokens holds (no token spans {MAX_BYTES_PER_TOKEN} characters); shorten it")
                continue
            chat = "messages" in it
            try:
                r.prompt_ids = encode_rendered(tokenizer, r.prompt) if chat else tokenizer.encode(r.prompt)
            except (ValueError, TypeError) as e:  # TypeError: the tokenizers package's word for text it cannot take
                r.finish_reason = "error"
                r.error = f"the {'chat cannot be turned into a prompt' if chat else 'prompt cannot be tokenized'}: {e}"
                continue
        bad = [t for t in it.get("stop_token_ids", ()) if t >= vocab_size]
        if bad:
            r.finish_reason = "error"
            r.error = f"stop_token_ids {bad[:5]} are outside the vocabulary (valid: 0..{vocab_size - 1})"
            continue
        if not ignore_eos:
            r.stop_ids = frozenset(it.get("stop_token_ids", ()))
        if not r.prompt_ids:
            r.finish_reason, r.error = "error", "empty prompt: nothing to continue from"
        elif len(r.prompt_ids) + r.max_new_tokens > max_position:
            r.finish_reason = "error"
            r.error = (f"prompt of {len(r.prompt_ids)} tokens plus max_new_tokens={r.max_new_tokens} exceeds the "
                       f"model's context of {max_position} tokens")
        elif stops:
            special = getattr(tokenizer, "special_token_id", lambda s: None)
            r.stop_strings = StopStrings(stops, tokenizer.decode, [i for i in map(special, stops) if i is not None],
                                         prompt_context(tokenizer.decode, r.prompt_ids),
                                         silent_ids=getattr(tokenizer, "special_ids", ()),
                                         silent_from=getattr(tokenizer, "id_limit", None))
    for r, it in zip(reqs, items):  # an error found here names the prompt as the parse errors do ("line 3: ...")
        if r.error and "error" not in it and it.get("where"):
            r.error = f"{it['where']}: {r.error}"
    return reqs


def build_proposer(cfg: DictConfig, pair, max_requests: int, max_context: int, device, sampled: bool = False,
                   keep: Optional[dict] = None):
    """The drafter `cfg.draft` names; `sampled`: some request samples (a standalone chain then samples its
    drafts, for rejection sampling). `keep`: state carried from one run to the next (the API's calls): the
    suffix cache of finished outputs, reused when its size and device are the same."""
    d = cfg.draft
    if d.method == "eagle":
        if pair.draft is None:
            raise ConfigError(f"draft=eagle needs an EAGLE head, but model {pair.name!r} has none; give "
                              "draft.path=DIR or use draft=ngram, draft=standalone or draft=none")
        return EagleProposer(pair.draft, d.topk, d.num_steps, d.num_draft_tokens,
                             fused_topk=bool(cfg.compile.draft_topk.fused))
    if d.method == "ngram":
        proposer = NgramProposer(d.topk, d.num_steps, d.num_draft_tokens, d.min_n, d.max_n, max_requests,
                                 max_context, device.torch_device, cache_tokens=d.get("cache_tokens", 0),
                                 cache_prompts=bool(d.get("cache_prompts", False)),
                                 running_tokens=d.get("running_tokens", 0), host=device.host_memory)
        if keep is not None and proposer.cache is not None:
            key = ("suffix_cache", proposer.cache.capacity, str(device.torch_device))
            proposer.cache = keep.setdefault(key, proposer.cache)
        return proposer
    if d.method == "standalone":
        from specpipe.drafters.standalone import StandaloneDrafter

        drafter = StandaloneDrafter(pair.standalone, d.topk, d.num_steps, d.num_draft_tokens,
                                    fused_topk=bool(cfg.compile.draft_topk.fused))
        return StandaloneProposer(drafter, sampled_chain=sampled and d.topk == 1)
    raise ConfigError(f"draft.method={d.method!r} is unknown")


def any_sampled(cfg: DictConfig, reqs: list[Request]) -> bool:
    """Whether any request samples (the run's temperature, or a prompt's own): the greedy-only fast paths
    are then off and greedy requests ride the sampling path as one-hots (the same tokens)."""
    from specpipe.stages.verify_sampling import GREEDY_TEMPERATURE as G

    return cfg.sampling.temperature >= G or any(r.sampling is not None and r.sampling[0] >= G for r in reqs)


def build_pipeline(cfg: DictConfig, device, pair, allocator, reqs: list[Request], metrics: Metrics,
                   keep: Optional[dict] = None):
    d = cfg.draft
    wrap = make_wrap(cfg, device, metrics)
    # requests that never run (a prompt refused as too long) size nothing: one stray document cost gigabytes
    longest = max((len(r.prompt_ids) for r in reqs if not r.finished), default=1)
    ps = allocator.page_size
    max_context = longest + cfg.workload.max_new_tokens + d.num_draft_tokens + d.topk * d.num_steps + 2 * ps + 1
    max_requests = running_batch(cfg, reqs)
    eos = None if cfg.workload.get("ignore_eos") else stop_token_ids(pair.tokenizer)
    sp = cfg.sampling
    sampled = any_sampled(cfg, reqs)
    sampling = SamplingState(sp.temperature, sp.top_p, sp.top_k, device.torch_device, greedy=not sampled,
                             repetition_penalty=sp.repetition_penalty, max_context=max_context, min_p=sp.min_p,
                             penalized=any(r.sampling is not None and r.sampling[3] != 1.0 for r in reqs))
    if d.method in ("none", "ngram") and d.get("path") is not None:
        from specpipe.report_console import drafter_name

        print(f"specpipe: note: draft.path={d.path} is not read: draft={drafter_name(d)} uses no draft model "
              "(draft=eagle and draft=standalone do)", file=sys.stderr)
    if d.method == "none":
        pipe = PlainPipeline(pair.target, allocator, device, max_requests, max_context, eos, metrics, sampling, wrap)
    else:
        proposer = build_proposer(cfg, pair, max_requests, max_context, device, sampled, keep)
        pipe = SpecPipeline(pair.target, proposer, allocator, device, max_requests, max_context, eos, metrics,
                            d.num_steps, d.num_draft_tokens, wrap, sampling)
    pipe.logprobs = bool(cfg.workload.get("logprobs"))
    pipe.unapplied_policies = unapplied_policies(cfg, wrap.asked)
    alloc = str(cfg.allocator._target_).split(".")[-2]  # specpipe.allocators.<name>.<Class>
    if isinstance(getattr(pipe, "proposer", None), EagleProposer):
        why = pipe.proposer.plan_rounds(pipe.prep)
        if why:
            key = f"compile.draft_loop.steps={cfg.compile.draft_loop.steps}"
            print(f"specpipe: note: {key}: the draft steps run one call each with allocator={alloc}, since {why}; "
                  "compile.draft_forward.decode and compile.draft_topk.* set how those calls run", file=sys.stderr)
            pipe.unapplied_policies.append(key)
    if "round" in getattr(getattr(pipe, "verify", None), "wrapped", ()):
        why = pipe.verify_round_problem()
        pipe.fused_verify = not why
        if pipe.fused_verify and isinstance(pipe.proposer, EagleProposer):  # its extend joins the verify's call
            pipe.verify.draft = pipe.proposer.draft_fwd
        if why:
            key = f"compile.verify.round={cfg.compile.verify.round}"
            print(f"specpipe: note: {key}: the rounds verify in separate calls in this run (allocator={alloc}), since "
                  f"{why}; compile.verify.target_forward and compile.verify.greedy set how those run", file=sys.stderr)
            pipe.unapplied_policies.append(key)
    pipe.compiled_model = wrap.compiled_model
    return pipe


def first_layer_copy(target):
    """A self-speculative draft for test models: the target truncated to its first layer (weights shared)."""
    import copy

    small = copy.copy(target)
    small.config = copy.copy(target.config)
    small.config.num_hidden_layers = 1
    small._modules = dict(target._modules)
    small.layers = torch.nn.ModuleList(list(target.layers)[:1])
    small.kv = None
    return small


def ensure_standalone(cfg: DictConfig, pair, dtype: str, device) -> None:
    """With draft=standalone: the pair's standalone model is the one draft.path names (loaded once)."""
    source = (cfg.draft.path, folder_state(cfg.draft.path))
    if cfg.draft.method == "standalone" and (getattr(pair, "standalone", None) is None
                                             or getattr(pair, "standalone_source", None) != source):
        with torch.random.fork_rng(devices=[]):  # as in load_pair: the caller's random stream is theirs
            load_standalone(cfg, pair, dtype, device)
        pair.standalone_source = source


def drafting_models(cfg: DictConfig, pair) -> list:
    """The pair's draft models this run drafts with (an EAGLE head, a standalone model, or none). The other
    stays loaded for a later job of an in-process sweep, and its KV pool is let go: a GPU holding it would
    run out of memory where the job alone fits."""
    used = {"eagle": pair.draft, "standalone": getattr(pair, "standalone", None)}.get(cfg.draft.method)
    for model in (pair.draft, getattr(pair, "standalone", None)):
        if model is not None and model is not used:
            model.kv = None
    return [used] if used is not None else []


def load_standalone(cfg: DictConfig, pair, dtype: str, device) -> None:
    """The standalone drafter's model: draft.path, or for random_tiny the target's first layer."""
    if cfg.draft.path is not None:
        from specpipe.models.hf import load_target

        pair.standalone = load_target(cfg.draft.path, dtype=dtype, device=str(device.torch_device))
    elif cfg.model._target_.endswith("build_random_tiny"):
        pair.standalone = first_layer_copy(pair.target)
    else:
        raise ConfigError("draft=standalone needs draft.path=DIR: a small causal LM folder (config.json + "
                          "safetensors) with the same tokenizer as the target (see `make train-tiny` in the README)")
    check_same_vocabulary(cfg.draft.path, pair.tokenizer)
    own, tokens = pair.standalone.config.vocab_size, pair.tokenizer.vocab_size
    if own < tokens:
        raise ConfigError(f"draft.path={cfg.draft.path!r}: the standalone draft's vocab_size {own} is smaller than "
                          f"the target's tokenizer ({tokens} tokens); it must share the target's tokenizer (a "
                          f"vocabulary padded to another size is fine)")
    pair.standalone.fit_vocab(pair.target.config.vocab_size)  # padded differently: score the target's ids


def check_same_vocabulary(draft_path, tokenizer) -> None:
    """A standalone draft proposes token ids: its folder's tokenizer.json must give each token the target's id (a
    draft of another family, or a vocabulary trained apart, passed every size check and was never accepted)."""
    target = getattr(tokenizer, "_tok", None)
    theirs = Path(str(draft_path)) / "tokenizer.json" if draft_path is not None else None
    if target is None or theirs is None or not theirs.is_file():
        return
    try:
        from tokenizers import Tokenizer

        vocab = Tokenizer.from_file(str(theirs)).get_vocab(with_added_tokens=True)
    except Exception:  # the draft's tokenizer is never used to encode: an unreadable one is not its problem
        return
    ours = target.get_vocab(with_added_tokens=True)
    moved = sorted((i, t) for t, i in vocab.items() if t in ours and ours[t] != i)
    if moved:
        i, t = moved[0]
        raise ConfigError(f"draft.path={str(draft_path)!r}: the standalone draft's tokenizer.json numbers tokens "
                          f"otherwise than the target's ({len(moved)} of its {len(vocab)} tokens differ, e.g. {t!r} is "
                          f"{i} there and {ours[t]} in the target's), so its proposals would name other tokens; use "
                          f"a draft trained with the target's tokenizer (a smaller model of the same family)")


def model_sampling(cfg: DictConfig, pair) -> tuple[DictConfig, str]:
    """cfg with sampling.* from the model's generation_config.json when sampling.from_model is set;
    and where the settings came from ("config", or that file)."""
    from omegaconf import OmegaConf

    from specpipe.models.hf import generation_sampling

    source = pair.target.config.extra.get("source")
    if not cfg.sampling.get("from_model") or source is None:
        return cfg, "config"
    found = generation_sampling(Path(source))
    if not found:
        return cfg, "config (the model folder sets no sampling)"
    return OmegaConf.merge(cfg, {"sampling": found}), str(Path(source) / "generation_config.json")


def model_window(cfg: DictConfig, pair) -> DictConfig:
    """cfg with allocator.window set to the model's sliding window where allocator=swa leaves it null."""
    from omegaconf import OmegaConf

    if allocator_kind(cfg) != "swa":
        return cfg
    if cfg.allocator.window is not None:  # a request never holds more than the context: a larger window keeps the
        ctx = pair.target.config.max_position_embeddings  # same (and one past int64 overflowed numpy mid-run)
        return cfg if cfg.allocator.window <= ctx else OmegaConf.merge(cfg, {"allocator": {"window": ctx}})
    return OmegaConf.merge(cfg, {"allocator": {"window": check_window_pool(pair, None)}})


def out_of_memory(e: BaseException) -> bool:
    """Whether `e` (or what it wraps: hydra wraps errors raised while building) is an allocation failure."""
    while e is not None:
        if isinstance(e, (MemoryError, torch.OutOfMemoryError, OverflowError)) or (  # Overflow: a size past int64
                isinstance(e, RuntimeError) and "can't allocate memory" in str(e)):
            return True
        e = e.__cause__ or e.__context__
    return False


def allocation_size(e: BaseException) -> str:
    """'an allocation of 745.1 GiB failed', from torch's out-of-memory message where it says the size."""
    import re

    while e is not None:
        m = re.search(r"allocate (\d+) bytes|Tried to allocate ([\d.]+ [KMGT]iB)", str(e))
        if m:
            return f"an allocation of {int(m[1]) / 2 ** 30:.1f} GiB failed" if m[1] else f"{m[2]} more was needed"
        e = e.__cause__ or e.__context__
    return "an allocation failed"


def check_against_model(cfg: DictConfig, pair, max_new_tokens: bool = True) -> None:
    """Settings the loaded model bounds: allocator.page_size, draft.topk (model drafters pick that many tokens of
    the draft's vocabulary per expansion) and workload.max_new_tokens (prompt and output share the model's context;
    `max_new_tokens=False` leaves that one to the call that decodes)."""
    ctx = pair.target.config.max_position_embeddings
    if max_new_tokens and cfg.workload.max_new_tokens >= ctx:
        raise ConfigError(f"workload.max_new_tokens={cfg.workload.max_new_tokens} leaves no room for a prompt in "
                          f"the model's context of {ctx} tokens (max_position_embeddings); use at most {ctx - 1}")
    ps = cfg.allocator.page_size
    if ps > ctx:  # a page holds one request's tokens: the rest of it is never written (a 2**20 page: 12M slots)
        raise ConfigError(f"allocator.page_size={ps} is larger than the model's context of {ctx} tokens "
                          f"(max_position_embeddings), so most of every page would never be written; use a power "
                          f"of two up to {1 << (ctx.bit_length() - 1)} (16 to 128 are usual)")
    if allocator_kind(cfg) == "swa":
        window = check_window_pool(pair, cfg.allocator.window)
        problems = window_problems(cfg, window, model_window=cfg.allocator.window is None, context=ctx)
        if problems:
            raise ConfigError(problems)
    if allocator_kind(cfg) == "hisparse":
        check_sparse_model(pair)
    d = cfg.draft
    if d.method == "eagle" and pair.draft is None:
        raise ConfigError(f"draft=eagle needs an EAGLE head, but model {pair.name!r} has none; give "
                          "draft.path=DIR or use draft=ngram, draft=standalone or draft=none")
    if d.method not in ("eagle", "standalone"):
        return  # n-gram topk counts matches, not vocabulary entries
    model = pair.draft if d.method == "eagle" else getattr(pair, "standalone", None)
    vocab = getattr(model, "draft_vocab_size", None) or pair.target.config.vocab_size
    if d.topk > vocab:
        raise ConfigError(f"draft.topk={d.topk} is larger than the draft's vocabulary of {vocab} tokens; use "
                          f"draft.topk<={vocab} (4 to 10 is typical)")


def ignored_fields(items: list[dict]) -> dict:
    """Prompt-object keys that look like typos of ours ("max_new_token"): {key: {"did_you_mean", "prompts"}},
    said once on stderr. They are ignored, not refused: a dataset's own columns can look alike."""
    found: dict = {}
    for it in items:
        for key, like in (it.get("ignored_fields") or {}).items():
            found.setdefault(key, {"did_you_mean": like, "prompts": 0})["prompts"] += 1
    if found:
        listed = "; ".join(f'"{k}" in {v["prompts"]} prompt(s): did you mean "{v["did_you_mean"]}"?'
                           for k, v in found.items())
        print(f"specpipe: note: prompt fields specpipe does not read were ignored ({listed}); rename them if they "
              f"were meant as settings", file=sys.stderr)
    return found


def leaked_slots(allocator) -> int:
    """Slots not back in any pool's free list. A paired allocator (SWA, HiSparse) counts each pool: its own
    size and available() are the smaller pool's, which hid a leak in HiSparse's larger logical pool."""
    pools = [allocator.primary, allocator.peer] if hasattr(allocator, "peer") else [allocator]
    return int(sum(p.size - p.available() for p in pools))


def run(cfg: DictConfig, out_dir: Optional[str] = None, quiet: bool = False, pair=None,
        items: Optional[list[dict]] = None, on_step=None, keep: Optional[dict] = None,
        overrides: Optional[list] = None) -> dict:
    """Decode the workload's prompts (or `items`, as `load_prompts` returns them); {"metrics", "requests"}.
    `on_step(requests)` is called after every decode step (see `run_requests`). `overrides`: the command line's
    (a sweep job's point), recorded in metrics.json so a report tells jobs apart without Hydra's .hydra folder.
    `keep`: a dict the caller carries from one run to the next (the API's calls), so state meant to outlive a run
    (the suffix cache) does. With `cfg.resume`, the requests that a stopped run in out_dir finished are taken from
    its partial files (`specpipe.resume`) and only the rest decode.

    Decoding never touches torch's global random stream, which is the caller's (a training loop's dropout and
    shuffling; a stream decodes in a thread beside it): sampling draws per-request coins from `cfg.seed`."""
    from specpipe.devices.base import use_build_inductor_cache

    use_build_inductor_cache()  # before anything asks inductor for its cache folder
    validate(cfg)
    if out_dir is not None:
        check_output_names(Path(out_dir))
    earlier = read_partial(out_dir) if cfg.resume and out_dir is not None else []
    if cfg.resume and out_dir is not None and not earlier:
        print(f"resume: {out_dir} holds no {PARTIAL} of a stopped run, so every request runs", file=sys.stderr)
    if items is None:
        items = load_prompts(cfg.workload.prompts_file, cfg.workload.prompt_set, cfg.workload.num_prompts)
    device = build(cfg.device, "device")
    dtype = model_dtype(cfg)
    if pair is None:
        pair = load_pair(cfg, dtype, device)
    ensure_standalone(cfg, pair, dtype, device)
    check_against_model(cfg, pair)
    job_cfg = cfg  # the config as given: the stored one, which resume compares with the job's
    cfg, sampling_source = model_sampling(cfg, pair)  # (the values it took are in the `sampling` metric)
    cfg = model_window(cfg, pair)
    reqs = make_requests(items, pair.tokenizer, cfg.workload.max_new_tokens,
                         pair.target.config.max_position_embeddings, pair.target.config.vocab_size,
                         run_stop_strings(cfg), ignore_eos=bool(cfg.workload.get("ignore_eos")),
                         sampling=tuple(cfg.sampling[k] for k in SAMPLING_RULES),
                         logprobs=bool(cfg.workload.get("logprobs")))
    ignored = ignored_fields(items)
    drafting = drafting_models(cfg, pair)
    folders = model_folders([pair.target, *drafting])
    models_digest = model_files_digest(folders)
    carried = carry_finished(earlier, job_cfg, items, reqs, pair.target.config.vocab_size, models_digest)
    try:
        full_slots = cfg.allocator.num_slots or (
            hisparse_device_slots(cfg, reqs, pair) if allocator_kind(cfg) == "hisparse"
            else workload_slots(cfg, reqs))
        window_slots = window_pool_slots(cfg, reqs, full_slots, pair.target.config.max_position_embeddings) \
            if allocator_kind(cfg) == "swa" else None
        allocator = build_allocator(cfg, device, full_slots, window_slots)
        pair.target.setup_kv(allocator.pool_slots, **target_kv_layout(pair, allocator))  # checks the pair fits
        for model in drafting:
            model.setup_kv(allocator.pool_slots)
    except Exception as e:
        if not out_of_memory(e):
            raise
        size = f"allocator.num_slots={cfg.allocator.num_slots}" if cfg.allocator.num_slots is not None else \
            f"the {workload_slots(cfg, reqs)} KV slots this workload needs"
        also = [f"allocator.{k}={cfg.allocator[k]}" for k in ("swa_num_slots", "host_to_device_ratio")
                if cfg.allocator.get(k) is not None]  # they size a pool too: name the one that may be at fault
        size += f" (with {', '.join(also)})" if also else ""
        smaller = "".join(f"a smaller {k.split('=')[0]}, " for k in also)
        raise ConfigError(f"{size}: the KV cache does not fit in {device.torch_device} memory ({allocation_size(e)}); "
                          f"use {smaller}a smaller allocator.num_slots (null sizes it for the workload), fewer "
                          f"workload.batch_size or workload.max_new_tokens") from None
    base_seed = cfg.sampling.seed if cfg.sampling.seed is not None else cfg.seed
    for r, it in zip(reqs, items):
        r.seed = request_seed(base_seed, r.index, it.get("seed"))
    spec = cfg.draft.method != "none"
    batch = running_batch(cfg, reqs)
    step_rows = batch * (cfg.draft.num_draft_tokens if spec else 1)  # rows of a verify forward
    models = [pair.target, *drafting]
    fuse_projections(models)  # q|k|v and gate|up as one GEMM each (once per pair; bitwise the same outputs)
    layout = device.lay_out_weights(models, (1, step_rows))
    metrics = Metrics(cfg.draft.num_steps if spec else 1, cfg.draft.topk if spec else 1,
                      cfg.draft.num_draft_tokens if spec else 2)
    partial = None
    try:  # from the timer's hooks on: whatever fails (Ctrl-C included) leaves the shared models' hooks timing nothing
        if cfg.get("model_timing", True):
            metrics.attach_model_timer(models, device.synchronize)
        pipe = build_pipeline(cfg, device, pair, allocator, reqs, metrics, keep)
        if carried and getattr(pipe, "proposer", None) is not None:  # draft=suffix: its cache drafts from them
            pipe.proposer.finish(carried)  # as it would have in the run that was stopped
        if pipe.compiled_model:
            device.freeze_weight_layouts(models)  # later runs on these weights keep the strides compiled for
        compiles_before, limits_before = recompile_count(), recompile_limit_hits()
        if out_dir is not None:  # the first write: what an earlier run left here is set aside (*.prev) now
            from specpipe.sweep import clear_outputs

            clear_outputs(out_dir)
        partial = PartialCompletions(Path(out_dir), pair.tokenizer, partial_meta(job_cfg, items, models_digest)) \
            if out_dir is not None else None
        if partial is not None:
            partial.write([r for r in reqs if r.finished])  # bad prompts, and those a resumed run carried over
        if on_step is not None and any(r.finished for r in reqs):
            on_step([r for r in reqs if r.finished])  # streams hear of them now, not after all decoding
        wall = run_requests(pipe, reqs, batch, show_progress=None if not quiet else False,
                            on_finish=partial.write if partial is not None else None, on_step=on_step)
    finally:
        metrics.detach()
        if partial is not None:
            partial.close()
    summary = metrics.summary(wall, recompile_count() - compiles_before)
    from specpipe.sweep import prompts_digest

    summary["prompts_sha256"] = prompts_digest(items)  # resume=true compares it
    summary["model_files_sha256"] = models_digest  # name, size and mtime of the model folders' files
    summary["model_folders"] = folders
    summary["recompile_limit_hits"] = recompile_limit_hits() - limits_before
    summary["kv_peak_slots"] = int(pipe.prep.peak_used)
    summary["kv_pool_slots"] = int(allocator.main_pool.size)  # what num_slots=null resolved to
    summary["kv_leaked_slots"] = leaked_slots(allocator)
    summary["kv_cache_bytes"] = sum(m.kv.nbytes for m in (pair.target, *drafting))  # what swa's window pool saves
    summary.update(pipe.prep.stats())  # allocator-specific: SWA evictions, HiSparse hit rate / bytes moved
    sp = cfg.sampling
    summary["sampling"] = {"temperature": sp.temperature, "top_p": sp.top_p, "top_k": sp.top_k,
                           "repetition_penalty": sp.repetition_penalty, "min_p": sp.min_p, "source": sampling_source,
                           "per_request": sum(r.sampling is not None for r in reqs)}
    unapplied = dict(pair.target.config.extra.get("unapplied_generation_settings") or {})
    if cfg.sampling.get("from_model"):
        unapplied.pop("repetition_penalty", None)  # taken with the sampling settings
    if not any_sampled(cfg, reqs):
        from specpipe.models.hf import UNAPPLIED_SAMPLING

        for k in UNAPPLIED_SAMPLING:  # HF applies them only when sampling
            unapplied.pop(k, None)
    if unapplied:
        summary["unapplied_generation_settings"] = unapplied  # generation_config.json values HF applies, we don't
    if ignored:
        summary["ignored_prompt_fields"] = ignored
    if getattr(pipe, "unapplied_policies", None):
        summary["unapplied_compile_policies"] = pipe.unapplied_policies
    summary["num_requests"] = len(reqs)
    summary["resumed_requests"] = len(carried)  # finished by the stopped run resume=true continued; not decoded here
    summary["num_errors"] = sum(r.finish_reason == "error" for r in reqs)
    summary["request_errors"] = [{"index": r.index, "error": r.error} for r in reqs if r.finish_reason == "error"][:5]
    from specpipe.autotune import collect_decisions

    summary["autotune"] = collect_decisions(getattr(pipe, "stages", []))  # compile=auto choices + timings
    summary["weight_layout"] = layout  # per Linear shape: the layout kept (and what auto measured)
    cache = getattr(getattr(pipe, "proposer", None), "cache", None)
    if cache is not None:  # draft=suffix: what the cross-request cache held at the end
        summary["draft_cache"] = {"tokens": len(cache), "capacity": cache.capacity, "texts_added": cache.texts_added}
    summary["model_loads_in_process"] = MODEL_LOADS[0]  # 1 in every job of an in-process sweep: weights reused
    summary["config"] = to_container(job_cfg)
    if overrides is not None:
        summary["overrides"] = list(overrides)
    from specpipe.report_console import print_summary

    if out_dir is not None:
        try:
            write_outputs(Path(out_dir), summary, reqs, pair.tokenizer)
        except OSError as e:  # the decoding is done: show its summary, then say what could not be kept
            if not quiet:
                print_summary(summary, None)
            from specpipe.errors import OutputError

            raise OutputError(f"specpipe: the run finished, but its outputs could not be written to {out_dir} "
                              f"({e.strerror or e}); the summary above is all that is left of it (requests that "
                              f"finished are in {PartialCompletions.NAME} if it could be written). Free space or "
                              f"choose another folder (hydra.run.dir=...) and run again") from None
    if not quiet:
        print_summary(summary, out_dir)
    return {"metrics": summary, "requests": reqs}


def completion_record(r: Request, tokenizer) -> dict:
    rec = {"index": r.index, "prompt": r.prompt, "output_ids": r.output_ids,
           "text": output_text(tokenizer, r.prompt_ids, r.output_ids), "finish_reason": r.finish_reason}
    if r.logprobs is not None:
        rec["logprobs"] = r.logprobs
    if r.error:
        rec["error"] = r.error
    return rec


OUTPUT_FILES = ("completions.jsonl.tmp", "completions.jsonl", "metrics.json.tmp", "metrics.json")


def check_output_names(out: Path) -> None:
    """A folder where an output file goes fails before decoding: its write would fail only at the run's end.
    (Without its partial file a run goes on, and says so.)"""
    taken = [n for n in OUTPUT_FILES if (out / n).is_dir()]
    if taken:
        raise ConfigError(f"the output folder {out} holds a folder named {taken[0]}, where the run writes its file of "
                          f"that name; move that folder away, or give another output folder (hydra.run.dir, or "
                          f"out_dir in the Python API)")


class PartialCompletions:
    """completions.partial.jsonl: each request's record as soon as it finishes (finish order), flushed, so
    Ctrl-C, a crash or a kill loses no finished request. The ordered completions.jsonl replaces it at the end."""

    NAME = PARTIAL

    def __init__(self, out: Path, tokenizer, meta: Optional[dict] = None):
        self.path, self.tokenizer, self.f = out / self.NAME, tokenizer, None
        try:
            out.mkdir(parents=True, exist_ok=True)
            self.f = open(self.path, "w", encoding="utf-8")
        except OSError as e:  # as a failed write: the decoding goes on, the end says what could not be kept
            print(f"specpipe: warning: cannot write {self.path} ({e.strerror or e}); decoding goes on without it",
                  file=sys.stderr)
            return
        if meta is not None:  # what resume=true checks before it takes these records (without it: none taken)
            from specpipe.sweep import _write_json

            try:
                _write_json(out / META, meta)
            except OSError:
                pass

    def write(self, reqs: list[Request]) -> None:
        if self.f is None:
            return
        try:
            for r in reqs:
                self.f.write(json.dumps(completion_record(r, self.tokenizer)) + "\n")
            self.f.flush()
        except OSError as e:  # a full disk must not cost the decoding still going on: go on without the file
            print(f"specpipe: warning: cannot write {self.path} ({e.strerror or e}); decoding goes on, and the "
                  f"outputs are written at the end if there is room then", file=sys.stderr)
            self.close()

    def close(self) -> None:
        f, self.f = self.f, None
        try:
            if f is not None:
                f.close()
        except OSError:  # its buffered tail could not be written: the warning above said so
            pass


def write_outputs(out: Path, summary: dict, reqs: list[Request], tokenizer) -> None:
    """Each file whole or not at all (written aside, then renamed): a Ctrl-C or a full disk here leaves the partial
    file and no metrics.json, never a cut completions.jsonl. metrics.json comes last: it marks a finished job."""
    out.mkdir(parents=True, exist_ok=True)
    tmp, done = out / "metrics.json.tmp", out / "completions.jsonl.tmp"
    try:
        tmp.write_text(json.dumps(summary, indent=2))
        with open(done, "w", encoding="utf-8") as f:
            for r in reqs:
                f.write(json.dumps(completion_record(r, tokenizer)) + "\n")
    except BaseException:
        for t in (tmp, done):
            try:
                t.unlink(missing_ok=True)
            except OSError:
                pass
        raise
    os.replace(done, out / "completions.jsonl")
    os.replace(tmp, out / "metrics.json")
    for name in (PartialCompletions.NAME, META):
        partial = out / name
        if not partial.is_dir():  # (a folder of that name was never ours: the run went on without the file)
            partial.unlink(missing_ok=True)  # completions.jsonl holds all of it, in order
