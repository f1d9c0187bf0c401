"""End-to-end decode benchmark: draft=none vs speculative configurations, same prompts, one process.

Prints tokens/s, the ratio to draft=none (same batch size, same run), acceptance length, and the
per-step cost breakdown: draft forwards (EAGLE head / draft model, incl. the post-verify extend),
the verify forward of the target, and everything else (host work: tree building, bookkeeping).

    python scripts/bench_e2e.py                       # model=tiny, batch 1 and 8
    python scripts/bench_e2e.py --model random_tiny --batch 1 --max-new 64
    python scripts/bench_e2e.py --configs "draft.topk=1 draft.num_steps=5" \\
        "draft.topk=4 draft.num_steps=5 draft.num_draft_tokens=16"
    python scripts/bench_e2e.py --model hf --model-args model.path=DIR --prompt-set code --configs draft=ngram

A real checkpoint's folder (--model hf --model-args model.path=DIR) decodes the `chat` set by default when it
has a chat template (--prompt-set: any workload.prompt_set). Without an EAGLE head (--model-args draft.path=HEAD
gives one), the default configs leave out the EAGLE ones.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEFAULT_CONFIGS = [
    "draft.topk=1 draft.num_steps=4",
    "draft.topk=1 draft.num_steps=6",
    "draft.topk=2 draft.num_steps=5 draft.num_draft_tokens=8",
    "draft.topk=4 draft.num_steps=5 draft.num_draft_tokens=12",
    "draft=ngram",
]


def measure(overrides: list[str], pair, repeats: int) -> dict:
    from specpipe.run import run
    from specpipe.config.compose import compose_config

    best = None
    for _ in range(repeats):
        m = run(compose_config(overrides), quiet=True, pair=pair)["metrics"]
        if best is None or m["tokens_per_s"] > best["tokens_per_s"]:
            best = m
    return best


def breakdown(m: dict) -> tuple[float, float, float]:
    """(draft ms, verify ms, other ms) per step."""
    model = m["stage_model_ms"]
    total = sum(m["stage_ms"].values()) - m["stage_ms"].get("prefill", 0.0)
    draft = model.get("draft", 0.0) + model.get("draft_extend", 0.0)
    verify = model.get("verify", 0.0)
    return draft, verify, total - draft - verify


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="model option (tiny, random_tiny, hf)")
    ap.add_argument("--model-args", nargs="*", default=[], help="extra model overrides, e.g. model.path=DIR")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2, help="runs per point; the best is kept")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--configs", nargs="+", default=None, help=f"default: {DEFAULT_CONFIGS}")
    ap.add_argument("--prompt-set", default=None, help="workload.prompt_set (heldout, chat, code, ...); default: chat "
                                                       "for a model with a chat template, else heldout")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from specpipe.models.cache import load_pair
    from specpipe.config.compose import compose_config
    from specpipe.devices.cpu import CpuDevice

    base = [f"model={args.model}", *args.model_args, f"workload.max_new_tokens={args.max_new}",
            f"workload.num_prompts={args.prompts}"]
    cfg0 = compose_config(base)
    pair = load_pair(cfg0, cfg0.device.dtype, CpuDevice(cfg0.device.dtype))
    chat = getattr(pair.tokenizer, "chat_template", None) is not None
    prompt_set = args.prompt_set or ("chat" if chat else "heldout")
    base.append(f"workload.prompt_set={prompt_set}")
    configs = args.configs or [c for c in DEFAULT_CONFIGS if pair.draft is not None or c.startswith("draft=")]
    print(f"model={args.model} threads={torch.get_num_threads()} prompts={args.prompts} ({prompt_set}) "
          f"max_new={args.max_new}")
    header = f"{'batch':>5} | {'config':<58} | {'tok/s':>7} | {'ratio':>5} | {'AL':>4} | " \
             f"{'draft ms':>8} | {'verify ms':>9} | {'other ms':>8}"
    print(header)
    print("-" * len(header))
    for b in args.batch:
        rows = [("draft=none", base + [f"workload.batch_size={b}", "draft=none"])]
        rows += [(c, base + [f"workload.batch_size={b}", *c.split()]) for c in configs]
        baseline = None
        for name, ov in rows:
            m = measure(ov, pair, args.repeats)
            baseline = baseline or m["tokens_per_s"]
            d, v, o = breakdown(m)
            al = m["accept_length_mean"]
            print(f"{b:>5} | {name:<58} | {m['tokens_per_s']:>7.1f} | {m['tokens_per_s'] / baseline:>4.2f}x | "
                  f"{al if al is None else round(al, 2)!s:>4} | {d:>8.2f} | {v:>9.2f} | {o:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
