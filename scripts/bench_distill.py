"""specpipe.train's self-distillation decode (`train/data.py`'s `generate`, as `distill` calls it: half greedy,
half sampled, `data.distill_batch` at a time) with the target's weights in each layout: the same requests each
time, generated tokens per second, layouts interleaved, in one process.

`distill` decodes oneDNN-packed weights (`decode_plain`) and `prepare_data` lays them out row-major again for the
features. This measures what that buys against the row-major layout it used before.

    python scripts/bench_distill.py --model-dir ~/.cache/specpipe/SmolLM2-135M-Instruct-float32
    python scripts/bench_distill.py --model-dir DIR --layouts row packed column --requests 32 --repeats 1
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", required=True, help="the target's HF folder")
    ap.add_argument("--layouts", nargs="+", default=["row", "packed"])
    ap.add_argument("--requests", type=int, default=64, help="distillation requests (the corpus's first)")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each layout, interleaved")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import specpipe.train.data as data
    from specpipe.devices.weight_layout import unpack_weights
    from specpipe.models.hf.load import load_hf
    from specpipe.train.__main__ import compose_train

    pair = load_hf(args.model_dir)
    cfg = compose_train(["model=hf", f"model.path={args.model_dir}", "out=unused",
                         f"device.num_threads={args.threads}", "data.max_chars=200000"])
    _, _, asks = data.corpus(cfg, pair.tokenizer)
    chat = data.uses_chat(cfg, pair.tokenizer)
    decode_config = data.decode_config
    rates: dict = {layout: [] for layout in args.layouts}
    for _ in range(args.repeats):
        for layout in args.layouts:
            data.decode_config = lambda c, o, v=None, chosen=layout, **_: decode_config(c, o, v, layout=chosen)
            t0 = time.perf_counter()
            d = cfg.data
            seqs = data.generate(cfg, pair, asks[:args.requests], chat, d.distill_new_tokens, d.distill_batch,
                                 d.distill_temperature, cfg.seed)
            took = time.perf_counter() - t0
            data.decode_config = decode_config
            unpack_weights([pair.target])
            generated = sum(len(s.ids) - s.score_from for s in seqs)
            rates[layout].append(generated / took)
            print(f"{layout}: {len(seqs)} continuations, {generated} generated tokens in {took:.0f} s = "
                  f"{generated / took:.0f} tok/s", flush=True)
    base = max(rates[args.layouts[0]])
    for layout, r in rates.items():
        print(f"{layout}: best {max(r):.0f} generated tok/s, {max(r) / base:.2f}x {args.layouts[0]}")


if __name__ == "__main__":
    main()
