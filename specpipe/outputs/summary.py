"""metrics.json's content beyond the decode loop's own timings (`decode.metrics.Metrics.summary`): what the run
decoded and with which settings, how its KV pools did, and what it was asked that it does not apply."""
from __future__ import annotations

from typing import Optional

from omegaconf import DictConfig

from specpipe.config.validate import to_container
from specpipe.decode.requests import any_sampled
from specpipe.devices.autotune import collect_decisions
from specpipe.models.cache import MODEL_LOADS
from specpipe.notes import logger
from specpipe.outputs.run_identity import prompts_digest

log = logger(__name__)


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
        log.info(f"specpipe: note: prompt fields specpipe does not read were ignored ({listed}); rename them if they "
                 f"were meant as settings")
    return found


def leaked_slots(allocator) -> int:
    """Slots not back in any pool's free list. A paired allocator (SWA, HiSparse) counts each pool: its own
    size and available() are the smaller pool's, which hid a leak in HiSparse's larger logical pool."""
    pools = [allocator.primary, allocator.peer] if hasattr(allocator, "peer") else [allocator]
    return int(sum(p.size - p.available() for p in pools))


def kv_stats(pipe, allocator, models: list) -> dict:
    """The KV pools at the end: peak use, size (what num_slots=null resolved to), leaks, bytes, and the allocator's
    own (SWA evictions, HiSparse hit rate and bytes moved)."""
    return {"kv_peak_slots": int(pipe.prep.peak_used), "kv_pool_slots": int(allocator.main_pool.size),
            "kv_leaked_slots": leaked_slots(allocator),
            "kv_cache_bytes": sum(m.kv.nbytes for m in models),  # what swa's window pool saves
            **pipe.prep.stats()}


def sampling_stats(cfg: DictConfig, reqs: list, source: str) -> dict:
    """The sampling settings the run took, where from, and how many requests brought their own."""
    sp = cfg.sampling
    return {"temperature": sp.temperature, "top_p": sp.top_p, "top_k": sp.top_k,
            "repetition_penalty": sp.repetition_penalty, "min_p": sp.min_p, "source": source,
            "per_request": sum(r.sampling is not None for r in reqs)}


def unapplied_generation(cfg: DictConfig, pair, reqs: list) -> dict:
    """generation_config.json values HF would apply and this run does not (those it took or that apply only when
    sampling, in a greedy run, left out)."""
    from specpipe.models.hf.generation import UNAPPLIED_SAMPLING

    unapplied = dict(pair.target.config.extra.get("unapplied_generation_settings") or {})
    if cfg.sampling.get("from_model"):
        unapplied.pop("repetition_penalty", None)  # taken with the sampling settings
    if not any_sampled(cfg, reqs):
        for k in UNAPPLIED_SAMPLING:  # HF applies them only when sampling
            unapplied.pop(k, None)
    return unapplied


def describe_run(summary: dict, *, cfg: DictConfig, job_cfg: DictConfig, items: list, reqs: list, carried: list,
                 sampling_source: str, pair, drafting: list, pipe, allocator, layout: dict, models_digest: str,
                 folders: list, limit_hits: int, ignored: dict, overrides: Optional[list]) -> dict:
    """`summary` (the decode loop's) completed into metrics.json's content. `cfg`: the settings the run decoded
    with; `job_cfg`: as given (what is stored, and what resume compares)."""
    summary["prompts_sha256"] = prompts_digest(items)  # resume=true compares it
    summary["model_files_sha256"] = models_digest  # name, size and mtime of the model folders' files
    summary["model_folders"] = folders
    summary["recompile_limit_hits"] = limit_hits
    summary.update(kv_stats(pipe, allocator, [pair.target, *drafting]))
    summary["sampling"] = sampling_stats(cfg, reqs, sampling_source)
    unapplied = unapplied_generation(cfg, pair, reqs)
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
    if getattr(pipe, "policy", None) is not None:  # draft=none has no policy: every step is one token
        summary["speculation"] = pipe.policy.summary()
    summary["autotune"] = collect_decisions(getattr(pipe, "stages", []))  # compile=auto choices + timings
    summary["weight_layout"] = layout  # per Linear shape: the layout kept (and what auto measured)
    cache = getattr(getattr(pipe, "proposer", None), "cache", None)
    if cache is not None:  # draft=suffix: what the cross-request cache held at the end
        summary["draft_cache"] = {"tokens": len(cache), "capacity": cache.capacity, "texts_added": cache.texts_added}
    summary["model_loads_in_process"] = MODEL_LOADS[0]  # 1 in every job of an in-process sweep: weights reused
    summary["config"] = to_container(job_cfg)
    if overrides is not None:
        summary["overrides"] = list(overrides)
    return summary
