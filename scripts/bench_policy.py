"""Speculation policies against plain decoding: tokens/s, acceptance length and the ratio to draft=none, per model,
prompt set and batch size, in one process (the same loaded models, the same prompts, greedy).

Rows per (model, prompts, batch): draft=none, then for each drafter speculation=static (its default tree, and a
4-token chain for the n-gram drafters), schedule, adaptive and cost. `vs none` is tokens/s over draft=none's in the
same block; `vs static` is over the best static row of the same drafter; `plain step` is the median latency of the
row's steps that verified no draft over draft=none's step, at the block's full batch (what speculating costs where it
does not draft: the floor of the `vs none` target; metrics.json's plain_step_ms_p50). Each row runs --reps times,
interleaved with the block's other rows, and keeps its best run (a shared machine's noise only slows a run). Every
output is compared with draft=none's (greedy: they must be equal; a difference is printed). The last lines list
the rows where the default policy (or --check POLICY) is under 0.97x draft=none or its drafter's best static row.

    python scripts/bench_policy.py                                    # shipped pair and the real model, b 1 4 16
    python scripts/bench_policy.py --models tiny --batch 1 --prompts 4 # a quick look
    python scripts/bench_policy.py --models real --sets code --drafters ngram

The real model is SmolLM2-135M-Instruct as `make real-model` builds it (--real-dir to point elsewhere); --real-head
DIR adds its draft=eagle rows with that head (e.g. one `python -m specpipe.train` wrote).

    python scripts/bench_policy.py --models real --sets chat --real-head out/head --drafters eagle --batch 1 4
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


def rows_for(drafter: str, policies: list[str], extra: tuple = ()) -> list[tuple[str, list[str]]]:
    rows = []
    for pol in policies:
        rows.append((f"{drafter} {pol}", [f"draft={drafter}", f"speculation={pol}", *extra]))
        if pol == "static" and drafter in ("ngram", "suffix"):
            rows.append((f"{drafter} static chain4", [f"draft={drafter}", "speculation=static", *CHAIN]))
    return rows


def measure(overrides: list[str], pair) -> tuple[dict, list]:
    from specpipe.config.compose import compose_config
    from specpipe.run import run

    out = run(compose_config(overrides), quiet=True, pair=pair)
    return out["metrics"], [r.output_ids for r in out["requests"]]


def block(model: str, base: list[str], pair, pset: str, batch: int, drafters, policies, default: str,
          reps: int, extra: dict) -> list[str]:
    """One (model, prompts, batch) block: every row `reps` times, interleaved (row 1..n, then again), each row's
    best run kept: interference on a shared machine only ever slows a run down. `extra`: a drafter's own
    overrides (draft=eagle's draft.path)."""
    common = base + [f"workload.prompt_set={pset}", f"workload.batch_size={batch}"]
    rows = [("none", ["draft=none"])] + [r for d in drafters for r in rows_for(d, policies, extra.get(d, ()))]
    tps: dict = {name: [] for name, _ in rows}
    al, plain, want, at = {}, {}, None, None
    for _ in range(reps):
        for name, ov in rows:
            m, got = measure(common + ov, pair)
            if want is None:
                want = got
            elif got != want:
                bad = sum(g != w for g, w in zip(got, want))
                print(f"  MISMATCH: {name}: {bad} of {len(want)} outputs differ from draft=none", flush=True)
            tps[name].append(m["tokens_per_s"])
            al[name] = m["accept_length_mean"]
            at = max(m["plain_step_ms_p50"]) if name == "none" else at  # (none runs first: the full batch)
            ms = m["plain_step_ms_p50"].get(at)
            if ms is not None:  # the best run's (noise only slows a step)
                plain[name] = min(plain.get(name, ms), ms)
    best = {name: max(v) for name, v in tps.items()}
    none = best["none"]
    def vs_plain(name):
        return f"{plain[name] / plain['none']:.2f}x" if name in plain else ""
    lines = [f"| {model} | {pset} | {batch} | none | {none:.1f} | | 1.00x | | 1.00x |"]
    for drafter in drafters:
        names = [name for name, _ in rows_for(drafter, policies)]
        best_static = max((best[n] for n in names if n.split()[1] == "static"), default=None)
        for name in names:
            static = name.split()[1] == "static"
            vs_static = f"{best[name] / best_static:.2f}x" if best_static and not static else ""
            mark = " (default)" if name.split()[1] == default and len(name.split()) == 2 else ""
            lines.append(f"| {model} | {pset} | {batch} | {name}{mark} | {best[name]:.1f} | "
                         f"{'' if al[name] is None else f'{al[name]:.2f}'} | {best[name] / none:.2f}x | {vs_static} | "
                         f"{vs_plain(name)} |")
    print("\n".join(lines), flush=True)
    return lines


def missed(lines: list[str], policy: str) -> list[str]:
    """The rows where `policy` is under 0.97x draft=none or under 0.97x its drafter's best static row."""
    out = []
    for line in lines:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 9 and cells[3].split(" ")[1:2] == [policy]:
            ratios = [float(c.rstrip("x")) for c in cells[6:8] if c]
            if min(ratios) < 0.97:
                out.append(line)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["tiny", "real"], choices=sorted(MODELS))
    ap.add_argument("--real-dir", default=str(REAL_DIR))
    ap.add_argument("--real-head", default=None, help="an EAGLE head for the real model: adds its draft=eagle rows")
    ap.add_argument("--sets", nargs="+", default=None, help="prompt sets (default: heldout for tiny, chat and code "
                                                            "for the real model)")
    ap.add_argument("--drafters", nargs="+", default=None)
    ap.add_argument("--policies", nargs="+", default=POLICIES)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=2, help="runs of each row, interleaved; the best is kept")
    ap.add_argument("--check", default=None, help="the policy whose targets are checked (default: the default "
                                                  "policy): rows under 0.97x draft=none or its best static")
    ap.add_argument("--out", default=None, help="also write the table to this markdown file")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from specpipe.config.compose import compose_config
    from specpipe.devices.cpu import CpuDevice
    from specpipe.models.cache import load_pair

    default = compose_config([]).speculation._target_.rsplit(".", 2)[-2]
    head = [f"# bench_policy {datetime.now():%Y-%m-%d %H:%M}, {platform.processor() or platform.machine()}, "
            f"{args.threads} thread(s), torch {torch.__version__}, {args.prompts} prompts, {args.max_new} new tokens, "
            f"best of {args.reps} interleaved runs",
            "", "| model | prompts | batch | drafter, policy | tok/s | AL | vs none | vs best static | plain step |",
            "|---|---|---:|---|---:|---:|---:|---:|---:|"]
    print("\n".join(head), flush=True)
    lines = list(head)
    for model in args.models:
        overrides, sets, drafters = MODELS[model]
        extra, load = {}, []
        if model == "real":
            if not Path(args.real_dir, "config.json").is_file():
                print(f"skipping the real model: no {args.real_dir} (make real-model builds it)", flush=True)
                continue
            overrides = ["model=hf", f"model.path={args.real_dir}"]
            if args.real_head:
                drafters = drafters + ["eagle"]
                extra = {"eagle": (f"draft.path={args.real_head}",)}
                load = ["draft=eagle", *extra["eagle"]]
        base = overrides + [f"workload.num_prompts={args.prompts}", f"workload.max_new_tokens={args.max_new}",
                            f"device.num_threads={args.threads}"]
        cfg0 = compose_config(base + load)
        pair = load_pair(cfg0, cfg0.device.dtype, CpuDevice(cfg0.device.dtype))
        for pset in args.sets or sets:
            for b in args.batch:
                lines += block(model, base, pair, pset, b, args.drafters or drafters, args.policies, default,
                               args.reps, extra)
    policy = args.check or default
    bad = missed(lines, policy)
    verdict = [f"\n{policy}: {len(bad)} row(s) under 0.97x draft=none or the best static row" + (":" if bad else "")]
    print("\n".join(verdict + bad), flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines + verdict + bad) + "\n")


if __name__ == "__main__":
    main()
