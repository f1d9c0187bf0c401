"""What a compiled branch pays per call around its kernels, under three settings:

    floats as inputs      the model's floats (RMSNorm eps, RoPE scale) as Dynamo leaves them: a fresh 0-d tensor
                          input per call, some re-checked by Python guards
    floats as constants   specpipe's default (devices/base.py SPECIALIZE_FLOATS), inductor's Python wrapper
    + cpp_wrapper         the same with every branch compiled `compile(cpp_wrapper=true)`: the graph's wrapper
                          (buffer views, size checks, kernel calls) in C++

Runs a compiled EAGLE chain on the shipped pair (`compile=rounds`: model forwards, draft loop, verify round and
prefill compiled) in one subprocess per setting (Dynamo and inductor read them when they trace), alternating
--repeats times. Each prints the best tokens/s of two timed runs and ms per round, and, from a profiled run, µs
per compiled call in Dynamo's cache lookup (guards) and in the bytecode before the graph (argument set-up).
Tokens/s are printed as ratios against the first setting measured in the same invocation, and every setting's
outputs are compared with the first's (the same kernels: identical).

    python scripts/bench_compile_overhead.py [--steps 6] [--prompts 16] [--repeats 2]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BRANCHES = ["verify.target_forward", "prefill.target_forward", "verify.round", "draft_forward.decode",
            "draft_forward.extend", "draft_loop.steps"]
SETTINGS = {"floats as inputs (Dynamo's default)": (False, False), "floats as constants (specpipe)": (True, False),
            "floats as constants + cpp_wrapper": (True, True)}


def child(specialize: bool, cpp_wrapper: bool, steps: int, prompts: int, max_new: int, threads: int) -> dict:
    import torch
    from torch.profiler import profile

    import specpipe.devices.base as device_base
    from specpipe.run import run
    from specpipe.config.compose import compose_config
    from specpipe.models.hf.load import load_hf

    torch.set_num_threads(threads)
    device_base.SPECIALIZE_FLOATS = specialize
    policy = "'compile(cpp_wrapper=true)'" if cpp_wrapper else "compile"
    compiled = [f"compile.{b}={policy}" for b in BRANCHES]
    tiny = ROOT / "specpipe" / "assets" / "tiny"
    pair = load_hf(tiny / "target", tiny / "eagle", dtype="float32", name="bench")
    cfg = compose_config(["model=hf", f"model.path={tiny / 'target'}", "workload.prompt_set=heldout",
                          f"workload.num_prompts={prompts}", f"workload.max_new_tokens={max_new}",
                          "workload.batch_size=1", "draft=eagle", "draft.topk=1", f"draft.num_steps={steps}",
                          f"draft.num_draft_tokens={steps + 1}", *compiled])
    run(cfg, quiet=True, pair=pair)  # compiles
    best, outputs, round_ms = 0.0, None, 0.0
    for _ in range(2):
        t0 = time.perf_counter()
        res = run(cfg, quiet=True, pair=pair)
        wall = time.perf_counter() - t0
        outputs = [list(r.output_ids) for r in res["requests"]]
        if sum(map(len, outputs)) / wall > best:
            best = sum(map(len, outputs)) / wall
            m = res["metrics"]
            round_ms = sum(v for k, v in m["stage_ms"].items() if k != "prefill")
    with profile() as prof:
        run(cfg, quiet=True, pair=pair)
    ev = {e.key: e for e in prof.key_averages()}

    def per_call(key: str) -> float:
        e = ev.get(key)
        return e.self_cpu_time_total / e.count if e is not None and e.count else 0.0

    return {"tok_s": best, "round_ms": round_ms, "lookup_us": per_call("TorchDynamo Cache Lookup"),
            "pregraph_us": per_call("Pregraph bytecode"), "outputs": outputs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6, help="draft.num_steps of the topk=1 chain")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2, help="subprocesses per setting, alternating")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--child", choices=["00", "10", "11"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child[0] == "1", args.child[1] == "1", args.steps, args.prompts, args.max_new,
                               args.threads)))
        return
    results: dict = {name: [] for name in SETTINGS}
    for r in range(args.repeats):
        for name, (spec, cpp) in SETTINGS.items():
            cmd = [sys.executable, __file__, "--child", f"{int(spec)}{int(cpp)}", "--steps", str(args.steps),
                   "--prompts", str(args.prompts), "--max-new", str(args.max_new), "--threads", str(args.threads)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            res = json.loads(out)
            results[name].append(res)
            print(f"  round {r + 1}: {name:<38} {res['tok_s']:7.1f} tok/s, {res['round_ms']:.2f} ms/round, "
                  f"cache lookup {res['lookup_us']:6.1f} "
                  f"µs/call, pre-graph bytecode {res['pregraph_us']:6.1f} µs/call", flush=True)
    base_name = next(iter(SETTINGS))
    base = max(r["tok_s"] for r in results[base_name])
    ref = results[base_name][0]["outputs"]
    print(f"\n| setting | best tok/s | vs {base_name} | ms per round | cache lookup µs/call | pre-graph µs/call "
          f"| outputs |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for name, rs in results.items():
        best = max(r["tok_s"] for r in rs)
        same = all(r["outputs"] == ref for r in rs)
        print(f"| {name} | {best:.1f} | {best / base:.2f}x | {min(r['round_ms'] for r in rs):.2f} | "
              f"{min(r['lookup_us'] for r in rs):.0f} | "
              f"{min(r['pregraph_us'] for r in rs):.0f} | {'identical' if same else 'DIFFER'} |")


if __name__ == "__main__":
    main()
