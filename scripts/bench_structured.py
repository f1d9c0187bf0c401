"""Structured output under speculative decoding: tokens/s and acceptance of JSON-schema decoding against free
decoding, per drafter, with the grammar drafter (jump-forward) on and off, in one process (greedy).

Eight chat prompts each ask for one small JSON object (a person, a product, an event, ...: enums, bounded integers
and strings, arrays of at most 3 items) and carry its schema as OpenAI's response_format json_schema; the free rows
run the same prompts without it. Per (model, batch): draft=none constrained without jump-forward is the baseline
(`vs base`: tokens/s over its), then none with jump-forward (forced runs verified as chains), ngram and EAGLE (where
the model has a head) with jump-forward off and on, then the free rows. Columns: tokens generated (JSON stops early
where free text runs to the limit, and tok/s counts the prefill too), tok/s, AL (metrics' accept_length_mean),
drafted/accepted tokens summed over requests, `free acc` (of those drafts, what the unmasked greedy target would
have accepted), forced and pruned tokens, the grammar stage's ms per step, and how many outputs finished with
"stop" / of those parse and validate against their schema (jsonschema). A row whose run takes under 3 s reports
the best tok/s of up to 3 runs (the counts are the same each time: greedy).

Checks, printed at the end: every constrained row's outputs equal the baseline's (greedy: must be 0 mismatches), and
every constrained output that stopped validates.

    python scripts/bench_structured.py             # shipped pair (EAGLE head) and SmolLM2-135M-Instruct, batch 1 and 8
    python scripts/bench_structured.py --quick     # fewer prompts and tokens
    python scripts/bench_structured.py --models tiny --batch 8

The shipped pair has no chat template and was trained on Python code: its prompts are the same requests written
as a code comment (`# ...\\nperson = `). The real model is SmolLM2-135M-Instruct as `make real-model` builds it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

REAL_DIR = Path(os.path.expanduser("~/.cache/specpipe/SmolLM2-135M-Instruct-float32"))
MODELS = {"tiny": (["model=tiny"], ["ngram", "eagle"]), "real": ([], ["ngram"])}  # (overrides, drafters)
DRAFT = {"none": ["draft=none"], "ngram": ["draft=ngram"], "eagle": ["draft=eagle"]}
JUMP = {False: "grammar.jump_forward=false", True: "grammar.jump_forward=true"}
REPEATS, SHORT_S = 3, 3.0  # a row whose run took under SHORT_S seconds reports the best of up to REPEATS runs


def s(max_len: int) -> dict:
    return {"type": "string", "minLength": 1, "maxLength": max_len}


def i(lo: int, hi: int) -> dict:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def arr(item: dict, lo: int = 1) -> dict:
    return {"type": "array", "items": item, "minItems": lo, "maxItems": 3}


def obj(props: dict) -> dict:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


SCHEMAS = [  # (name, what to describe, schema)
    ("person", "a fictional person", obj({"name": s(24), "age": i(0, 120),
                                          "role": {"enum": ["engineer", "teacher", "doctor", "artist"]}})),
    ("product", "a product in an online shop", obj({"name": s(30), "price_cents": i(1, 99999),
                                                     "in_stock": {"type": "boolean"}, "tags": arr(s(12), 0)})),
    ("event", "a conference talk", obj({"title": s(40), "day": {"enum": ["mon", "tue", "wed", "thu", "fri"]},
                                        "hour": i(8, 18), "speakers": arr(s(20))})),
    ("book", "a novel", obj({"title": s(40), "author": s(30), "year": i(1800, 2025),
                             "genre": {"enum": ["fantasy", "mystery", "romance", "science fiction"]}})),
    ("weather", "today's weather in a city", obj({"city": s(24), "celsius": i(-40, 50),
                                                  "sky": {"enum": ["sunny", "cloudy", "rain", "snow"]}})),
    ("order", "a customer's order", obj({"order_id": i(1, 99999), "items": arr(obj({"sku": s(10), "qty": i(1, 9)})),
                                         "status": {"enum": ["new", "paid", "shipped"]}})),
    ("recipe", "a simple recipe", obj({"dish": s(30), "minutes": i(1, 240), "ingredients": arr(s(16))})),
    ("movie", "a short movie review", obj({"movie": s(30), "stars": i(1, 5),
                                           "verdict": {"enum": ["must see", "fine", "skip it"]}, "summary": s(60)})),
]


def items(n: int, constrained: bool, chat: bool) -> list[dict]:
    """The first n prompts as prompts-file lines: a chat (the real model) or a code comment (the shipped pair)."""
    out = []
    for name, what, schema in SCHEMAS[:n]:
        ask = (f"Describe {what} as a JSON object with the fields {', '.join(schema['properties'])}. "
               f"Answer with the JSON only.")
        it = ({"messages": [{"role": "user", "content": ask}]} if chat else {"prompt": f"# {ask}\n{name} = "})
        if constrained:
            it["response_format"] = {"type": "json_schema", "json_schema": {"name": name, "schema": schema,
                                                                            "strict": True}}
        out.append(it)
    return out


def valid(text: str, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


class Block:
    """One (model, batch): runs its rows over the same loaded pair and prompts, prints each row as it ends, and
    counts the constrained outputs that differ from the baseline's and those that stopped and validate."""

    def __init__(self, label: str, base: list[str], pair, n: int, batch: int, chat: bool, tmp: Path):
        self.label, self.pair, self.batch = label, pair, batch
        self.base = base + [f"workload.batch_size={batch}"]
        self.paths = {}
        for constrained in (True, False):
            p = tmp / f"{'json' if constrained else 'free'}.jsonl"
            p.write_text("".join(json.dumps(it) + "\n" for it in items(n, constrained, chat)))
            self.paths[constrained] = p
        from specpipe.workload.tokenizer import stop_token_ids

        eos = stop_token_ids(pair.tokenizer)
        self.eos = set(eos) if isinstance(eos, (list, tuple, set)) else {eos}
        self.want = None  # the baseline's outputs
        self.base_tps = None
        self.mismatches = self.stopped = self.validated = 0

    def row(self, name: str, constrained: bool, overrides: list[str]) -> str:
        from specpipe.config.compose import compose_config
        from specpipe.run import run

        cfg = compose_config(self.base + [f"workload.prompts_file={self.paths[constrained]}"] + overrides)
        out = run(cfg, quiet=True, pair=self.pair)
        m, reqs = out["metrics"], out["requests"]
        for _ in range(REPEATS - 1):  # a short row is noisy on a shared machine: its best of a few runs
            if m["wall_s"] >= SHORT_S:
                break
            again = run(cfg, quiet=True, pair=self.pair)["metrics"]
            m = again if again["tokens_per_s"] > m["tokens_per_s"] else m
        got = [list(r.output_ids) for r in reqs]
        if self.want is None:
            self.want, self.base_tps = got, m["tokens_per_s"]
        elif constrained and got != self.want:
            bad = sum(g != w for g, w in zip(got, self.want))
            self.mismatches += bad
            print(f"  MISMATCH: {self.label} b{self.batch} {name}: {bad} of {len(got)} outputs differ from the "
                  f"baseline", flush=True)
        stopped = [r for r in reqs if r.finish_reason == "stop"]
        ok = sum(valid(self.text(r), SCHEMAS[r.index][2]) for r in stopped)
        if constrained:
            self.stopped, self.validated = self.stopped + len(stopped), self.validated + ok
            for r in reqs:
                if r.finish_reason == "error":
                    print(f"  ERROR: {self.label} b{self.batch} {name}: prompt {r.index}: {r.error}", flush=True)
        return self.line(name, m, reqs, f"{len(stopped)}/{ok}")

    def text(self, r) -> str:
        from specpipe.workload.tokenizer import output_text

        ids = [t for t in r.output_ids if t not in self.eos]
        return output_text(self.pair.tokenizer, r.prompt_ids, ids)

    def line(self, name: str, m: dict, reqs, stop_valid: str) -> str:
        def total(key: str) -> str:
            return str(sum(getattr(r, key) for r in reqs))

        tps, al, gms = m["tokens_per_s"], m["accept_length_mean"], (m.get("stage_ms") or {}).get("grammar")
        spec = al is not None
        cells = [self.label, str(self.batch), name, str(m["generated_tokens"]), f"{tps:.1f}",
                 f"{al:.2f}" if spec else "", f"{tps / self.base_tps:.2f}x", total("num_draft_tokens") if spec else "",
                 total("num_accepted_tokens") if spec else "",
                 total("unconstrained_accepted_tokens") if spec and "json" in name else "",
                 total("grammar_forced_tokens") if "json" in name else "",
                 total("grammar_pruned_tokens") if "json" in name else "",
                 f"{gms:.3f}" if gms is not None else "", stop_valid]
        return "| " + " | ".join(cells) + " |"


