"""Binding compile policies to stage branches: the `wrap` every stage's `bind` calls once per branch, which applies
`compile.<stage>.<branch>` through the device, and the policies a run set that no branch of it read."""
from __future__ import annotations

from omegaconf import DictConfig

from specpipe.config.compile_policy import parse_policy
from specpipe.config.schema import draft_schema
from specpipe.notes import logger

log = logger(__name__)


def make_wrap(cfg: DictConfig, device, metrics=None):
    """The binder stages call once per branch: the branch's policy, translated by the device.

    A compiled branch that runs a model forward is timed as model time as a whole (`Metrics.model_branch`):
    the per-module timer hooks cannot run inside a compiled graph (`metrics`: the run's `decode.metrics.Metrics`,
    if any). `wrap.asked` collects the policy keys the stages asked for (`unapplied_policies` names the others)."""
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
        settable = sorted(b for b in asked if b.split(".")[0] in cfg.compile)  # (not the stages that always run eager)
        label = draft_schema(cfg.draft).label(cfg.draft)
        log.info(f"specpipe: note: {', '.join(out)}: no branch of this run (draft={label}) reads "
                 f"it, so it compiles nothing (the run's branches: {', '.join(settable) or 'none, plain decoding'})")
    return out
