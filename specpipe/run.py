"""run(cfg): build -> decode -> write. Wiring only: each step is its concept's module's.

  build   the device, the model pair (`models.cache`), the requests (`decode.requests`), the KV pools each
          allocator sizes (`allocators.base.PoolDemand`), the drafter its schema's `_target_` names (`drafters`)
          and the pipeline, its stages bound to the compile policies (`stages.compile_binding`)
  decode  `decode.scheduler.run_requests`, finished requests streamed to the partial file as they finish
  write   metrics.json (`outputs.summary`) and completions.jsonl (`outputs.files`), the console summary
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from hydra.utils import get_class
from omegaconf import DictConfig

from specpipe.allocators.base import allocator_class, build_allocator
from specpipe.config.build import build
from specpipe.config.compose import default_options
from specpipe.config.schema import PROMPT_SET_NAMES, SAMPLING_RULES, draft_schema
from specpipe.config.speculation import speculation_schema
from specpipe.config.validate import run_stop_strings, validate
from specpipe.decode.metrics import Metrics, recompile_count, recompile_limit_hits
from specpipe.decode.plain import PlainPipeline
from specpipe.decode.request import Request
from specpipe.decode.requests import (any_sampled, forced_chains, make_requests, pool_demand, running_batch,
                                     seed_requests)
from specpipe.decode.sampling import SamplingState
from specpipe.decode.scheduler import run_requests
from specpipe.decode.speculative import SpecPipeline
from specpipe.grammar.tree import build_grammar
from specpipe.drafters.base import DraftSetup
from specpipe.drafters.none import RootOnly
from specpipe.errors import ConfigError, OutputError
from specpipe.models.cache import (
    check_context,
    check_draft_model,
    drafting_models,
    ensure_draft_model,
    load_pair,
    model_dtype,
    model_sampling,
)
from specpipe.models.llama import fuse_projections
from specpipe.notes import logger
from specpipe.outputs.console import print_summary
from specpipe.outputs.files import PartialCompletions, check_output_names, write_outputs
from specpipe.outputs.resume import carry_finished, model_files_digest, model_folders, partial_meta, read_partial
from specpipe.outputs.run_files import PARTIAL, clear_outputs
from specpipe.outputs.summary import describe_run, ignored_fields
from specpipe.stages.compile_binding import make_wrap, unapplied_policies
from specpipe.stages.prepare_decode import target_kv_layout
from specpipe.workload.prompts import load_prompts
from specpipe.workload.tokenizer import stop_token_ids

log = logger(__name__)


@dataclass
class Job:
    """One run's inputs once its model is loaded: what building, decoding and the summary share."""
    cfg: DictConfig  # the settings it decodes with (the model's sampling and sliding window applied)
    job_cfg: DictConfig  # the config as given: the stored one, which resume compares with the job's
    sampling_source: str  # where the sampling settings came from ("config", or the model's file)
    device: Any
    pair: Any
    items: list  # the prompt items, as `workload.prompts.load_prompts` returns them
    reqs: list  # a Request per item
    drafting: list  # the draft models this run drafts with
    folders: list  # the model folders (none for a model built in memory)
    models_digest: str  # their files' names, sizes and times (`outputs.resume.model_files_digest`)
    carried: list  # requests a stopped run finished (resume=true): not decoded again
    ignored: dict  # prompt fields that look like typos of ours (`outputs.summary.ignored_fields`)


def check_against_model(cfg: DictConfig, pair, max_new_tokens: bool = True) -> None:
    """Settings the loaded model bounds: its context (`max_new_tokens=False` leaves workload.max_new_tokens to the
    call that decodes), what the allocator needs of it, and the draft model the drafter needs."""
    check_context(cfg, pair, max_new_tokens)
    allocator_class(cfg).check_model(cfg, pair)
    check_draft_model(cfg, pair)


