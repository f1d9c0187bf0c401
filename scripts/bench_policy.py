"""Speculation policies against plain decoding: tokens/s, acceptance length and the ratio to draft=none, per model,
prompt set and batch size, in one process (the same loaded models, the same prompts, greedy).

Rows per (model, prompts, batch): draft=none, then for each drafter speculation=static (its default tree, and a
4-token chain for the n-gram drafters), schedule, adaptive and cost. `vs none` is tokens/s over draft=none's in the
same block; `vs static` is over the best static row of the same drafter. Every output is compared with
draft=none's (greedy: they must be equal; a difference is printed).

    python scripts/bench_policy.py                                    # shipped pair and the real model, b 1 4 16
    python scripts/bench_policy.py --models tiny --batch 1 --prompts 4 # a quick look
    python scripts/bench_policy.py --models real --sets code --drafters ngram

The real model is SmolLM2-135M-Instruct as `make real-model` builds it (--real-dir to point elsewhere).
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
from datetime import datetime
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

REAL_DIR = Path(os.path.expanduser("~/.cache/specpipe/SmolLM2-135M-Instruct-float32"))
MODELS = {"tiny": (["model=tiny"], ["heldout"], ["ngram", "suffix", "eagle"]),
          "real": ([], ["chat", "code"], ["ngram", "suffix"])}
POLICIES = ["static", "schedule", "adaptive", "cost"]
CHAIN = ["draft.topk=1", "draft.num_steps=4", "draft.num_draft_tokens=5"]


def rows_for(drafter: str, policies: list[str]) -> list[tuple[str, list[str]]]:
    rows = []
    for pol in policies:
        rows.append((f"{drafter} {pol}", [f"draft={drafter}", f"speculation={pol}"]))
        if pol == "static" and drafter in ("ngram", "suffix"):
            rows.append((f"{drafter} static chain4", [f"draft={drafter}", "speculation=static", *CHAIN]))
    return rows


def measure(overrides: list[str], pair) -> tuple[dict, list]:
    from specpipe.config.compose import compose_config
    from specpipe.run import run

    out = run(compose_config(overrides), quiet=True, pair=pair)
    return out["metrics"], [r.output_ids for r in out["requests"]]


def block(model: str, base: list[str], pair, pset: str, batch: int, drafters, policies, default: str) -> list[str]:
    common = base + [f"workload.prompt_set={pset}", f"workload.batch_size={batch}"]
    m0, want = measure(common + ["draft=none"], pair)
    none = m0["tokens_per_s"]
    lines = [f"| {model} | {pset} | {batch} | none | {none:.1f} | | 1.00x | |"]
    print(lines[0], flush=True)
    for drafter in drafters:
        best_static, results = 0.0, []
        for name, ov in rows_for(drafter, policies):
            m, got = measure(common + ov, pair)
            if got != want:
                bad = sum(g != w for g, w in zip(got, want))
                print(f"  MISMATCH: {name}: {bad} of {len(want)} outputs differ from draft=none", flush=True)
            tps = m["tokens_per_s"]
            if name.split()[1] == "static":
                best_static = max(best_static, tps)
            results.append((name, tps, m["accept_length_mean"]))
        for name, tps, al in results:
            vs_static = f"{tps / best_static:.2f}x" if name.split()[1] != "static" else ""
            mark = " (default)" if name.split()[1] == default and len(name.split()) == 2 else ""
            line = (f"| {model} | {pset} | {batch} | {name}{mark} | {tps:.1f} | "
                    f"{'' if al is None else f'{al:.2f}'} | {tps / none:.2f}x | {vs_static} |")
            lines.append(line)
            print(line, flush=True)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["tiny", "real"], choices=sorted(MODELS))
    ap.add_argument("--real-dir", default=str(REAL_DIR))
    ap.add_argument("--sets", nargs="+", default=None, help="prompt sets (default: heldout for tiny, chat and code "
                                                            "for the real model)")
    ap.add_argument("--drafters", nargs="+", default=None)
    ap.add_argument("--policies", nargs="+", default=POLICIES)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="also write the table to this markdown file")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from specpipe.config.compose import compose_config
    from specpipe.devices.cpu import CpuDevice
    from specpipe.models.cache import load_pair

    default = compose_config([]).speculation._target_.rsplit(".", 2)[-2]
    head = [f"# bench_policy {datetime.now():%Y-%m-%d %H:%M}, {platform.processor() or platform.machine()}, "
            f"{args.threads} thread(s), torch {torch.__version__}, {args.prompts} prompts, {args.max_new} new tokens",
            "", "| model | prompts | batch | drafter, policy | tok/s | AL | vs none | vs best static |",
            "|---|---|---:|---|---:|---:|---:|---:|"]
    print("\n".join(head), flush=True)
    lines = list(head)
    for model in args.models:
        overrides, sets, drafters = MODELS[model]
        if model == "real":
            if not Path(args.real_dir, "config.json").is_file():
                print(f"skipping the real model: no {args.real_dir} (make real-model builds it)", flush=True)
                continue
            overrides = ["model=hf", f"model.path={args.real_dir}"]
        base = overrides + [f"workload.num_prompts={args.prompts}", f"workload.max_new_tokens={args.max_new}",
                            f"device.num_threads={args.threads}"]
        cfg0 = compose_config(base)
        pair = load_pair(cfg0, cfg0.device.dtype, CpuDevice(cfg0.device.dtype))
        for pset in args.sets or sets:
            for b in args.batch:
                lines += block(model, base, pair, pset, b, args.drafters or drafters, args.policies, default)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
