"""specpipe vs Hugging Face transformers: the same target, the same prompts, greedy, one process.

Loads the shipped byte-level target (specpipe/assets/tiny/target, bf16 on disk, run in float32) in
HF transformers (LlamaForCausalLM.from_pretrained) and in specpipe, and decodes the held-out prompts
with every method below. tokens/s = generated tokens (each prompt's output up to and including EOS,
at most --max-new) / wall seconds around the whole call (HF: the generate() loop over the prompts,
input tensors included; specpipe: run.run() with the pair already loaded and the config composed before the
clock starts, as a SpecPipe(...) object composes it once and each generate() call reuses it; prompt loading,
tokenizing, validation and KV setup included).

    HF      greedy generate                      batch 1 and batch B (left padding, static batch)
    HF      prompt lookup (prompt_lookup_num_tokens = each --ngram-steps value: 4 and 10)
    HF      assisted generation, draft = the target truncated to its first --draft-layers layers
            (saved as an HF folder in a temp dir); HF's defaults, and a constant 4-token schedule
    HF      assistant_early_exit = --draft-layers (the same self-speculative draft, weights shared)
    specpipe draft=none, draft=ngram (chains of each --ngram-steps value, and the default trie),
            draft=suffix (n-gram over the request's context and a cache of earlier requests' outputs),
            draft=eagle (--eagle-configs),
            draft=standalone (draft.path = the same truncated folder)     batch 1 and batch B
    specpipe the draft=none, n-gram trie, suffix and EAGLE rows again with the model forwards compiled
            (compile.verify.target_forward and compile.prefill.target_forward; n-gram, suffix and EAGLE also
            compile.verify.round; EAGLE also compile.draft_forward.* and compile.draft_loop.steps: what
            compile=rounds_cpp sets, each 'compile(cpp_wrapper=true)'; --eager-only leaves them out). They
            compile in the warm-up round, so the timed rounds exclude compile time.

HF assisted generation (prompt lookup and draft models alike) is batch-1 only; the script calls it at
batch B anyway and reports what HF does. Every output is compared, per prompt and up to EOS, with HF
greedy batch 1; each mismatch is printed with the target's top-1/top-2 logit gap at the first differing
position (a gap near 0 is an fp32 argmax tie between two numerically different paths, not a bug).

    python scripts/bench_vs_hf.py                              # shipped pair, 1 thread (~8 min on 2 cores)
    python scripts/bench_vs_hf.py --threads 2                  # as in docs/bench/ (the latest in docs/performance.md)
    python scripts/bench_vs_hf.py --random                     # a random model of the same shape
    python scripts/bench_vs_hf.py --model-dir ~/.cache/specpipe/SmolLM2-135M-Instruct-float32 --prompts 4 \
        --max-new 32 --repeats 1 --eager-only --ngram-steps 4 --only "HF greedy" "prompt lookup" \
        "specpipe draft=none" "specpipe draft=ngram"          # a real HF folder, a few rows

--model-dir may also be one Hugging Face model folder (a real checkpoint; --head DIR adds an EAGLE head for it, e.g. one
`python -m specpipe.train` wrote, and its draft=eagle rows): both engines then get the
same token ids from the folder's own tokenizer, a chat set (--prompt-set chat or code, the default where the folder
has a chat template) rendered with its chat template as transformers' apply_chat_template renders it, and the script
stops before timing anything if specpipe's prompt ids differ from those. EOS is every id that ends a specpipe request.

On a shared machine, watch the "load" column of the round lines: with --threads 2, another busy process
slows HF's many small ops far more than its share (an aborted run saw HF batch-1 rows 3-10x slower).
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# the byte-level pair: ids 0..255 are UTF-8 bytes, 256 BOS (used as pad here), 257 EOS; a real folder's own are set
# by `prompt_ids` (pad: its pad token, else its first EOS; stops: every id that ends a specpipe request)
TOKENS = {"pad": 256, "stops": (257,)}
# the model forwards under torch.compile (inductor, dynamic shapes): compiled once per loaded model in the warm-up
# round, reused by every later run on it; the rest of the pipeline as in the eager rows
COMPILED = "compiled forwards"
# inductor's C++ wrapper around each graph's kernels: the same kernels and outputs as the Python wrapper, 1.07x the
# tokens/s for a compiled EAGLE run on the shipped pair (scripts/bench_compile_overhead.py)
POLICY = "'compile(cpp_wrapper=true)'"
TARGET_COMPILED = [f"compile.verify.target_forward={POLICY}", f"compile.prefill.target_forward={POLICY}"]
SPEC_COMPILED = [f"compile.verify.round={POLICY}"]  # a speculative round's verify in one call (draft=none has none)
DRAFT_COMPILED = [f"compile.draft_forward.decode={POLICY}", f"compile.draft_forward.extend={POLICY}",
                  f"compile.draft_loop.steps={POLICY}"]
DEFAULT_EAGLE = ["draft.topk=1 draft.num_steps=4", "draft.topk=4 draft.num_steps=5 draft.num_draft_tokens=12"]


# ---------------------------------------------------------------------------------------- models

def save_random(folder: Path, layers: int) -> Path:
    """A random model with the shipped pair's shape (target + EAGLE head), for runs without trained weights."""
    from specpipe.models.hf.save import save_eagle, save_target
    from specpipe.models.random_tiny import build_random_tiny

    pair = build_random_tiny(hidden_size=256, num_layers=layers, num_heads=4, num_kv_heads=2, intermediate_size=704,
                             max_position=512)
    save_target(pair.target, pair.tokenizer, folder / "target", dtype="bfloat16")
    save_eagle(pair.draft, folder / "eagle", dtype="bfloat16")
    return folder