def build_proposer(cfg: DictConfig, pair, max_requests: int, max_context: int, device, sampled: bool = False,
                   keep: Optional[dict] = None):
    """The drafter `cfg.draft` names (its schema's `_target_`), or None for plain decoding. `sampled`: some request
    samples; `keep`: state carried from one run to the next (`DraftSetup`)."""
    drafter = get_class(cfg.draft._target_)
    return drafter.build(cfg, pair, DraftSetup(max_requests, max_context, device, sampled, keep))


def build_pipeline(cfg: DictConfig, device, pair, allocator, reqs: list[Request], metrics: Metrics,
                   keep: Optional[dict] = None):
    """The decode pipeline over the drafter (plain decoding without one), its stages bound to the compile policies;
    the policies this run cannot apply are noted once (`pipe.unapplied_policies`)."""
    d, schema = cfg.draft, draft_schema(cfg.draft)
    wrap = make_wrap(cfg, device, metrics)
    # requests that never run (a prompt refused as too long) size nothing: one stray document cost gigabytes
    longest = max((len(r.prompt_ids) for r in reqs if not r.finished), default=1)
    tree = d.num_draft_tokens + d.topk * d.num_steps if schema.speculates else 3  # (draft=none reads neither)
    constrained = any(r.constraint is not None and not r.finished for r in reqs)
    jump = forced_chains(cfg, reqs)  # draft=none: the grammar's forced chains are the only drafts
    if jump:
        tree = cfg.grammar.max_forced_tokens + 1
    max_context = longest + cfg.workload.max_new_tokens + tree + 2 * allocator.page_size + 1
    max_requests = running_batch(cfg, reqs)
    eos = None if cfg.workload.get("ignore_eos") else stop_token_ids(pair.tokenizer)
    sp, sampled = cfg.sampling, any_sampled(cfg, reqs)
    sampling = SamplingState(sp.temperature, sp.top_p, sp.top_k, device.torch_device, greedy=not sampled,
                             repetition_penalty=sp.repetition_penalty, max_context=max_context, min_p=sp.min_p,
                             penalized=any(r.sampling is not None and r.sampling[3] != 1.0 for r in reqs))
    for note in schema.unread_notes(d):  # draft.path without a draft model, draft=none's tree settings
        log.info(note)
    proposer = RootOnly() if jump else build_proposer(cfg, pair, max_requests, max_context, device, sampled, keep)
    policy = cfg.speculation._target_.rsplit(".", 2)[-2]
    if proposer is None and policy != default_options()["speculation"]:
        log.info(f"specpipe: note: speculation={policy} is not read: draft={schema.label(d)} drafts nothing")
    if proposer is None:
        pipe = PlainPipeline(pair.target, allocator, device, max_requests, max_context, eos, metrics, sampling, wrap)
    else:
        S, N = (tree - 1, tree) if jump else (d.num_steps, d.num_draft_tokens)
        policy = get_class(cfg.speculation._target_).build(cfg, N, S, pair.target)
        pipe = SpecPipeline(pair.target, proposer, allocator, device, max_requests, max_context, eos, metrics,
                            S, N, wrap, sampling, policy)
    if constrained:
        pipe.grammar = build_grammar(cfg.grammar, pair.tokenizer, pair.target.config.vocab_size, sorted(pipe.eos),
                                     max_requests, getattr(pipe, "N", 1), getattr(pipe, "S", 0), device.torch_device)
    pipe.logprobs = bool(cfg.workload.get("logprobs"))
    pipe.unapplied_policies = unapplied_policies(cfg, wrap.asked)
    plan_rounds(cfg, pipe, proposer)
    pipe.compiled_model = wrap.compiled_model
    return pipe


