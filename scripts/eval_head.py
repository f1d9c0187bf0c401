"""How well an EAGLE head drafts for its target on a built-in prompt set it never trained on.

specpipe.train's own report measures a head on held-out pieces of its training corpora and on 8 chat prompts;
this script measures any head (trained here or published) on a whole built-in set, the way docs/checkpoints.md
quotes it:

1. the target's greedy continuations of the set (specpipe, draft=none, batch 8);
2. over them, teacher-forced top-1 agreement per draft step and a simulated greedy chain decode
   (specpipe/train/evaluate.py's `heldout_metrics`: acceptance per position, acceptance length by depth);
3. each decode shape (--shapes, topk/num_steps/num_draft_tokens) run through specpipe at batch 1 with
   `speculation=static` (every round verifies its whole draft, so the AL is the head's, not a policy's):
   its accept_length_mean and tokens/s beside draft=none's.

    python scripts/eval_head.py --model-dir ~/.cache/specpipe/SmolLM2-135M-Instruct-float32 --head out/head
    python scripts/eval_head.py --model-dir DIR --head HEAD_A HEAD_B --prompt-set code --shapes 4/3/8 8/6/32
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specpipe.config.compose import compose_config  # noqa: E402
from specpipe.models.hf.load import load_draft, load_hf  # noqa: E402
from specpipe.models.pair import ModelPair  # noqa: E402
from specpipe.run import run  # noqa: E402
from specpipe.train.data import Seq  # noqa: E402
from specpipe.train.evaluate import heldout_metrics  # noqa: E402
from specpipe.train.features import make_shards  # noqa: E402


def decode(args, pair, overrides: list[str], head: Path | None = None) -> dict:
    cfg = compose_config(["model=hf", f"model.path={args.model_dir}", f"workload.prompt_set={args.prompt_set}",
                          f"workload.num_prompts={args.prompts}", f"workload.max_new_tokens={args.max_new}",
                          f"device.num_threads={args.threads}", "speculation=static", *overrides])
    if head is not None:
        OmegaConf.update(cfg, "draft.path", str(head))
    return run(cfg, quiet=True, pair=pair)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", required=True, help="the target's HF folder")
    ap.add_argument("--head", required=True, type=Path, nargs="+", help="heads' folders (what draft.path takes)")
    ap.add_argument("--prompt-set", default="chat", help="a built-in set: chat, code, heldout, ...")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--steps", type=int, default=6, help="depth of the simulated chain")
    ap.add_argument("--shapes", nargs="*", default=["4/3/8", "1/6/7"],
                    help="decode shapes topk/num_steps/num_draft_tokens (none: skip the decodes)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    pair = load_hf(args.model_dir)
    t0 = time.perf_counter()
    plain = decode(args, pair, ["draft=none", "workload.batch_size=8"])
    seqs = [Seq(list(r.prompt_ids) + list(r.output_ids), len(r.prompt_ids) - 1, "greedy")
            for r in plain["requests"] if r.output_ids]
    none = decode(args, pair, ["draft=none", "workload.batch_size=1"])["metrics"]
    results = [measure(args, pair, head, seqs, none) for head in args.head]
    if args.json:
        args.json.write_text(json.dumps({"prompt_set": args.prompt_set, "prompts": len(seqs),
                                         "max_new_tokens": args.max_new, "heads": results,
                                         "seconds": round(time.perf_counter() - t0, 1)}, indent=2) + "\n")


def measure(args, pair, folder: Path, seqs: list, none: dict) -> dict:
    """One head: the simulated chain over the continuations `seqs`, then each decode shape beside `none`."""
    head = load_draft(folder, pair.target).float()
    with_head = ModelPair(pair.target, head, pair.tokenizer, name=pair.name)
    pair.target.kv = None
    tc = OmegaConf.create({"data": {"seq_len": 2048, "soft_topk": 1}, "seed": 0,
                           "train": {"batch_tokens": 4096, "autocast": False}})
    shards = make_shards(pair.target, seqs, getattr(head, "aux_layers", None), tc, None, torch.device("cpu"))
    out = {"head": str(folder), **heldout_metrics(head, [], shards, args.steps, torch.device("cpu"))}
    sim = out.get("simulated", {})
    print(f"{folder} on {args.prompt_set} x{len(seqs)}: top-1 per step {out['top1_agreement_per_step']}\n"
          f"  simulated chain: acceptance per position {sim.get('acceptance_rate_per_position')}, "
          f"AL by depth {sim.get('chain_acceptance_length')}", flush=True)
    rows = [("draft=none", none)]
    for shape in args.shapes:
        k, s, n = shape.split("/")
        rows.append((f"eagle {shape}", decode(args, with_head, ["draft=eagle", "workload.batch_size=1",
                                                                f"draft.topk={k}", f"draft.num_steps={s}",
                                                                f"draft.num_draft_tokens={n}"], folder)["metrics"]))
    base = none["tokens_per_s"]
    print("| decode (batch 1, static) topk/steps/tokens | AL | tok/s | vs none |\n|---|---:|---:|---:|")
    for name, m in rows:
        print(f"| {name} | {m['accept_length_mean'] or 1.0:.2f} | {m['tokens_per_s']:.1f} | "
              f"{m['tokens_per_s'] / base:.2f}x |", flush=True)
    out["decode"] = {name: {"accept_length_mean": m["accept_length_mean"], "tokens_per_s": m["tokens_per_s"],
                            "acceptance_rate_per_position": m["acceptance_rate_per_position"]} for name, m in rows}
    return out

if __name__ == "__main__":
    main()
