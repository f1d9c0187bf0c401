"""The verify cost itself: a target forward over Q tokens per request (a verify) vs a one-token decode, per weight
layout, on the real model (SmolLM2-135M-Instruct, fp32) at one thread.

A verify reads the same weights once as a decode does, so it should cost little more; with MKL's sgemm at 2-12
rows it cost ~2x (issue #44). Each forward here is the target's (fused q|k|v and gate|up, as `run` fuses them)
plus the lm_head over every new token, at a context of --context tokens (a causal extend: the verify's tree mask
costs the same GEMMs). Layouts, each laid out as `run` does for that forward's row counts (1 and batch x Q):

- row: HF's layout for every weight (MKL); auto-rc: `auto` choosing row or column (weight_layout=auto before
  `packed` existed); packed: oneDNN's blocked weights (the tied lm_head too, as a copy); auto: row, column or
  packed per shape; packed-untied (not run unless named): packed with the tied lm_head left row-major
  (`weight_layout.PACK_TIED` off), what packing the head buys for its copy.

    python scripts/bench_verify_cost.py                           # batch 1 and 4, verify 5 and 12, 1 thread
    python scripts/bench_verify_cost.py --batch 1 --verify 5 --calls 30

Prints ms per forward (the fastest of --calls in each of --rounds interleaved rounds) and each as a ratio against
the row layout's decode(1) at the same batch, measured in the same run; and whether each layout's greedy tokens
(argmax of every row's logits) equal row's.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
DEFAULT_MODEL = Path.home() / ".cache" / "specpipe" / "SmolLM2-135M-Instruct-float32"
LAYOUTS = {"row": ("row", False, True), "auto-rc": ("auto", False, True), "packed": ("packed", True, True),
           "auto": ("auto", True, True), "packed-untied": ("packed", True, False)}  # (mode, packs, PACK_TIED)


def forward_fn(model, batch: int, q: int, context: int):
    """A no-grad target forward of `q` new tokens for each of `batch` requests, logits for all of them."""
    from specpipe.models.attention_batch import extend_batch

    width = ((context + q + 15) // 16) * 16
    table = torch.arange(1, 1 + batch * width).view(batch, width)  # [B, C] slots (slot 0: the padding sink)
    att = extend_batch(table, torch.arange(batch), torch.full((batch,), context), torch.full((batch,), q), q, width)
    ids = torch.randint(0, model.config.vocab_size, (batch, q), generator=torch.Generator().manual_seed(q))

    def fwd():
        with torch.no_grad():
            return model.logits(model(ids, att))  # [B, Q, V]
    return fwd


def best_ms(fn, calls: int) -> float:
    """The fastest of `calls` (the least disturbed by other work on a shared machine)."""
    for _ in range(2):
        fn()
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=str(DEFAULT_MODEL))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--verify", type=int, nargs="+", default=[5, 12], help="tokens per request in a verify")
    ap.add_argument("--context", type=int, default=120)
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layouts", nargs="+", default=["row", "auto-rc", "packed", "auto"], choices=list(LAYOUTS))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from specpipe.devices import weight_layout
    from specpipe.devices.weight_layout import lay_out_weights
    from specpipe.models.hf.load import load_target
    from specpipe.models.llama import fuse_projections

    model = load_target(args.model_dir).eval()
    fuse_projections([model])
    model.setup_kv(1 + max(args.batch) * (((args.context + max(args.verify) + 15) // 16) * 16))
    cells = [(b, q) for b in args.batch for q in (1, *args.verify)]
    best: dict = {}
    tokens: dict = {}
    choices: dict = {}
    for _ in range(args.rounds):
        for lay in args.layouts:
            mode, packs, weight_layout.PACK_TIED = LAYOUTS[lay]
            for b, q in cells:  # laid out as `run` would for this forward: rows 1 and b x q
                choices[(lay, b, q)] = lay_out_weights([model], mode, (1, b * q), packs=packs)
                fwd = forward_fn(model, b, q, args.context)
                ms = best_ms(fwd, args.calls)
                best[(lay, b, q)] = min(best.get((lay, b, q), ms), ms)
                tokens[(lay, b, q)] = fwd().argmax(-1)
    weight_layout.PACK_TIED = True
    lay_out_weights([model], "row")
    print(f"{Path(args.model_dir).name}, {args.threads} thread(s), context {args.context}, fastest of {args.calls} "
          f"calls x {args.rounds} interleaved rounds, torch {torch.__version__}")
    print("batch | forward    | " + " | ".join(f"{lay:>16}" for lay in args.layouts) + " | tokens as row")
    for b, q in cells:
        base = best[("row", b, 1)] if "row" in args.layouts else best[(args.layouts[0], b, 1)]
        row = " | ".join(f"{best[(lay, b, q)]:7.2f} ({best[(lay, b, q)] / base:4.2f}x)" for lay in args.layouts)
        same = all(torch.equal(tokens[(lay, b, q)], tokens[(args.layouts[0], b, q)]) for lay in args.layouts)
        name = f"{'decode' if q == 1 else 'verify'}({q})"
        print(f"{b:5d} | {name:<10} | {row} | {'yes' if same else 'NO'}")
    for lay in (x for x in args.layouts if x.startswith("auto")):
        b, q = cells[-1]
        print(f"{lay} at batch {b}, verify({q}): " + ", ".join(
            f"{k} {v['layout']}" for k, v in choices[(lay, b, q)].items()))


if __name__ == "__main__":
    main()