def plan_rounds(cfg: DictConfig, pipe, proposer) -> None:
    """How the rounds run, once the stages are bound: the drafter's one-call rounds and the one-call verify where
    the allocator and the requests allow them; a policy asked for that cannot apply is noted."""
    alloc = str(cfg.allocator._target_).split(".")[-2]  # specpipe.allocators.<name>.<Class>
    unapplied = proposer.plan(cfg, pipe.prep, alloc) if proposer is not None else None
    if unapplied:
        key, why = unapplied
        log.info(f"specpipe: note: {key}: {why}")
        pipe.unapplied_policies.append(key)
    if getattr(getattr(pipe, "verify", None), "wrapped", ()):  # a compiled verify: trees at a few widths only
        pipe.policy.bucketed(pipe.N)
    if "round" in getattr(getattr(pipe, "verify", None), "wrapped", ()):
        why = pipe.verify_round_problem()
        pipe.fused_verify = not why
        if pipe.fused_verify:  # a drafter whose extend joins the verify's call (`Proposer.round_extend`)
            pipe.verify.draft = getattr(proposer, "round_extend", None)
        if why:
            key = f"compile.verify.round={cfg.compile.verify.round}"
            log.info(f"specpipe: note: {key}: the rounds verify in separate calls in this run (allocator={alloc}), "
                     f"since {why}; compile.verify.target_forward and compile.verify.greedy set how those run")
            pipe.unapplied_policies.append(key)


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
    while e is not None:
        m = re.search(r"allocate (\d+) bytes|Tried to allocate ([\d.]+ [KMGT]iB)", str(e))
        if m:
            return f"an allocation of {int(m[1]) / 2 ** 30:.1f} GiB failed" if m[1] else f"{m[2]} more was needed"
        e = e.__cause__ or e.__context__
    return "an allocation failed"


def build_kv(job: Job):
    """The allocator, its pools sized by the allocator's class for this workload where num_slots is null, and the
    models' KV caches over them; running out of memory is a ConfigError that says which setting to lower."""
    cfg, pair = job.cfg, job.pair
    demand = pool_demand(cfg, job.reqs, pair)
    try:
        allocator = build_allocator(cfg, job.device, allocator_class(cfg).pool_sizes(cfg, demand))
        pair.target.setup_kv(allocator.pool_slots, **target_kv_layout(pair, allocator))  # checks the pair fits
        for model in job.drafting:
            model.setup_kv(allocator.pool_slots)
        return allocator
    except Exception as e:
        if not out_of_memory(e):
            raise
        size = f"allocator.num_slots={cfg.allocator.num_slots}" if cfg.allocator.num_slots is not None else \
            f"the {demand.slots} KV slots this workload needs"
        also = [f"allocator.{k}={cfg.allocator[k]}" for k in ("swa_num_slots", "host_to_device_ratio")
                if cfg.allocator.get(k) is not None]  # they size a pool too: name the one that may be at fault
        size += f" (with {', '.join(also)})" if also else ""
        smaller = "".join(f"a smaller {k.split('=')[0]}, " for k in also)
        raise ConfigError(f"{size}: the KV cache does not fit in {job.device.torch_device} memory "
                          f"({allocation_size(e)}); use {smaller}a smaller allocator.num_slots (null sizes it for the "
                          f"workload), fewer workload.batch_size or workload.max_new_tokens") from None


def prepare(cfg: DictConfig, pair, items: list[dict], earlier: list, built_in: bool = False) -> Job:
    """Load (or reuse) the model pair, check the settings it bounds, and turn the items into requests; those a
    stopped run finished (`earlier`, resume=true) are carried over. `built_in`: the items are a built-in set."""
    device = build(cfg.device, "device")
    dtype = model_dtype(cfg)
    if pair is None:
        pair = load_pair(cfg, dtype, device)
    ensure_draft_model(cfg, pair, dtype, device)
    check_against_model(cfg, pair)
    if built_in:
        check_chat_set(cfg, pair, items)
    job_cfg = cfg
    cfg, sampling_source = model_sampling(cfg, pair)  # (the values it took are in the `sampling` metric)
    cfg = allocator_class(cfg).fit_model(cfg, pair)
    c = pair.target.config
    reqs = make_requests(items, pair.tokenizer, cfg.workload.max_new_tokens, c.max_position_embeddings, c.vocab_size,
                         run_stop_strings(cfg), ignore_eos=bool(cfg.workload.get("ignore_eos")),
                         sampling=tuple(cfg.sampling[k] for k in SAMPLING_RULES),
                         logprobs=bool(cfg.workload.get("logprobs")))
    ignored = ignored_fields(items)
    drafting = drafting_models(cfg, pair)
    folders = model_folders([pair.target, *drafting])
    digest = model_files_digest(folders)
    carried = carry_finished(earlier, job_cfg, items, reqs, c.vocab_size, digest)
    return Job(cfg, job_cfg, sampling_source, device, pair, items, reqs, drafting, folders, digest, carried, ignored)


