"""device.weight_layout: decode speed of the shipped pair with every Linear weight row-major (HF's layout),
column-major, or as `auto` chooses per shape, in one process, interleaved rounds, best of each.

    python scripts/bench_weight_layout.py                       # draft=none and draft=ngram, batch 1 and 8
    python scripts/bench_weight_layout.py --drafts none --batch 1 --repeats 5

Prints tokens/s per layout as a ratio against `row` measured in the same run, whether the greedy outputs
match `row`'s (the layouts round differently in the last bits, so a rare argmax tie may flip), and the
per-shape choice and µs per call `auto` measured.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=str(ROOT / "specpipe" / "assets" / "tiny"))
    ap.add_argument("--drafts", nargs="+", default=["none", "ngram"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from specpipe.run import run
    from specpipe.config.compose import compose_config
    from specpipe.models.hf.load import load_hf

    d = Path(args.model_dir)
    pair = load_hf(d / "target", None, dtype="float32", name="bench")
    layouts = ("row", "column", "auto")
    print(f"shipped target, {args.prompts} held-out prompts, max_new_tokens={args.max_new}, {args.threads} thread(s), "
          f"best of {args.repeats} interleaved rounds, torch {torch.__version__}")
    print("draft | batch | layout | tokens/s | vs row | outputs as row")
    for draft in args.drafts:
        for b in args.batch:
            cfgs = {lay: compose_config(["model=hf", f"model.path={d / 'target'}", "workload.prompt_set=heldout",
                                         f"workload.num_prompts={args.prompts}",
                                         f"workload.max_new_tokens={args.max_new}", f"workload.batch_size={b}",
                                         f"draft={draft}", f"device.weight_layout={lay}"]) for lay in layouts}
            best, outs, report = {}, {}, None
            for lay in layouts:  # warm-up (auto times its shapes here)
                run(cfgs[lay], quiet=True, pair=pair)
            for _ in range(args.repeats):
                for lay in layouts:
                    res = run(cfgs[lay], quiet=True, pair=pair)
                    m = res["metrics"]
                    best[lay] = max(best.get(lay, 0.0), m["tokens_per_s"])
                    outs[lay] = [list(r.output_ids) for r in res["requests"]]
                    if lay == "auto":
                        report = m["weight_layout"]
            for lay in layouts:
                print(f"{draft:>5} | {b:5d} | {lay:>6} | {best[lay]:8.1f} | {best[lay] / best['row']:5.2f}x | "
                      f"{'yes' if outs[lay] == outs['row'] else 'NO'}")
            def timings(v):  # a tied head or a kept layout has no timings for every layout
                return " / ".join(f"{lay} {us}" for lay, us in v.get("us", {}).items()) or "not timed"
            print("        auto chose: " + ", ".join(f"{k} {v['layout']} ({timings(v)} µs)" for k, v in report.items()))


if __name__ == "__main__":
    main()
