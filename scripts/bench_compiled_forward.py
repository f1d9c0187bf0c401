"""A torch.compile'd target forward (compile.verify.target_forward=compile) vs eager, and what the KV
pool's layout does to it.

The pool gives every layer its own K/V tensors. The old layout held one stacked [layers, slots, ...]
tensor and handed each layer a view of it; a compiled forward that writes into views of one graph input
is functionalized into copies of the whole stacked pool, per layer and per call. This script builds both
layouts around the shipped target (weights fused as run() does) and times, per case (batch x 12 verify
tokens over --context cached tokens), best of --repeats x 20 calls: eager, compiled over per-layer
tensors (today's pool) and compiled over views of one stacked tensor (the old pool). Compiled with
inductor, dynamic=True; compile time is reported apart and not in the per-call times.

    python scripts/bench_compiled_forward.py
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts.bench_fused_projections import make_batch as strided_batch  # noqa: E402


def make_batch(B: int, Q: int, L: int):
    """`bench_fused_projections.make_batch` with every tensor contiguous, as the pipeline's batches are."""
    b = strided_batch(B, Q, L)
    return dataclasses.replace(b, **{f: getattr(b, f).clone(memory_format=torch.contiguous_format)
                                     for f in ("positions", "out_slots", "kv_slots", "mask", "kv_positions")})


def stacked_views(pool) -> None:
    """The old layout: `layer(i)` indexes one stacked tensor, so the compiled graph's input is the stack."""
    from specpipe.models.attention import KVPool

    class StackedKVPool(KVPool):
        def layer(self, i: int):
            return self.k[i], self.v[i]

    pool.k, pool.v = torch.stack(pool.keys), torch.stack(pool.values)
    pool.__class__ = StackedKVPool


def best_ms(fn, repeats: int, calls: int = 20) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls)
    return 1e3 * best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=256, help="cached tokens per request")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from specpipe.models.hf.load import load_tiny
    from specpipe.models.llama import fuse_projections

    cases = [(1, 12), (4, 12), (8, 12)]  # (batch, query tokens): a 12-node verify tree per request
    slots = max(B * (args.context + Q) for B, Q in cases) + 1
    models = {}
    for name in ("per-layer", "stacked"):
        m = load_tiny().target
        fuse_projections([m])
        m.setup_kv(slots)
        if name == "stacked":
            stacked_views(m.kv)
        models[name] = m

    from specpipe.config.compile_policy import parse_policy
    from specpipe.devices.cpu import CpuDevice
    from specpipe.stages.verify import Verify

    def forward(m):
        return Verify(m, 1).target_forward  # the branch compile.verify.target_forward sets

    device = CpuDevice()
    torch._dynamo.config.recompile_limit = 64  # the two pools' graphs share one code object's cache
    compiled, compile_s = {}, {}
    with torch.inference_mode():
        for name, m in models.items():
            fn = device.compile(forward(m), parse_policy("compile(dynamic=true)"))  # as run() wraps the branch
            t = time.perf_counter()
            for B, Q in cases:  # one dynamic graph serves every case
                fn(torch.randint(0, 256, (B, Q)), make_batch(B, Q, args.context))
            compile_s[name] = time.perf_counter() - t
            compiled[name] = fn
        print(f"shipped target, fused projections, {args.context} cached tokens, {torch.get_num_threads()} thread(s); "
              f"compile + first calls: per-layer {compile_s['per-layer']:.1f} s, stacked {compile_s['stacked']:.1f} s")
        print(f"{'batch x tokens':>15} {'eager ms':>9} {'compiled ms':>12} {'eager/compiled':>15} "
              f"{'old stacked ms':>15} {'stacked/per-layer':>18}")
        for B, Q in cases:
            ids, batch = torch.randint(0, 256, (B, Q)), make_batch(B, Q, args.context)
            eager = forward(models["per-layer"])

            def fresh():  # every forward of the pipeline gets a new batch: no memoised mask yet
                return dataclasses.replace(batch, _read_slots=None, _dense_mask=None)

            e = best_ms(lambda: eager(ids, fresh()), args.repeats)
            c = best_ms(lambda: compiled["per-layer"](ids, fresh()), args.repeats)
            s = best_ms(lambda: compiled["stacked"](ids, fresh()), args.repeats)
            print(f"{f'{B} x {Q}':>15} {e:9.2f} {c:12.2f} {e / c:14.2f}x {s:15.2f} {s / c:17.2f}x")


if __name__ == "__main__":
    main()