def check_chat_set(cfg: DictConfig, pair, items: list[dict]) -> None:
    """A built-in set of chats on a model without a chat template: a config error before decoding, not a failed
    request per prompt."""
    w = cfg.workload
    if any("messages" in it for it in items) and getattr(pair.tokenizer, "chat_template", None) is None:
        plain = " or ".join(f"workload.prompt_set={n}" for n in PROMPT_SET_NAMES if n not in ("chat", "code"))
        raise ConfigError(f"workload.prompt_set={w.prompt_set} holds chats, and this model has no chat template to "
                          f"turn them into prompts (model={cfg.model.get('path') or 'the shipped pair'}); use a "
                          f"plain set ({plain}) or a chat model (model=hf model.path=DIR)")


def open_partial(job: Job, out_dir: Optional[str]) -> Optional[PartialCompletions]:
    """The partial file, once decoding is about to start (what an earlier run left in out_dir is set aside now),
    holding the requests already finished (bad prompts, those a resumed run carried over)."""
    if out_dir is None:
        return None
    clear_outputs(out_dir)
    partial = PartialCompletions(Path(out_dir), job.pair.tokenizer,
                                 partial_meta(job.job_cfg, job.items, job.models_digest))
    partial.write([r for r in job.reqs if r.finished])
    return partial


def decode_rows(cfg, batch: int) -> tuple[int, ...]:
    """The row counts the target's decode forwards run, which the weight layout is timed on: a plain step's `batch`
    and a full verify's `batch` x num_draft_tokens; under a policy that trims trees (every one but `static`) also a
    plain step and a middle width (its steps are mostly plain or narrow: on SmolLM2 with chat prompts, 95 % were
    plain). Timed at one row and the full width only, the layout chosen ran SmolLM2's 4-row steps at 87 ms where
    the one chosen for 4 rows ran them at 71 ms."""
    d = cfg.draft
    if not draft_schema(d).speculates:
        return (batch,)
    N = int(d.num_draft_tokens)
    if not speculation_schema(cfg.get("speculation")).trims:
        return (batch * N,)
    return tuple(sorted({batch, batch * round(N ** 0.5), batch * N}))


def decode(job: Job, allocator, out_dir: Optional[str], quiet: bool, on_step, keep: Optional[dict]):
    """Build the pipeline and decode every request; (pipe, the decode loop's summary, recompile limit hits, the
    weight layout). Whatever fails from the timer's hooks on (Ctrl-C included) leaves the shared models' hooks
    timing nothing."""
    cfg, device, reqs = job.cfg, job.device, job.reqs
    d, spec = cfg.draft, draft_schema(cfg.draft).speculates
    batch = running_batch(cfg, reqs)
    models = [job.pair.target, *job.drafting]
    fuse_projections(models)  # q|k|v and gate|up as one GEMM each (once per pair; bitwise the same outputs)
    layout = device.lay_out_weights(models, decode_rows(cfg, batch))
    metrics = Metrics(d.num_steps if spec else 1, d.topk if spec else 1, d.num_draft_tokens if spec else 2)
    partial = None
    try:
        if cfg.get("model_timing", True):
            metrics.attach_model_timer(models, device.model_clock())  # (CUDA: events, no sync per forward)
        pipe = build_pipeline(cfg, device, job.pair, allocator, reqs, metrics, keep)
        if job.carried and getattr(pipe, "proposer", None) is not None:  # a drafter that keeps finished outputs
            pipe.proposer.finish(job.carried)  # drafts from these too, as it would have in the run that was stopped
        if pipe.compiled_model:
            device.freeze_weight_layouts(models)  # later runs on these weights keep the strides compiled for
        device.reset_peak_memory()  # this run's peak (sweep jobs share a process)
        compiles_before, limits_before = recompile_count(), recompile_limit_hits()
        partial = open_partial(job, out_dir)
        if on_step is not None and any(r.finished for r in reqs):
            on_step([r for r in reqs if r.finished])  # streams hear of them now, not after all decoding
        wall = run_requests(pipe, reqs, batch, show_progress=None if not quiet else False,
                            on_finish=partial.write if partial is not None else None, on_step=on_step)
    finally:
        metrics.detach()
        if partial is not None:
            partial.close()
    summary = metrics.summary(wall, recompile_count() - compiles_before)
    summary["device_memory"] = device.memory_stats()  # (CUDA: allocated, peak, reserved bytes)
    return pipe, summary, recompile_limit_hits() - limits_before, layout