def save_truncated(target_dir: Path, out: Path, layers: int) -> Path:
    """The target's first `layers` decoder layers + final norm + lm_head, as an HF folder (same bytes on disk)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    raw = json.loads((target_dir / "config.json").read_text())
    if layers >= raw["num_hidden_layers"]:
        raise SystemExit(f"--draft-layers {layers} must be below the target's {raw['num_hidden_layers']} layers")
    raw["num_hidden_layers"] = layers
    if isinstance(raw.get("layer_types"), list):
        raw["layer_types"] = raw["layer_types"][:layers]
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    keep = {}
    with safe_open(str(target_dir / "model.safetensors"), framework="pt") as f:
        for k in f.keys():
            if k.startswith("model.layers."):
                if int(k.split(".")[2]) >= layers:
                    continue
            keep[k] = f.get_tensor(k).contiguous()
    save_file(keep, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


class ForwardCounter:
    """Counts full target forwards (hook on the last decoder layer: an early-exit draft never reaches it)."""

    def __init__(self, model):
        self.n = 0
        model.model.layers[-1].register_forward_hook(self._hook)

    def _hook(self, *_):
        self.n += 1


# ---------------------------------------------------------------------------------------- prompts

def prompt_ids(tokenizer, target_dir: Path, items: list[dict], prompt_set: str):
    """Each prompt's ids as HF gets them, and how a mismatch line shows a token id; sets TOKENS (pad, stops).

    The byte-level pair: the raw UTF-8 bytes with no BOS (what specpipe's byte tokenizer gives). A folder with a
    tokenizer.json: transformers' own tokenizer of the folder, so the reference does not lean on specpipe's
    tokenizer or template code (`check_same_ids` then holds specpipe to these ids): a chat through
    apply_chat_template(add_generation_prompt=True), a plain prompt through tokenizer(prompt)."""
    from specpipe.workload.tokenizer import ByteTokenizer, stop_token_ids

    bad = next((it["error"] for it in items if "error" in it), None)
    if bad:
        raise SystemExit(f"--prompt-set {prompt_set}: {bad}")
    stops = stop_token_ids(tokenizer)
    TOKENS["stops"] = tuple(stops) if isinstance(stops, (list, tuple)) else (stops,)
    if isinstance(tokenizer, ByteTokenizer):
        if any("messages" in it for it in items):
            raise SystemExit(f"--prompt-set {prompt_set} holds chats, and {target_dir} has a byte-level tokenizer "
                             f"with no chat template: use --prompt-set heldout, or --model-dir with a folder that "
                             f"has a chat template")
        TOKENS["pad"] = 256
        return [list(it["prompt"].encode("utf-8")) for it in items], (lambda t: t)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    TOKENS["pad"] = tok.pad_token_id if tok.pad_token_id is not None else TOKENS["stops"][0]
    ids = [list(tok.apply_chat_template(it["messages"], add_generation_prompt=True, tokenize=True, return_dict=False))
           if "messages" in it else list(tok(it["prompt"])["input_ids"]) for it in items]
    return ids, (lambda t: f"{t} {tok.decode([t])!r}")


def check_same_ids(pair, base: list[str], prompts: list[list[int]], show) -> None:
    """Stops the benchmark unless specpipe, run on the same set, tokenizes every prompt to HF's ids: outputs of
    different inputs would compare as garbage mismatches. One prefill per prompt, one new token."""
    from specpipe.run import run

    res = run(compose_once(base + [f"workload.num_prompts={len(prompts)}", "workload.max_new_tokens=1",
                                   "draft=none"]), quiet=True, pair=pair)
    for i, (r, want) in enumerate(zip(res["requests"], prompts)):
        if r.error:
            raise SystemExit(f"specpipe cannot run prompt {i}: {r.error}")
        if list(r.prompt_ids) != want:
            same = min(len(want), len(r.prompt_ids))
            at = next((j for j, (x, y) in enumerate(zip(r.prompt_ids, want)) if x != y), same)
            raise SystemExit(f"prompt {i}: specpipe's ids differ from HF's at position {at} (of {len(want)} HF, "
                             f"{len(r.prompt_ids)} specpipe ids): HF {[show(t) for t in want[at:at + 3]]}, specpipe "
                             f"{[show(t) for t in r.prompt_ids[at:at + 3]]}")


# ---------------------------------------------------------------------------------------- HF side

def hf_config(max_new: int, **extra):
    from transformers import GenerationConfig

    # everything explicit: no sampling, no length/repetition processors, no model-folder defaults
    stops = TOKENS["stops"]
    return GenerationConfig(do_sample=False, max_new_tokens=max_new, min_new_tokens=None, min_length=0,
                            temperature=None, top_p=None, top_k=None, repetition_penalty=None,
                            no_repeat_ngram_size=None, num_beams=1, pad_token_id=TOKENS["pad"],
                            eos_token_id=stops[0] if len(stops) == 1 else list(stops),
                            bos_token_id=None, use_cache=True, **extra)


def cut(ids: list, max_new: int) -> list:
    """The output up to and including the first EOS, at most max_new tokens."""
    ids = ids[:max_new]
    end = next((i for i, t in enumerate(ids) if t in TOKENS["stops"]), None)
    return ids if end is None else ids[:end + 1]


def hf_generate(model, prompts: list[list[int]], batch: int, max_new: int, gen: dict) -> list[list[int]]:
    """Greedy outputs per prompt; batches are left-padded with the pad id and masked."""
    outs = []
    for s in range(0, len(prompts), batch):
        chunk = prompts[s:s + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[TOKENS["pad"]] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        kwargs = dict(gen)
        cfg = hf_config(max_new, **kwargs.pop("config", {}))
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg, **kwargs)
        outs += [cut(row[width:].tolist(), max_new) for row in out]
    return outs


# ---------------------------------------------------------------------------------------- specpipe side

_COMPOSED: dict = {}


def compose_once(overrides: list[str]):
    from specpipe.config.compose import compose_config

    key = tuple(overrides)
    if key not in _COMPOSED:
        _COMPOSED[key] = compose_config(overrides)
    return _COMPOSED[key]


def sp_generate(pair, overrides: list[str]) -> tuple[list[list[int]], dict]:
    """One specpipe call on a config composed once per override list (Hydra's compose takes ~0.1-0.2 s: a
    SpecPipe(...) object pays it in its constructor, not in each generate()), so the clock sees what a
    generate() call runs."""
    from specpipe.run import run

    res = run(compose_once(overrides), quiet=True, pair=pair)
    m = res["metrics"]
    if m["num_errors"]:
        errs = [r.error for r in res["requests"] if r.error]
        raise RuntimeError(f"specpipe {' '.join(overrides)}: {m['num_errors']} request errors, e.g. {errs[0]}")
    return [list(r.output_ids) for r in res["requests"]], m


def breakdown(m: dict, outer_wall: float) -> dict:
    """Where a specpipe run's time went: per decode step (draft model, target verify/decode forward, host
    work: proposer, tree, bookkeeping), prefill in total, and run() setup outside the decode loop."""
    steps = max(1, m["num_verify_steps"])
    stage, model = m["stage_ms"], m["stage_model_ms"]
    decode = {k: v for k, v in stage.items() if k != "prefill"}
    draft = sum(model.get(k, 0.0) for k in ("draft", "draft_extend"))
    target = sum(v for k, v in model.items() if k not in ("prefill", "draft", "draft_extend"))
    step_total = sum(decode.values())
    return {"steps": steps, "ms_per_step": 1000 * (m["wall_s"] - stage.get("prefill", 0.0) * steps / 1000) / steps,
            "staged_ms_per_step": step_total, "draft_ms": draft, "target_ms": target,
            "host_ms": step_total - draft - target, "prefill_s": stage.get("prefill", 0.0) * steps / 1000,
            "loop_s": m["wall_s"], "setup_s": outer_wall - m["wall_s"], "layout": m.get("weight_layout", {})}


# ---------------------------------------------------------------------------------------- the benchmark

class Method:
    def __init__(self, name: str, batch: int, fn, kind: str, baseline: str = "", al_from_forwards: bool = False):
        self.name, self.batch, self.fn, self.kind, self.baseline = name, batch, fn, kind, baseline
        self.al_from_forwards = al_from_forwards
        self.best = None  # (tokens/s, tokens, wall, al)
        self.detail = None  # breakdown of the best run
        self.outputs = None
        self.error = None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=str(ROOT / "specpipe" / "assets" / "tiny"),
                    help="folder with target/ (and eagle/) HF folders, or one HF model folder (a real checkpoint)")
    ap.add_argument("--random", action="store_true", help="use a random model of the shipped shape (saved to a temp "
                                                          "folder) instead of --model-dir")
    ap.add_argument("--head", default=None, help="an EAGLE head folder for a one-folder --model-dir (draft.path)")
    ap.add_argument("--prompts", type=int, default=16, help="prompts of --prompt-set (the first N)")
    ap.add_argument("--prompt-set", choices=["heldout", "chat", "code"], default=None,
                    help="specpipe's built-in set (workload.prompt_set); default: chat for a folder with a chat "
                         "template, else heldout")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="the batched size (batch 1 is always run)")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds over all methods; each keeps its best")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--draft-layers", type=int, default=2, help="layers of the truncated self-speculative draft")
    ap.add_argument("--eagle-configs", nargs="+", default=DEFAULT_EAGLE)
    ap.add_argument("--ngram-steps", type=int, nargs="+", default=[4, 10],
                    help="draft lengths for both specpipe draft=ngram (num_steps) and HF prompt_lookup_num_tokens")
    ap.add_argument("--standalone-steps", type=int, default=4, help="specpipe draft=standalone num_steps")
    ap.add_argument("--eager-only", action="store_true",
                    help="leave out the rows with compiled model forwards "
                         "(their warm-up compiles for a minute or more)")
    ap.add_argument("--skip", nargs="*", default=[], help="method names containing any of these are skipped")
    ap.add_argument("--only", nargs="*", default=[], help="only method names containing one of these run (HF greedy "
                                                          "batch 1, the reference, always runs)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import transformers
    from transformers import AutoModelForCausalLM, LlamaForCausalLM
    transformers.logging.set_verbosity_error()

    from specpipe.models.hf.load import load_hf
    from specpipe.workload.prompts import load_prompts
    from specpipe.workload.tokenizer import ByteTokenizer

    tmp = Path(tempfile.mkdtemp(prefix="bench_vs_hf_"))
    atexit.register(shutil.rmtree, tmp, True)  # the truncated draft (and --random model) folders
    model_dir = Path(args.model_dir).expanduser()
    one_folder = not args.random and (model_dir / "config.json").is_file()  # a real checkpoint: no target/, no head
    note = f"{model_dir.name} (HF folder)" if one_folder else "shipped trained pair"
    if not one_folder and (args.random or not (model_dir / "target" / "model.safetensors").is_file()):
        if not args.random:
            print(f"!! {model_dir / 'target' / 'model.safetensors'} not found: using a RANDOM model of the same shape")
        layers = json.loads((model_dir / "target" / "config.json").read_text())["num_hidden_layers"] \
            if (model_dir / "target" / "config.json").is_file() else 10
        model_dir = save_random(tmp / "random", layers)
        note = "RANDOM model (untrained) of the shipped shape"
    target_dir, eagle_dir = (model_dir, None) if one_folder else (model_dir / "target", model_dir / "eagle")
    if args.head:
        eagle_dir = Path(args.head).expanduser()
        note += f" + EAGLE head {eagle_dir.name}"
    draft_dir = save_truncated(target_dir, tmp / f"draft_{args.draft_layers}l", args.draft_layers)

    pair = load_hf(target_dir, eagle_dir if eagle_dir and (eagle_dir / "config.json").is_file() else None,
                   dtype="float32", name="bench")
    prompt_set = args.prompt_set or ("chat" if getattr(pair.tokenizer, "chat_template", None) else "heldout")
    items = load_prompts(None, prompt_set, args.prompts)
    prompts, show = prompt_ids(pair.tokenizer, target_dir, items, prompt_set)
    N, M, B = len(prompts), args.max_new, args.batch
    base = ["model=hf", f"model.path={target_dir}", f"workload.prompt_set={prompt_set}"]
    check_same_ids(pair, base, prompts, show)

    hf_class = AutoModelForCausalLM if one_folder else LlamaForCausalLM
    hf = hf_class.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    hf_draft = AutoModelForCausalLM.from_pretrained(str(draft_dir), dtype=torch.float32).eval()
    counter = ForwardCounter(hf)
    try:
        import subprocess
        rev = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True,
                             text=True).stdout.strip() or "?"
    except OSError:
        rev = "?"
    cfgm = json.loads((target_dir / "config.json").read_text())
    nparams = sum(p.numel() for p in hf.parameters())
    print(f"{datetime.now():%Y-%m-%d %H:%M} | {platform.machine()}, {os.cpu_count()} CPU(s), load average "
          f"{os.getloadavg()[0]:.2f}, {torch.get_num_threads()} torch thread(s), torch "
          f"{torch.__version__}, transformers {transformers.__version__} | model: {note}: {cfgm['num_hidden_layers']} "
          f"layers, hidden {cfgm['hidden_size']}, {nparams / 1e6:.1f}M params, fp32 | draft model: first "
          f"{args.draft_layers} layer(s) | {N} {'held-out' if prompt_set == 'heldout' else repr(prompt_set)} "
          f"prompts ({min(map(len, prompts))}-{max(map(len, prompts))} "
          f"{'bytes' if isinstance(pair.tokenizer, ByteTokenizer) else 'tokens'}), max_new_tokens={M}, best of "
          f"{args.repeats} | specpipe git {rev}", flush=True)

    def hf_fn(batch, gen):
        def f(n_prompts=N, max_new=M):
            return hf_generate(hf, prompts[:n_prompts], batch, max_new, gen), None, None
        return f

    def sp_fn(batch, overrides):
        def args_for(n_prompts, max_new):
            return base + [f"workload.num_prompts={n_prompts}", f"workload.max_new_tokens={max_new}",
                           f"workload.batch_size={batch}", *overrides]

        def f(n_prompts=N, max_new=M):
            outs, m = sp_generate(pair, args_for(n_prompts, max_new))
            return outs, m["accept_length_mean"], m
        f.compose = lambda: compose_once(args_for(N, M))  # the timed rounds' config, composed in the warm-up
        return f

    pld_steps = sorted(set(args.ngram_steps))
    methods = [Method("HF greedy", 1, hf_fn(1, {}), "hf_greedy")]
    methods += [Method(f"HF prompt lookup ({k} tok)", 1, hf_fn(1, {"config": {"prompt_lookup_num_tokens": k}}),
                       "hf_pld", al_from_forwards=True) for k in pld_steps]
    methods += [
        Method("HF assisted, draft model (HF defaults: 20 tok, conf. 0.4)", 1,
               hf_fn(1, {"assistant_model": hf_draft}), "hf_assisted", al_from_forwards=True),
        Method("HF assisted, draft model (4 tok constant)", 1,
               hf_fn(1, {"assistant_model": hf_draft, "config": {"num_assistant_tokens": 4,
                                                                  "num_assistant_tokens_schedule": "constant",
                                                                  "assistant_confidence_threshold": 0.0}}),
               "hf_assisted", al_from_forwards=True),
        Method(f"HF assistant_early_exit={args.draft_layers}", 1,
               hf_fn(1, {"config": {"assistant_early_exit": args.draft_layers}}), "hf_assisted",
               al_from_forwards=True),
    ]
    for b in dict.fromkeys((1, B)):  # (batch 1 once when --batch 1)
        if b != 1:
            methods.append(Method("HF greedy", b, hf_fn(b, {}), "hf_greedy"))
        methods.append(Method("specpipe draft=none", b, sp_fn(b, ["draft=none"]), "sp"))
        methods += [Method(f"specpipe draft=ngram (chain, num_steps={k})", b,
                           sp_fn(b, ["draft=ngram", "draft.topk=1", f"draft.num_steps={k}"]), "sp", "hf_pld")
                    for k in pld_steps]
        methods.append(Method("specpipe draft=ngram (default trie: topk=4 steps=8 ntok=12)", b,
                              sp_fn(b, ["draft=ngram"]), "sp", "hf_pld"))
        methods.append(Method("specpipe draft=suffix (own context + other running requests "
                              "+ cache of earlier outputs)", b,
                              sp_fn(b, ["draft=suffix"]), "sp", "hf_pld"))
        # the same modes with the model forwards under torch.compile (compiled in warm-up) after the eager ones
        for tag, compiled in [("", [])] + ([] if args.eager_only else [(f", {COMPILED}", TARGET_COMPILED)]):
            if compiled:
                methods.append(Method(f"specpipe draft=none{tag}", b, sp_fn(b, ["draft=none", *compiled]), "sp"))
                methods.append(Method(f"specpipe draft=ngram (default trie){tag}", b,
                                      sp_fn(b, ["draft=ngram", *compiled, *SPEC_COMPILED]), "sp", "hf_pld"))
                methods.append(Method(f"specpipe draft=suffix{tag}", b,
                                      sp_fn(b, ["draft=suffix", *compiled, *SPEC_COMPILED]), "sp", "hf_pld"))
            for c in args.eagle_configs if pair.draft is not None else ():
                short = c.replace("draft.", "").replace("num_draft_tokens", "ntok").replace("num_steps", "steps")
                methods.append(Method(f"specpipe draft=eagle ({short}){tag}", b,
                                      sp_fn(b, ["draft=eagle", *c.split(), *compiled,
                                                *((SPEC_COMPILED + DRAFT_COMPILED) if compiled else [])]), "sp",
                                      "hf_draft_assisted"))
    for b in dict.fromkeys((1, B)):  # last: run() keeps the standalone model on the pair once loaded
        methods.append(Method(f"specpipe draft=standalone (num_steps={args.standalone_steps})", b,
                              sp_fn(b, ["draft=standalone", f"draft.path={draft_dir}",
                                        f"draft.num_steps={args.standalone_steps}"]), "sp", "hf_draft_assisted"))
    methods = [m for m in methods if not any(s in m.name for s in args.skip) and (
        not args.only or any(s in m.name for s in args.only) or (m.kind == "hf_greedy" and m.batch == 1))]

    # HF assisted generation at batch > 1: try it (B prompts, 4 tokens) and report what happens
    hf_batched = {}
    probe = B > 1 and any(m.kind in ("hf_pld", "hf_assisted") for m in methods)  # (not when --only drops them)
    for name, gen in (("prompt lookup", {"config": {"prompt_lookup_num_tokens": 10}}),
                      ("draft model", {"assistant_model": hf_draft})) if probe else ():
        try:
            hf_generate(hf, prompts[:B], B, 4, gen)
            hf_batched[name] = "ran"
        except Exception as e:  # noqa: BLE001 - reported, not hidden
            hf_batched[name] = f"{type(e).__name__}: {e}"
        print(f"HF assisted generation ({name}) at batch {B}: {hf_batched[name]}", flush=True)

    # warm-up (first calls allocate, build caches, import lazily), then timed rounds
    for m in methods:
        try:
            m.fn(min(N, m.batch), 16)
            getattr(m.fn, "compose", lambda: None)()
        except Exception as e:  # noqa: BLE001
            m.error = f"{type(e).__name__}: {e}"
            print(f"!! {m.name} (batch {m.batch}) failed: {m.error}", flush=True)
    t_start = time.perf_counter()
    for rnd in range(args.repeats):
        for m in methods:
            if m.error:
                continue
            f0 = counter.n
            t0 = time.perf_counter()
            outs, al, sm = m.fn()
            wall = time.perf_counter() - t0
            toks = sum(len(o) for o in outs)
            forwards = counter.n - f0
            if m.al_from_forwards:  # tokens per full target forward (HF: each forward verifies a draft)
                al = toks / max(1, forwards)
            if m.outputs is not None and outs != m.outputs:
                print(f"!! {m.name} (batch {m.batch}): outputs differ between repeats", flush=True)
            m.outputs = outs
            if m.best is None or toks / wall > m.best[0]:
                m.best = (toks / wall, toks, wall, al)
                m.detail = breakdown(sm, wall) if sm else {"forwards": forwards, "ms_per_step": 1000 * wall / forwards}
            extra = f"; run_requests loop alone: {sm['tokens_per_s']:.1f} tok/s" if sm else ""
            print(f"  round {rnd + 1}: {m.name:<60} b{m.batch}  {toks / wall:8.1f} tok/s  ({toks} tok, {wall:.2f} s"
                  f"{extra}) load {os.getloadavg()[0]:.2f}", flush=True)
    print(f"timed rounds: {time.perf_counter() - t_start:.0f} s; load average now {os.getloadavg()[0]:.2f}", flush=True)

    # ---- correctness: every method vs HF greedy batch 1, per prompt, up to EOS
    ref = next(m for m in methods if m.kind == "hf_greedy" and m.batch == 1).outputs
    mismatches = []
    for m in methods:
        if m.outputs is None:
            continue
        for i, (a, b) in enumerate(zip(ref, m.outputs)):
            if a != b:
                p = next((j for j in range(min(len(a), len(b))) if a[j] != b[j]), min(len(a), len(b)))
                mismatches.append((m, i, p, a, b))
    compared = sum(len(m.outputs) for m in methods if m.outputs is not None)
    print(f"\nGREEDY OUTPUT CHECK: {len(mismatches)} mismatching outputs out of {compared} (method x prompt) "
          f"compared with HF greedy batch 1, token for token up to EOS (max {M})")
    for m, i, p, a, b in mismatches:
        with torch.no_grad():
            logits = hf(torch.tensor([prompts[i] + a[:p]])).logits[0, -1]
        top = torch.topk(logits, 2)
        got = show(b[p]) if p < len(b) else "end"
        want = show(a[p]) if p < len(a) else "end"
        print(f"  {m.name} (batch {m.batch}) prompt {i}: first difference at output token {p}: HF greedy {want}, "
              f"this {got}; HF fp32 logits there: top1-top2 gap {float(top.values[0] - top.values[1]):.2e} "
              f"(top-2 ids {[show(t) for t in top.indices.tolist()]})")

    # ---- the table
    def best_of(kind, batch=1):
        ms = [m for m in methods if m.kind in kind and m.batch == batch and m.best]
        return max(ms, key=lambda m: m.best[0]) if ms else None

    greedy = {m.batch: m for m in methods if m.kind == "hf_greedy" and m.best}
    refs = {"hf_pld": ("HF prompt lookup (best)", ("hf_pld",)),
            "hf_best_assisted": ("HF fastest speculative mode (prompt lookup incl.)", ("hf_pld", "hf_assisted")),
            "hf_draft_assisted": ("HF assisted w/ draft model (best)", ("hf_assisted",)),
            "HF greedy": ("HF greedy", ("hf_greedy",))}
    mism = {}
    for m, *_ in mismatches:
        mism[id(m)] = mism.get(id(m), 0) + 1
    header = ("| method | batch | tokens/s | vs HF greedy (same batch) | vs HF baseline | accept len | "
              "greedy mismatches | specpipe decode loop only, tokens/s |")
    lines = [header, "|---|---:|---:|---:|---|---:|---:|---:|"]
    for m in methods:
        if m.error or not m.best:
            lines.append(f"| {m.name} | {m.batch} | failed: {m.error} | | | | | |")
            continue
        tps, toks, wall, al = m.best
        g = greedy.get(m.batch)
        vs_g = f"{tps / g.best[0]:.2f}x" if g else "n/a"
        vs_b = ""
        if m.baseline:
            label, kinds = refs[m.baseline]
            r = best_of(kinds, m.batch)
            if r is not None:
                vs_b = f"{tps / r.best[0]:.2f}x {label}"
            else:
                r1 = best_of(kinds, 1)
                vs_b = (f"n/a: HF has none at batch {m.batch}" +
                        (f" ({tps / r1.best[0]:.2f}x its batch-1 speed)" if r1 else ""))
        al_s = f"{al:.2f}" if al is not None else ""
        loop = f"{toks / m.detail['loop_s']:.1f}" if m.detail and "loop_s" in m.detail else ""
        lines.append(f"| {m.name} | {m.batch} | {tps:.1f} | {vs_g} | {vs_b} | {al_s} | {mism.get(id(m), 0)}/{N} | "
                     f"{loop} |")
    print()
    print("\n".join(lines))
    print("\nWhere the time goes (best run of each). HF: wall / full target forwards (prefill, drafting and "
          "generate() overhead included). specpipe: per decode step = one target forward over the batch; draft = "
          "draft-model forwards (EAGLE head / standalone model), target = target forwards, host = the rest of the "
          "staged step (proposer, tree building, bookkeeping); prefill and run() setup "
          "(validation, prompts, KV pool allocation, "
          "summary) in seconds.")
    print("| method | batch | target forwards / steps | ms per forward / step | draft ms | target ms | host ms | "
          "prefill s | run() setup s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for m in methods:
        d = m.detail
        if not d:
            continue
        if "forwards" in d:
            print(f"| {m.name} | {m.batch} | {d['forwards']} | {d['ms_per_step']:.2f} | | | | | |")
        else:
            print(f"| {m.name} | {m.batch} | {d['steps']} | {d['ms_per_step']:.2f} | {d['draft_ms']:.2f} | "
                  f"{d['target_ms']:.2f} | {d['host_ms']:.2f} | {d['prefill_s']:.2f} | {d['setup_s']:.2f} |")
    print("\naccept len: specpipe = mean tokens committed per verify step (metrics accept_length_mean); HF = generated "
          "tokens / full target forwards (prefill included, hook on the last layer)")
    for name, what in hf_batched.items():
        print(f"HF assisted generation ({name}) at batch {B}: {what}")
    for m in methods:  # specpipe's Linear weight storage (device.weight_layout=auto), as chosen for each method
        if m.detail and "layout" in m.detail:
            print(f"specpipe weight layout, {m.name} b{m.batch}: " + ", ".join(
                f"{k.split()[0]} {v['layout']}" for k, v in m.detail["layout"].items()))

    # ---- the targets
    def ratio(a, b):
        return a.best[0] / b.best[0] if a and b and a.best and b.best else None

    sp_none1 = next((m for m in methods if m.name == "specpipe draft=none" and m.batch == 1 and m.best), None)
    sp_none8 = next((m for m in methods if m.name == "specpipe draft=none" and m.batch == B and m.best), None)
    spc = {b: next((m for m in methods if m.name == f"specpipe draft=none, {COMPILED}" and m.batch == b and m.best),
                   None) for b in (1, B)}
    ng1 = max((m for m in methods if "ngram" in m.name and m.batch == 1 and m.best), key=lambda m: m.best[0],
              default=None)
    sfx1 = max((m for m in methods if "draft=suffix" in m.name and m.batch == 1 and m.best), key=lambda m: m.best[0],
               default=None)
    eag1 = max((m for m in methods if "eagle" in m.name and m.batch == 1 and m.best), key=lambda m: m.best[0],
               default=None)
    eag8 = max((m for m in methods if "eagle" in m.name and m.batch == B and m.best), key=lambda m: m.best[0],
               default=None)
    checks = [
        ("specpipe draft=none >= HF greedy (batch 1)", ratio(sp_none1, greedy.get(1)), 1.0, sp_none1),
        (f"specpipe draft=none >= HF greedy (batch {B})", ratio(sp_none8, greedy.get(B)), 1.0, sp_none8),
        *((f"specpipe draft=none, {COMPILED} >= HF greedy (batch {b})", ratio(spc[b], greedy.get(b)), 1.0, spc[b])
          for b in (1, B) if spc[b] is not None),
        ("specpipe n-gram, own context only (what HF sees) >= 1.5x HF prompt lookup (batch 1)",
         ratio(ng1, best_of(("hf_pld",))), 1.5, ng1),
        ("specpipe n-gram with the cross-request cache (draft=suffix) >= 1.5x HF prompt lookup (batch 1)",
         ratio(sfx1, best_of(("hf_pld",))), 1.5, sfx1),
        ("specpipe EAGLE >= 2x HF best assisted generation with a draft model (batch 1)",
         ratio(eag1, best_of(("hf_assisted",))), 2.0, eag1),
        ("specpipe EAGLE >= 2x HF's fastest speculative mode, prompt lookup included (batch 1)",
         ratio(eag1, best_of(("hf_pld", "hf_assisted"))), 2.0, eag1),
    ]
    print("\nTargets:")
    for name, r, need, by in checks:
        print(f"  {name}: " + ("n/a" if r is None else f"{r:.2f}x -> {'MET' if r >= need else 'MISSED'} ({by.name})"))
    if eag8:
        print(f"  batch {B} speculative decoding: specpipe EAGLE {eag8.best[0]:.1f} tok/s "
              f"({ratio(eag8, greedy.get(B)):.2f}x HF greedy batch {B}); HF assisted generation at batch {B}: "
              f"{hf_batched.get('draft model')}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "rows": [{"method": m.name, "batch": m.batch, "tokens_per_s": m.best and m.best[0],
                      "tokens": m.best and m.best[1], "wall_s": m.best and m.best[2],
                      "accept_len": m.best and m.best[3], "error": m.error,
                      "mismatches": mism.get(id(m), 0), "detail": m.detail} for m in methods],
            "hf_batched": hf_batched, "mismatches": len(mismatches), "note": note}, indent=2))


if __name__ == "__main__":
    main()
