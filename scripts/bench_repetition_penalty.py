"""What the repetition penalty costs the verify step, against the argmax it precedes and a vocabulary mask.

Times `SamplingState.penalize_tree` (the context kept as padded ids, penalized by gather/scatter in place,
B x N x (C + N) entries) on random verify logits [B, N, V], next to `logits.argmax(-1)` (what greedy
verification does with them anyway) and to the straightforward alternative a first version used: a [B, V]
seen-mask plus a [B, N, V] path mask and two passes over [B, N, V]. With --workload-context longer than
--context (one long request elsewhere in the workload sizes the context buffer), also times the step without
`SamplingState.limit`, reading every buffer column, against the step limited to the batch's longest context
(what the pipeline does). Prints ms per call and ratios within the same run; sanity checks assert all versions
give the same logits.

    python scripts/bench_repetition_penalty.py
    python scripts/bench_repetition_penalty.py --vocab 152064 --batch 8 --nodes 12 --context 2048
    python scripts/bench_repetition_penalty.py --context 2048 --workload-context 32768
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from specpipe.decode.sampling import SamplingState  # noqa: E402


def mask_penalty(logits, seen, tokens, mask, penalty):
    """The vocabulary-mask version: seen [B, V] | the tokens on each node's path, then where() over [B, N, V]."""
    B, N = tokens.shape
    on_path = torch.zeros_like(logits).scatter_add_(2, tokens[:, None, :].expand(B, N, N), mask.to(logits.dtype))
    hit = seen[:, None, :] | (on_path > 0)
    p = penalty.view(B, 1, 1).to(logits.dtype)
    return torch.where(hit, torch.where(logits > 0, logits / p, logits * p), logits)


def time_call(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t) / repeats * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--nodes", type=int, default=12, help="verify tree nodes per request")
    ap.add_argument("--context", type=int, default=2048, help="prompt + output tokens per request")
    ap.add_argument("--workload-context", type=int, default=0,
                    help="the workload's longest request (sizes the context buffer); default: --context")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    B, N, V, C = a.batch, a.nodes, a.vocab, a.context
    W = max(a.workload_context, C + 64)
    state = SamplingState(0.0, 1.0, 0, "cpu", repetition_penalty=1.1, max_context=W)
    contexts = [torch.randint(0, V, (C,), generator=g).tolist() for _ in range(B)]
    state.join(list(range(B)), None, contexts)
    state.limit(C + 1)  # as the pipeline does each step: the batch's longest context, plus one
    seen = torch.zeros(B, V, dtype=torch.bool)
    for b, ids in enumerate(contexts):
        seen[b, ids] = True
    logits = torch.randn(B, N, V, generator=g)
    tokens = torch.randint(0, V, (B, N), generator=g)
    mask = torch.tril(torch.ones(N, N, dtype=torch.bool)).expand(B, N, N)  # a chain: every earlier node

    want = mask_penalty(logits, seen, tokens, mask, state.penalty)
    assert torch.equal(state.penalize_tree(logits.clone(), tokens, mask), want), "the two versions disagree"

    work = logits.clone()  # penalize_tree works in place on the step's fresh logits
    gather = time_call(lambda: state.penalize_tree(work, tokens, mask), a.repeats)
    masked = time_call(lambda: mask_penalty(logits, seen, tokens, mask, state.penalty), a.repeats)
    argmax = time_call(lambda: logits.argmax(-1), a.repeats)
    print(f"B={B} N={N} V={V} context={C} threads={a.threads}")
    print(f"penalize_tree (gather/scatter, in place): {gather:8.2f} ms  {gather / argmax:5.2f}x argmax")
    print(f"vocabulary mask, two passes over [B,N,V]: {masked:8.2f} ms  {masked / argmax:5.2f}x argmax, "
          f"{masked / gather:.1f}x penalize_tree")
    print(f"argmax over the same logits (reference):  {argmax:8.2f} ms")
    if W > C + 64:
        state.width = None  # every column of the workload-sized buffer (padding repeats a context id)
        assert torch.equal(state.penalize_tree(logits.clone(), tokens, mask), want), "unlimited disagrees"
        full = time_call(lambda: state.penalize_tree(work, tokens, mask), a.repeats)
        print(f"penalize_tree over all {W} buffer columns: {full:8.2f} ms  {full / gather:5.1f}x limited to the batch")


if __name__ == "__main__":
    main()
