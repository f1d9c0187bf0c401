"""Time one draft round of the draft top-k stage under the compile presets eager, whole, split and auto.

Run: .venv/bin/python scripts/bench_draft_topk.py            (quick: ~1 min with a cold inductor cache)
     .venv/bin/python scripts/bench_draft_topk.py --full     (200 timed rounds per cell)

A round is DraftTopK steps 0..num_steps-1 on inputs shaped like EaglePipeline.draft's (step i >= 1
gets the draft forward's reshaped [B*K, K] / [B*K, H] views). Policies come from
conf/compile/<preset>.yaml, bound through CpuDevice.compile exactly as the app binds them. One
stage per (preset, topk) serves every batch size and hidden size, as one run serves a changing
batch; `auto` gets a fresh stage per cell, like a fresh run: it decides on its first calls. The
policies are timed interleaved, round by round in shuffled order, and the median is reported. One
torch thread by default: on a shared 2-core machine the second OpenMP thread made rounds 100x slower
whenever another process took its core.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specpipe.devices.autotune import collect_decisions  # noqa: E402
from specpipe.config.compose import compose_config  # noqa: E402
from specpipe.config.compile_policy import parse_policy  # noqa: E402
from specpipe.devices.cpu import CpuDevice  # noqa: E402
from specpipe.decode.metrics import recompile_count  # noqa: E402
from specpipe.stages.draft_topk import DraftTopK  # noqa: E402

PRESETS = ("eager", "whole", "split", "auto")


def round_inputs(B: int, K: int, H: int, steps: int, seed: int = 0) -> list:
    """Per step (topk_p, topk_index, hidden) as the pipeline passes them; scores chain at run time."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(steps):
        rows = B if i == 0 else B * K
        p = torch.rand(rows, K, generator=gen).softmax(-1)
        idx = torch.randint(0, 32000, (rows, K), generator=gen)
        hid = torch.randn(rows, H, generator=gen)
        if i:  # views of [B, K, ...] tensors, like draft_forward.decode's outputs
            p, idx, hid = (t.view(B, K, -1).reshape(B * K, -1) for t in (p, idx, hid))
        out.append((p, idx, hid))
    return out


def draft_round(stage, inputs) -> None:
    scores = None
    for i, (p, idx, hid) in enumerate(inputs):
        scores = stage(i, p, idx, hid, scores)[2]


def make_stage(preset: str, K: int, device) -> DraftTopK:
    conf = compose_config([f"compile={preset}"]).compile.draft_topk
    stage = DraftTopK(K, fused=bool(conf.fused))
    stage.bind(lambda st, br, fn: device.compile(fn, parse_policy(conf[br])))
    return stage


def bench_cell(stages: dict, inputs, reps: int, warmup: int) -> tuple[dict, dict]:
    """Median µs per round per preset, graphs compiled per preset while warming up, and while timing (should be 0)."""
    graphs = {}
    for name, st in stages.items():
        before = recompile_count()
        with torch.no_grad():
            for _ in range(warmup):
                draft_round(st, inputs)
        graphs[name] = recompile_count() - before
    times: dict = {n: [] for n in stages}
    order, rng = list(stages), random.Random(0)
    before = recompile_count()
    with torch.no_grad():
        for _ in range(reps):
            rng.shuffle(order)  # random predecessors: a round after a compiled one runs on colder caches
            for name in order:
                t0 = time.perf_counter()
                draft_round(stages[name], inputs)
                times[name].append(time.perf_counter() - t0)
    return {n: 1e6 * statistics.median(v) for n, v in times.items()}, graphs, recompile_count() - before


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="200 timed rounds per cell instead of 25")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--topk", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--hidden", type=int, nargs="+", default=[256, 4096])
    ap.add_argument("--steps", type=int, default=5, help="draft steps per round (num_steps)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads; on a shared 2-core machine a second OpenMP thread stalls a whole "
                         "round whenever another process takes its core")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    reps, warmup = (200, 8) if args.full else (25, 4)
    torch.manual_seed(0)
    dev = CpuDevice()
    t_start = time.perf_counter()
    rows = []
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.steps} steps per round, "
          f"{reps} timed rounds per cell", flush=True)
    for K in args.topk:
        shared = {p: make_stage(p, K, dev) for p in PRESETS if p != "auto"}
        for H in args.hidden:
            for B in args.batch:
                t0 = time.perf_counter()
                stages = dict(shared, auto=make_stage("auto", K, dev))  # decides on this cell's shapes
                inputs = round_inputs(B, K, H, args.steps, seed=B)
                us, graphs, timed = bench_cell(stages, inputs, reps, warmup)
                if timed:
                    print(f"  WARNING: {timed} graph(s) compiled while timing topk={K} B={B} H={H}", file=sys.stderr)
                dec = collect_decisions([stages["auto"]])
                choice = "/".join((dec.get(f"draft_topk.{b}") or {}).get("choice") or "-" for b in ("first", "later"))
                rows.append((K, B, H, us, graphs, choice))
                print(f"  done topk={K} B={B} H={H} in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    print_table(rows)
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s; graphs = Dynamo graphs compiled in that cell "
          "(warm-up included; whole/split stages are shared across H and B within a topk, auto is fresh per cell)")


def print_table(rows) -> None:
    print("\n| topk | B | H | eager µs | whole µs (×eager) | split µs (×eager) | auto µs (×eager) "
          "| graphs whole/split/auto | auto first/later |")
    print("|---|---|---|---|---|---|---|---|---|")
    for K, B, H, us, g, choice in rows:
        e = us["eager"]
        cells = " | ".join(f"{us[p]:.1f} ({us[p] / e:.2f})" for p in ("whole", "split", "auto"))
        print(f"| {K} | {B} | {H} | {e:.1f} | {cells} | {g['whole']}/{g['split']}/{g['auto']} | {choice} |")


if __name__ == "__main__":
    main()
