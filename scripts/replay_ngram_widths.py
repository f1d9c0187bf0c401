"""How wide should an n-gram draft tree be on this machine? Replays trees offline on the target's own outputs.

Greedy verification is lossless, so the target's greedy continuation of each prompt is known in advance:
decode the held-out prompts once with draft=none, then replay draft=ngram round by round without the
target. Each round builds the trie of `width` nodes from the history so far, accepts its longest path
that matches the true continuation, and commits that plus the bonus token. The cost of a round is the
target's forward over `width` tokens, measured here on a warm KV pool, plus --host-ms of host work.
Printed per width: verify rounds, tokens per round, forward ms, and tokens per ms as a ratio against
--baseline-width in the same run. Also printed: the acceptance rate of the trie's nodes by rank, at the
widest width.

    python scripts/replay_ngram_widths.py                        # shipped pair, 16 prompts x 64 tokens
    python scripts/replay_ngram_widths.py --prompts 32 --max-new 128 --num-steps 15 --max-n 5
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def forward_ms(target, width: int, context: int, repeats: int) -> float:
    """Best-of ms of one target forward over `width` new tokens after `context` cached ones."""
    from specpipe.models.attention_batch import AttentionBatch

    L, Q = context, width
    pos = torch.arange(L, L + Q)[None]
    kv = torch.arange(L + Q)[None] + 1
    batch = AttentionBatch(pos, torch.arange(1, Q + 1)[None] + L, kv, torch.ones(1, Q, L + Q, dtype=torch.bool),
                           torch.arange(L + Q)[None])
    ids = torch.randint(0, 200, (1, Q))
    with torch.no_grad():
        for _ in range(3):
            target.logits(target(ids, batch))
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            for _ in range(10):
                target.logits(target(ids, batch))
            best = min(best, (time.perf_counter() - t) / 10)
    return best * 1e3


def replay(data, drafter, width: int):
    """(rounds, tokens, per-rank [accepted, offered]) for trees of `width` nodes."""
    rounds = tokens = 0
    ranks = [[0, 0] for _ in range(width)]
    for prompt, out in data:
        i = 0
        while i < len(out) - 1:
            hist = prompt + out[: i + 1]
            ctx, lens = torch.tensor([hist]), torch.tensor([len(hist)])
            tree = drafter.propose(ctx, lens, lens - 1)
            tok, par = tree.tokens[0].tolist(), tree.parent[0].tolist()
            cur, a, path = 0, 0, set()
            future = out[i + 1:]
            while a < len(future):
                nxt = next((j for j in range(1, width) if par[j] == cur and tok[j] == future[a]), None)
                if nxt is None:
                    break
                cur, a = nxt, a + 1
                path.add(nxt)
            for j in range(1, width):
                if par[j] >= 0:
                    ranks[j][0] += j in path
                    ranks[j][1] += 1
            commit = min(a + 1, len(out) - 1 - i)
            i += commit
            rounds += 1
            tokens += commit
    return rounds, tokens, ranks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--widths", type=int, nargs="+", default=[4, 8, 12, 16])
    ap.add_argument("--baseline-width", type=int, default=12, help="draft=ngram's default")
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--num-steps", type=int, default=8)
    ap.add_argument("--min-n", type=int, default=1)
    ap.add_argument("--max-n", type=int, default=3)
    ap.add_argument("--host-ms", type=float, default=2.2, help="host work per round (bench_vs_hf.py measures it)")
    ap.add_argument("--context", type=int, default=300, help="cached tokens for the forward timing")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from specpipe.run import run
    from specpipe.config.compose import compose_config
    from specpipe.drafters import NgramDrafter
    from specpipe.models.hf.load import load_hf

    target_dir = ROOT / "specpipe" / "assets" / "tiny" / "target"
    pair = load_hf(target_dir, None, dtype="float32", name="replay")
    res = run(compose_config(["model=hf", f"model.path={target_dir}", "workload.prompt_set=heldout",
                              f"workload.num_prompts={args.prompts}", f"workload.max_new_tokens={args.max_new}",
                              "workload.batch_size=1", "draft=none", "device.weight_layout=row"]),
              quiet=True, pair=pair)
    data = [(list(r.prompt_ids), list(r.output_ids)) for r in res["requests"]]
    pair.target.setup_kv(args.context + max(args.widths) + 8)
    widths = sorted(set(args.widths) | {args.baseline_width})
    print(f"torch {torch.__version__}, {args.threads} thread(s); {len(data)} held-out prompts, "
          f"{sum(len(o) for _, o in data)} target tokens; trie topk={args.topk} num_steps={args.num_steps} "
          f"n in [{args.min_n}, {args.max_n}]; host {args.host_ms} ms per round; forwards after {args.context} "
          f"cached tokens, row-major weights\n")
    rows, ranks = {}, None
    for w in widths:
        drafter = NgramDrafter(args.num_steps, args.topk, w, args.min_n, args.max_n)
        rounds, tokens, rk = replay(data, drafter, w)
        ms = forward_ms(pair.target, w, args.context, args.repeats)
        rows[w] = (rounds, tokens / rounds, ms, tokens / (rounds * (ms + args.host_ms)))
        ranks = rk
    base = rows[args.baseline_width][3]
    print("| width | rounds | tokens per round | forward ms | tokens per ms | vs width "
          f"{args.baseline_width} |\n|---:|---:|---:|---:|---:|---:|")
    for w, (rounds, al, ms, rate) in rows.items():
        print(f"| {w} | {rounds} | {al:.2f} | {ms:.2f} | {rate:.4f} | {rate / base:.3f}x |")
    print(f"\nacceptance by node rank (width {widths[-1]}): " + ", ".join(
        f"{j}: {a / n:.2f}" for j, (a, n) in enumerate(ranks) if j and n))


if __name__ == "__main__":
    main()
