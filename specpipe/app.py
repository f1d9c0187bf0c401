"""run(cfg): validate, build the device, model, allocator and pipeline from config, decode, write outputs."""
from __future__ import annotations

import inspect
import json
import os
from pathlib import Path
from typing import Optional

import torch
from omegaconf import DictConfig

from specpipe.build import build
from specpipe.compile_policy import parse_policy
from specpipe.metrics import Metrics, recompile_count
from specpipe.pipeline import PlainPipeline, Request
from specpipe.runner import run_requests
from specpipe.stages.prepare_decode import target_kv_layout
from specpipe.spec_pipeline import EaglePipeline
from specpipe.validate import to_container, validate
from specpipe.workload import load_prompts


def make_wrap(cfg: DictConfig, device):
    """The binder stages call once per branch: the branch's policy, translated by the device."""
    def wrap(stage: str, branch: str, fn):
        policy = cfg.compile.get(stage, {}).get(branch) if stage in cfg.compile else None
        return fn if policy is None else device.compile(fn, parse_policy(policy))
    return wrap


def build_allocator(cfg: DictConfig, device):
    kwargs = {"device": device.torch_device}
    target = cfg.allocator._target_
    from hydra.utils import get_method
    params = inspect.signature(get_method(target)).parameters
    if "kernels" in params:
        kwargs["kernels"] = device.allocator_kernels
    return build(cfg.allocator, "allocator", **kwargs)


def make_requests(items: list[dict], tokenizer, max_new_tokens: int, max_position: int) -> list[Request]:
    reqs = []
    for i, it in enumerate(items):
        r = Request(i, it.get("prompt", ""), [], max_new_tokens)
        if "error" in it:
            r.finish_reason, r.error = "error", it["error"]
        elif not r.prompt:
            r.finish_reason, r.error = "error", "empty prompt: nothing to continue from"
        else:
            r.prompt_ids = tokenizer.encode(r.prompt)
            if len(r.prompt_ids) + max_new_tokens > max_position:
                r.finish_reason = "error"
                r.error = (f"prompt of {len(r.prompt_ids)} tokens plus max_new_tokens={max_new_tokens} exceeds the "
                           f"model's context of {max_position} tokens")
        reqs.append(r)
    return reqs


def build_pipeline(cfg: DictConfig, device, pair, allocator, reqs: list[Request], metrics: Metrics):
    d = cfg.draft
    longest = max((len(r.prompt_ids) for r in reqs), default=1)
    ps = allocator.page_size
    max_context = longest + cfg.workload.max_new_tokens + d.num_draft_tokens + d.topk * d.num_steps + 2 * ps + 1
    max_requests = cfg.workload.batch_size
    eos = pair.tokenizer.eos_token_id
    if d.method == "none":
        return PlainPipeline(pair.target, allocator, device, max_requests, max_context, eos, metrics)
    if pair.draft is None:
        from specpipe.errors import ConfigError
        raise ConfigError(f"draft=eagle needs an EAGLE head, but model {pair.name!r} has none; give draft.path=DIR "
                          "or use draft=none")
    return EaglePipeline(pair.target, pair.draft, allocator, device, max_requests, max_context, eos, metrics,
                         d.topk, d.num_steps, d.num_draft_tokens, make_wrap(cfg, device),
                         fused_topk=bool(cfg.compile.draft_topk.fused))


def run(cfg: DictConfig, out_dir: Optional[str] = None, quiet: bool = False, pair=None) -> dict:
    validate(cfg)
    items = load_prompts(cfg.workload.prompts_file, cfg.workload.prompt_set, cfg.workload.num_prompts)
    torch.manual_seed(cfg.seed)
    device = build(cfg.device, "device")
    dtype = cfg.model.get("dtype") or cfg.device.dtype
    if pair is None:
        pair = build(cfg.model, "model", dtype=dtype, device=str(device.torch_device), draft_path=cfg.draft.path)
    allocator = build_allocator(cfg, device)
    pair.target.setup_kv(allocator.pool_slots, **target_kv_layout(pair, allocator))  # checks the pair fits
    if pair.draft is not None:
        pair.draft.setup_kv(allocator.pool_slots)
    reqs = make_requests(items, pair.tokenizer, cfg.workload.max_new_tokens,
                         pair.target.config.max_position_embeddings)
    metrics = Metrics(cfg.draft.num_steps if cfg.draft.method != "none" else 1, cfg.draft.topk)
    pipe = build_pipeline(cfg, device, pair, allocator, reqs, metrics)
    compiles_before = recompile_count()
    wall = run_requests(pipe, reqs, cfg.workload.batch_size)
    summary = metrics.summary(wall, recompile_count() - compiles_before)
    summary["kv_peak_slots"] = int(pipe.prep.peak_used)
    summary["kv_leaked_slots"] = int(allocator.size - allocator.available())
    summary.update(pipe.prep.stats())  # allocator-specific: SWA evictions, HiSparse hit rate / bytes moved
    summary["num_requests"] = len(reqs)
    summary["num_errors"] = sum(r.finish_reason == "error" for r in reqs)
    summary["config"] = to_container(cfg)
    if out_dir is not None:
        write_outputs(Path(out_dir), summary, reqs, pair.tokenizer)
    if not quiet:
        from specpipe.report_console import print_summary
        print_summary(summary, out_dir)
    return {"metrics": summary, "requests": reqs}


def write_outputs(out: Path, summary: dict, reqs: list[Request], tokenizer) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "metrics.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2))
    with open(out / "completions.jsonl", "w") as f:
        for r in reqs:
            rec = {"index": r.index, "prompt": r.prompt, "output_ids": r.output_ids,
                   "text": tokenizer.decode(r.output_ids), "finish_reason": r.finish_reason}
            if r.error:
                rec["error"] = r.error
            f.write(json.dumps(rec) + "\n")
    os.replace(tmp, out / "metrics.json")  # written last: its presence marks a finished job
