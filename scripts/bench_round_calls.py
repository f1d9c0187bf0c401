"""What each one-call branch buys: a compiled EAGLE run on the shipped pair with the model forwards compiled
(the baseline), then with `draft_loop.steps`, `verify.round` and `prefill.target_forward` added one at a time
(`compile=rounds` has all three), and with verify.round but the head's extend left to its own call.

Every config runs once to compile, then --repeats interleaved timed rounds (best kept); tokens/s are printed as
ratios against the baseline of the same run, with each stage's ms per round, and every config's outputs are
checked against the baseline's (greedy: identical).

    python scripts/bench_round_calls.py [--steps 6] [--prompts 16] [--max-new 64] [--repeats 3]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FORWARDS = ["compile.verify.target_forward=compile", "compile.draft_forward.decode=compile",
            "compile.draft_forward.extend=compile"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6, help="draft.num_steps of the topk=1 chain")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from specpipe import run as app
    from specpipe.config.compose import compose_config
    from specpipe.models.hf.load import load_hf

    tiny = ROOT / "specpipe" / "assets" / "tiny"
    pair = load_hf(tiny / "target", tiny / "eagle", dtype="float32", name="bench")
    base = ["model=hf", f"model.path={tiny / 'target'}", "workload.prompt_set=heldout",
            f"workload.num_prompts={args.prompts}", f"workload.max_new_tokens={args.max_new}",
            "workload.batch_size=1", "draft=eagle", "draft.topk=1", f"draft.num_steps={args.steps}",
            f"draft.num_draft_tokens={args.steps + 1}", *FORWARDS]
    loop, rnd, pre = ("compile.draft_loop.steps=compile", "compile.verify.round=compile",
                      "compile.prefill.target_forward=compile")
    cases = [("model forwards compiled (baseline)", [], False), ("+ draft_loop.steps", [loop], False),
             ("+ verify.round, extend apart", [loop, rnd], True), ("+ verify.round", [loop, rnd], False),
             ("+ prefill.target_forward (compile=rounds)", [loop, rnd, pre], False)]
    cfgs = [compose_config(base + extra) for _, extra, _ in cases]

    build, apart = app.build_pipeline, [False]

    def build_pipeline(*a, **k):  # "extend apart": verify.round without the head's extend inside it
        pipe = build(*a, **k)
        if apart[0]:
            pipe.verify.draft = None
        return pipe

    app.build_pipeline = build_pipeline

    def once(i):
        apart[0] = cases[i][2]
        t = time.perf_counter()
        res = app.run(cfgs[i], quiet=True, pair=pair)
        return time.perf_counter() - t, res

    outs = [[r.output_ids for r in once(i)[1]["requests"]] for i in range(len(cases))]  # compiles
    best = [None] * len(cases)
    for _ in range(args.repeats):
        for i in range(len(cases)):
            wall, res = once(i)
            if best[i] is None or wall < best[i][0]:
                best[i] = (wall, res["metrics"])
    print(f"shipped pair, EAGLE topk=1 steps={args.steps}, {args.prompts} prompts x {args.max_new} tokens, batch 1, "
          f"{args.threads} thread(s), best of {args.repeats}")
    print("| config | tokens/s | vs baseline | draft | draft_extend | verify | prefill (ms per round) | outputs |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    base_tps = sum(map(len, outs[0])) / best[0][0]
    for (name, _, _), (wall, m), out in zip(cases, best, outs):
        st, tps = m["stage_ms"], sum(map(len, out)) / wall
        print(f"| {name} | {tps:.1f} | {tps / base_tps:.2f}x | {st.get('draft', 0):.2f} | "
              f"{st.get('draft_extend', 0):.2f} | {st.get('verify', 0):.2f} | {st.get('prefill', 0):.2f} | "
              f"{'same' if out == outs[0] else 'DIFFER'} |")


if __name__ == "__main__":
    main()
