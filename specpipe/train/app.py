"""train(cfg): load the target, make the data, compute its features, train the head, save it, measure it.

Time: `train.minutes` bounds the whole run. Self-distillation takes at most `data.distill_share` of it, the
target's forward over the data `data.feature_share` (and `data.max_feature_gb` of memory), the held-out
evaluation keeps `train.eval_share`, and training gets the rest. A resumed run reuses the data, computes the
features again and trains on until the training time the budget gives is spent (a larger train.minutes extends
it).

out/ (the folder `draft.path` takes): config.json + model.safetensors, train_report.json, checkpoint/, and
Hydra's .hydra/ and train.log.
"""
from __future__ import annotations

import json
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from specpipe.config.build import build
from specpipe.errors import ConfigError
from specpipe.models.cache import model_dtype
from specpipe.models.eagle3 import default_aux_layers
from specpipe.notes import logger
from specpipe.train.data import data_from_state, data_state, prepare_data
from specpipe.train.evaluate import decode_metrics, heldout_metrics
from specpipe.train.features import make_shards, token_counts
from specpipe.train.heads import draft_vocab, new_head, save_head, trainable
from specpipe.train.loop import Bars, Checkpoint, fit

REPORT = "train_report.json"
log = logger(__name__)


def identity(cfg: DictConfig) -> dict:
    """What a checkpoint must share with the run that resumes it: the target and the head's settings."""
    return {"model": OmegaConf.to_yaml(cfg.model), "head": OmegaConf.to_yaml(cfg.head),
            "steps": int(cfg.train.steps)}


def check_start(cfg: DictConfig, ck: Checkpoint, state) -> None:
    """A checkpoint is only resumed when asked, and only by the same target and head settings."""
    if ck.exists() and not cfg.resume:
        raise ConfigError(f"out={cfg.out} holds a checkpoint of an earlier training ({ck.folder}); add resume=true "
                          f"to go on from it, or give another out (or delete {ck.folder}) to start anew")
    if state is not None and state["identity"] != identity(cfg):
        changed = [k for k in identity(cfg) if state["identity"][k] != identity(cfg)[k]]
        raise ConfigError(f"resume=true: {ck.folder} was trained with other {' and '.join(changed)} settings than "
                          f"this command's; resume with the same ones, or give another out to start anew")


def aux_layers(cfg: DictConfig, target) -> list | None:
    if cfg.head.kind != "eagle3":
        return None
    n = target.config.num_hidden_layers
    aux = list(cfg.head.aux_layers) if cfg.head.aux_layers is not None else default_aux_layers(n)
    if max(aux) >= n:
        raise ConfigError(f"head.aux_layers={aux} names a layer the target does not have (it has {n}: 0..{n - 1})")
    return aux


def load_target(cfg: DictConfig):
    """(device, dtype, the model pair without a draft head)."""
    device = build(cfg.device, "device")
    problem = device.bf16_autocast_problem() if cfg.train.autocast else ""
    if problem:
        log.info(f"specpipe.train: note: train.autocast=true runs in float32 here: {problem}")
        with open_dict(cfg):
            cfg.train.autocast = False  # (the report's config shows what ran)
    dtype = model_dtype(cfg)
    with torch.random.fork_rng(devices=[]):
        pair = build(cfg.model, "model", dtype=dtype, device=str(device.torch_device), draft_path=None)
    pair.draft = None  # (the shipped tiny pair loads its own head: not this one)
    pair.target.eval().requires_grad_(False)
    return device, dtype, pair


def features(cfg, pair, data, aux, budget_s, bars, batches=None) -> tuple[list, list, list, float]:
    """(train shards, held-out corpus shards, held-out greedy shards, seconds). `batches`: a resumed run's number
    of training batches, computed again whatever the time (the same shards, in the same order)."""
    t0, dev = time.perf_counter(), pair.target.lm_head.weight.device
    held = make_shards(pair.target, data.heldout, aux, cfg, None, dev, max_tokens=cfg.eval.heldout_tokens)
    greedy = make_shards(pair.target, data.heldout_greedy, aux, cfg, None, dev)
    spent = time.perf_counter() - t0
    seconds = max(1.0, cfg.data.feature_share * budget_s - spent)
    tick = bars.phase("features", seconds)
    train = make_shards(pair.target, data.train, aux, cfg, None if batches else seconds, dev, tick,
                        None if batches else cfg.data.max_feature_gb * 2 ** 30,
                        None if batches else cfg.data.max_train_tokens, batches)
    took = time.perf_counter() - t0
    bars.done("features", f"{sum(s.tokens for s in train) / 1e3:.0f}k training tokens in {len(train)} batches, "
                          f"{sum(s.nbytes for s in train) / 2 ** 30:.2f} GiB, {took:.0f} s")
    return train, held, greedy, round(took, 1)