def write_results(summary: dict, job: Job, out_dir: Optional[str], quiet: bool) -> None:
    """metrics.json and completions.jsonl, then the console summary; a failed write still shows the summary."""
    if out_dir is not None:
        try:
            write_outputs(Path(out_dir), summary, job.reqs, job.pair.tokenizer)
        except OSError as e:  # the decoding is done: show its summary, then say what could not be kept
            if not quiet:
                print_summary(summary, None)
            raise OutputError(f"specpipe: the run finished, but its outputs could not be written to {out_dir} "
                              f"({e.strerror or e}); the summary above is all that is left of it (requests that "
                              f"finished are in {PartialCompletions.NAME} if it could be written). Free space or "
                              f"choose another folder (hydra.run.dir=...) and run again") from None
    if not quiet:
        print_summary(summary, out_dir)


def run(cfg: DictConfig, out_dir: Optional[str] = None, quiet: bool = False, pair=None,
        items: Optional[list[dict]] = None, on_step=None, keep: Optional[dict] = None,
        overrides: Optional[list] = None) -> dict:
    """Decode the workload's prompts (or `items`, as `load_prompts` returns them); {"metrics", "requests"}.
    `on_step(requests)` is called after every decode step (see `run_requests`). `overrides`: the command line's
    (a sweep job's point), recorded in metrics.json so a report tells jobs apart without Hydra's .hydra folder.
    `keep`: a dict the caller carries from one run to the next (the API's calls), so state meant to outlive a run
    (a drafter's cache of finished outputs) does. With `cfg.resume`, the requests that a stopped run in out_dir
    finished are taken from its partial files (`specpipe.outputs.resume`) and only the rest decode.

    Decoding never touches torch's global random stream, which is the caller's (a training loop's dropout and
    shuffling; a stream decodes in a thread beside it): sampling draws per-request coins from `cfg.seed`."""
    from specpipe.devices.base import use_build_inductor_cache

    use_build_inductor_cache()  # before anything asks inductor for its cache folder
    validate(cfg)
    if out_dir is not None:
        check_output_names(Path(out_dir))
    earlier = read_partial(out_dir) if cfg.resume and out_dir is not None else []
    if cfg.resume and out_dir is not None and not earlier:
        log.info(f"resume: {out_dir} holds no {PARTIAL} of a stopped run, so every request runs")
    built_in = items is None and cfg.workload.prompts_file is None
    if items is None:
        items = load_prompts(cfg.workload.prompts_file, cfg.workload.prompt_set, cfg.workload.num_prompts)
    job = prepare(cfg, pair, items, earlier, built_in)
    allocator = build_kv(job)
    seed_requests(job.cfg, job.reqs, items)
    pipe, summary, limit_hits, layout = decode(job, allocator, out_dir, quiet, on_step, keep)
    describe_run(summary, cfg=job.cfg, job_cfg=job.job_cfg, items=items, reqs=job.reqs, carried=job.carried,
                 sampling_source=job.sampling_source, pair=job.pair, drafting=job.drafting, pipe=pipe,
                 allocator=allocator, layout=layout, models_digest=job.models_digest, folders=job.folders,
                 limit_hits=limit_hits, ignored=job.ignored, overrides=overrides)
    write_results(summary, job, out_dir, quiet)
    return {"metrics": summary, "requests": job.reqs}