def rows(drafters: list[str]) -> list[tuple[str, bool, list[str]]]:
    """(name, constrained, overrides): the baseline first."""
    out = [("json none", True, DRAFT["none"] + [JUMP[False]]), ("json none +jump", True, DRAFT["none"] + [JUMP[True]])]
    for d in drafters:
        out += [(f"json {d}", True, DRAFT[d] + [JUMP[False]]), (f"json {d} +jump", True, DRAFT[d] + [JUMP[True]])]
    out += [(f"free {d}", False, DRAFT[d]) for d in ["none", *drafters]]
    return out


HEAD = ["| model | batch | row | tokens | tok/s | AL | vs base | drafted | accepted | free acc | forced | pruned | "
        "grammar ms/step | stop/valid |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["tiny", "real"], choices=sorted(MODELS))
    ap.add_argument("--real-dir", default=str(REAL_DIR))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompts", type=int, default=None, help="prompts per block (default 8, --quick 3)")
    ap.add_argument("--max-new", type=int, default=None, help="new tokens (default 96, --quick 48)")
    ap.add_argument("--quick", action="store_true", help="3 prompts, 48 new tokens")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    n = args.prompts or (3 if args.quick else len(SCHEMAS))
    max_new = args.max_new or (48 if args.quick else 96)
    torch.set_num_threads(args.threads)

    from specpipe.config.compose import compose_config
    from specpipe.devices.cpu import CpuDevice
    from specpipe.models.cache import load_pair

    print(f"# bench_structured {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"{platform.processor() or platform.machine()}, {args.threads} thread(s), torch {torch.__version__}, "
          f"{n} prompts, {max_new} new tokens, greedy\n", flush=True)
    print("\n".join(HEAD), flush=True)
    blocks = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            overrides, drafters = MODELS[model]
            if model == "real":
                if not Path(args.real_dir, "config.json").is_file():
                    print(f"skipping the real model: no {args.real_dir} (make real-model builds it)", flush=True)
                    continue
                overrides = ["model=hf", f"model.path={args.real_dir}"]
            base = overrides + [f"workload.max_new_tokens={max_new}", f"device.num_threads={args.threads}"]
            cfg0 = compose_config(base)
            pair = load_pair(cfg0, cfg0.device.dtype, CpuDevice(cfg0.device.dtype))
            for b in args.batch:
                blk = Block(model, base, pair, n, b, chat=model == "real", tmp=Path(tmp))
                for name, constrained, ov in rows(drafters):
                    print(blk.row(name, constrained, ov), flush=True)
                blocks.append(blk)
    print(f"\nconstrained outputs that differ from the baseline's: {sum(b.mismatches for b in blocks)}; constrained "
          f"outputs that stopped: {sum(b.stopped for b in blocks)}, of which valid against their schema: "
          f"{sum(b.validated for b in blocks)}", flush=True)


if __name__ == "__main__":
    main()