def train(cfg: DictConfig) -> dict:
    """Train and save the head `cfg` describes; returns the report (also written to out/train_report.json)."""
    t_start, budget = time.perf_counter(), cfg.train.minutes * 60
    out, ck = Path(cfg.out), Checkpoint(Path(cfg.out) / "checkpoint")
    state = ck.load_state() if cfg.resume else None
    check_start(cfg, ck, state)
    device, dtype, pair = load_target(cfg)
    target, dev = pair.target, pair.target.lm_head.weight.device
    aux = aux_layers(cfg, target)
    times: dict = {}
    with Bars() as bars:
        saved = ck.load_data() if cfg.resume else None
        if saved is None:
            t0 = time.perf_counter()
            data = prepare_data(cfg, pair, cfg.data.distill_share * budget,
                                bars.phase("data", cfg.data.distill_share * budget))
            ck.save_data(data_state(data))
            times["data"] = round(time.perf_counter() - t0, 1)
        else:
            data = data_from_state(saved)
        train_shards, held, greedy, times["features"] = features(cfg, pair, data, aux, budget, bars,
                                                                 state["batches"] if state else None)
        if not train_shards:
            raise ConfigError("no training windows: the data is empty (data.sources, data.dirs)")
        ids = None
        if cfg.head.kind == "eagle3":
            ids = state["vocab_ids"] if state else \
                draft_vocab(token_counts(train_shards, target.config.vocab_size), cfg.head.draft_vocab_size)
        head = new_head(cfg.head, target, ids, cfg.seed).to(dev)
        if state is not None:
            head.load_state_dict(state["head"])
        pre_train = state["pre_train_s"] if state else time.perf_counter() - t_start
        train_budget = max(0.0, budget * (1 - cfg.train.eval_share) - pre_train)

        def save(progress: dict, opt) -> None:
            ck.save_state({"head": head.state_dict(), "optimizer": opt.state_dict(), "identity": identity(cfg),
                           "vocab_ids": ids, "pre_train_s": pre_train, "batches": len(train_shards), **progress})
            save_head(head, out, cfg.head.get("layout", "specforge"), target, cfg.train.steps)

        t0 = time.perf_counter()
        stats = fit(head, train_shards, cfg, train_budget, save, state, bars.phase("train", train_budget), dev)
        times["train"] = round(time.perf_counter() - t0, 1)
        bars.done("train", f"{stats['step']} steps, {stats['tokens'] / 1e6:.2f}M tokens, {stats['epochs']} epochs")
        t0 = time.perf_counter()
        report = {"heldout": heldout_metrics(head, held, greedy, cfg.eval.steps, dev)}
        if cfg.eval.decode_prompts:
            report["decode"] = decode_metrics(cfg, pair, out, dtype, str(device.torch_device))
        times["eval"] = round(time.perf_counter() - t0, 1)
    times["total"] = round(time.perf_counter() - t_start, 1)
    report = describe(cfg, pair, head, ids, data, train_shards, held, greedy, stats, times, report)
    (out / REPORT).write_text(json.dumps(report, indent=2) + "\n")
    summary(report, out)
    return report


def describe(cfg, pair, head, ids, data, train_shards, held, greedy, stats, times, measured) -> dict:
    """train_report.json: what was trained on what, how long each phase took, and how well it drafts."""
    tc = pair.target.config
    counted = token_counts(train_shards, tc.vocab_size)
    covered = float(counted[ids].sum() / counted.sum()) if ids is not None else 1.0
    return {
        "command": "python -m specpipe.train " + " ".join(sys.argv[1:]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
        "target": {"path": cfg.model.get("path") or pair.name, "layers": tc.num_hidden_layers,
                   "hidden_size": tc.hidden_size, "vocab_size": tc.vocab_size},
        "head": {"kind": cfg.head.kind, "layout": cfg.head.get("layout"), "params": sum(p.numel() for p in
                                                                                         trainable(head)),
                 "aux_layers": getattr(head, "aux_layers", None),
                 "draft_vocab_size": int(ids.numel()) if ids is not None else tc.vocab_size,
                 "draft_vocab_coverage": round(covered, 4), "trained_steps": cfg.train.steps},
        "data": {**data.stats, "train_windows_tokens": sum(s.tokens for s in train_shards),
                 "train_batches": len(train_shards),
                 "feature_gib": round(sum(s.nbytes for s in train_shards) / 2 ** 30, 3),
                 "heldout_tokens": sum(s.tokens for s in held), "heldout_greedy_tokens": sum(s.tokens for s in greedy)},
        "time_s": times,
        "train": {k: (round(v, 4) if isinstance(v, float) else v) for k, v in stats.items() if k != "ema"} |
                 {"final_ema": {k: round(v, 4) for k, v in stats["ema"].items()}},
        **measured,
        "config": OmegaConf.to_container(cfg, resolve=True),
    }


def machine() -> dict:
    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version()}


def summary(report: dict, out: Path) -> None:
    h = report["heldout"]
    lines = [f"specpipe.train: wrote {out} ({report['head']['kind']}, {report['head']['params'] / 1e6:.1f}M "
             f"parameters) in {report['time_s']['total'] / 60:.1f} min",
             f"  held-out top-1 agreement {h['top1_agreement']:.3f} (per step {h['top1_agreement_per_step']})"]
    if "simulated" in h:
        s = h["simulated"]
        lines.append(f"  simulated greedy chain ({s['rounds']} rounds): acceptance per position "
                     f"{s['acceptance_rate_per_position']}, acceptance length by depth {s['chain_acceptance_length']}")
    for name, d in report.get("decode", {}).items():
        if isinstance(d, dict):
            lines.append(f"  decoded {report['decode']['prompts']} {report['decode']['prompt_set']} prompts, {name} "
                         f"(topk {d['topk']}, steps {d['num_steps']}): acceptance length {d['accept_length_mean']}")
    lines.append(f"  use it: python -m specpipe draft=eagle draft.path={out} ...")
    print("\n".join(lines), file=sys.stderr)
