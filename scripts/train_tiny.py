#!/usr/bin/env python
"""Train the shipped tiny pair: a byte-level Llama-family target and its EAGLE-1 draft head.

Corpus: the local interpreter's standard library ``.py`` sources (test, tests, idlelib, lib2to3 and
site-packages folders left out), each file as its UTF-8 bytes + EOS (257), optionally after a BOS (256).
Files go to the held-out split by a hash of their path relative to the stdlib folder, so the split is
deterministic for a given Python version.

1. Target: causal LM on random windows of the training stream; bf16 autocast on CPU with fp32 master
   weights, AdamW, cosine LR with warmup, gradient clipping, a wall-clock budget. The first part of the
   budget uses short windows (attention is the costly part on CPU), the rest full-length windows.
2. The target is rounded to bf16 (what ships) and frozen; the EAGLE-1 head (fc over [embed(x), h] ->
   one decoder layer without input norm; the target's embedding and lm_head are shared and frozen) is
   trained on the target's final-norm hidden states. Draft position p takes (token x_{p+1}, h_p) and
   predicts h_{p+1} (smooth-L1) and, through lm_head, the target's distribution over x_{p+2}
   (soft cross-entropy, weight --ce-weight). Uniform noise is added to the input features as in EAGLE.
3. Held-out evaluation: target bits/byte; the head's teacher-forced top-1 agreement with the target;
   greedy chain acceptance (accepted drafts + 1 bonus per verify step) simulated on target-greedy
   continuations of held-out prompts.

Writes OUT/target/{config.json,model.safetensors} (HF Llama layout), OUT/eagle/{config.json,
model.safetensors} (EAGLE layout: fc.weight, fc.bias, layers.0.*) in bf16, and OUT/train_report.json.

    python scripts/train_tiny.py --out specpipe/assets/tiny --target-minutes 40 --head-minutes 12
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specpipe.models.attention_batch import extend_batch  # noqa: E402
from specpipe.models.eagle import EagleHead  # noqa: E402
from specpipe.models.llama import LlamaConfig, LlamaForCausalLM  # noqa: E402
# the corpus split and the LR schedule are shared with `python -m specpipe.train` (make_heldout_prompts.py imports
# stdlib_files and is_heldout from here)
from specpipe.train.corpus import EXCLUDED_DIRS, is_heldout, stdlib_files  # noqa: E402,F401
from specpipe.train.loop import lr_at  # noqa: E402

BOS, EOS, VOCAB = 256, 257, 258
console = Console(highlight=False, markup=False)


# ----------------------------------------------------------------------------------------- corpus

def build_corpus(heldout_mod: int, bos: bool):
    root, files = stdlib_files()
    streams = {"train": [], "heldout": []}
    names = {"train": [], "heldout": []}
    for path in files:
        rel = path.relative_to(root).as_posix()
        data = path.read_bytes()
        if not data.strip():
            continue
        ids = np.frombuffer(data, dtype=np.uint8).astype(np.int16)
        parts = ([np.array([BOS], np.int16)] if bos else []) + [ids, np.array([EOS], np.int16)]
        split = "heldout" if is_heldout(rel, heldout_mod) else "train"
        streams[split].append(np.concatenate(parts))
        names[split].append(rel)
    out = {k: torch.from_numpy(np.concatenate(v).astype(np.int64)) for k, v in streams.items()}
    return root, out, names


def heldout_docs(root: Path, names: list[str]) -> list[bytes]:
    return [(root / n).read_bytes() for n in names]


# ----------------------------------------------------------------------------------------- models

def make_config(a) -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB, hidden_size=a.hidden, num_hidden_layers=a.layers,
                       num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                       intermediate_size=a.intermediate, head_dim=a.hidden // a.heads,
                       rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=a.seq_len,
                       tie_word_embeddings=False, bos_token_id=BOS, eos_token_id=EOS)


def init_weights(module: torch.nn.Module, num_layers: int, gen: torch.Generator) -> None:
    """GPT-2 style: N(0, 0.02), residual output projections scaled by 1/sqrt(2L), norms at 1, biases 0."""
    for name, p in module.named_parameters():
        with torch.no_grad():
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                std = 0.02 / math.sqrt(2 * num_layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def round_to_bf16_(module: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.to(torch.bfloat16).float())


def llama_json(cfg: LlamaConfig, arch: str, num_layers: int, extra: dict) -> dict:
    d = {
        "architectures": [arch], "model_type": "llama", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": num_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
        "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": None, "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "torch_dtype": "bfloat16",
        "specpipe_tokenizer": {"type": "byte", "vocab_size": VOCAB, "bos_token_id": BOS, "eos_token_id": EOS},
    }
    d.update(extra)
    return d


def bf16_state(sd: dict, prefix_of) -> dict:
    return {prefix_of(k): v.detach().to(torch.bfloat16).contiguous() for k, v in sd.items()}


def save_target(model: LlamaForCausalLM, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    sd = {k: v for k, v in model.state_dict().items()
          if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    tensors = bf16_state(sd, lambda k: k if k.startswith("lm_head.") else "model." + k)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(
        llama_json(cfg, "LlamaForCausalLM", cfg.num_hidden_layers, {}), indent=2) + "\n")


def load_target(folder: Path, cfg: LlamaConfig) -> LlamaForCausalLM:
    model = LlamaForCausalLM(cfg)
    sd = {(k[len("model."):] if k.startswith("model.") else k): v.float()
          for k, v in load_file(str(folder / "model.safetensors")).items()}
    model.load_state_dict(sd, strict=True)
    return model


def save_eagle(head: EagleHead, cfg: LlamaConfig, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tensors = bf16_state(head.state_dict(), lambda k: k)
    assert not any(k.startswith(("embed_tokens", "lm_head")) or "input_layernorm" in k for k in tensors), tensors
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    extra = {"specpipe_eagle": {"version": 1, "fc_bias": True, "first_layer_input_norm": False,
                                "shares": ["embed_tokens", "lm_head"]}}
    (folder / "config.json").write_text(json.dumps(llama_json(cfg, "LlamaForCausalLMEagle", 1, extra), indent=2) + "\n")


# -------------------------------------------------------------------------------------- training

def sample_batch(stream: torch.Tensor, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - length - 1, (batch,), generator=gen)
    return stream[starts[:, None] + torch.arange(length + 1)[None]]  # [B, T+1]


def make_optimizer(module: torch.nn.Module, lr: float, wd: float) -> torch.optim.AdamW:
    decay = [p for n, p in module.named_parameters() if p.requires_grad and p.dim() >= 2 and "embed" not in n]
    other = [p for n, p in module.named_parameters() if p.requires_grad and not (p.dim() >= 2 and "embed" not in n)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": wd}, {"params": other, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8)


def progress_bar() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"),
                    TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=False)


def timed_loop(name: str, budget_s: float, step_fn, log_every_s: float = 60.0) -> dict:
    """Run step_fn(progress) until the wall-clock budget is spent; returns stats."""
    t0 = time.perf_counter()
    steps, tokens, ema, last_log = 0, 0, None, t0
    with progress_bar() as bar:
        task = bar.add_task(name, total=budget_s, info="")
        while True:
            elapsed = time.perf_counter() - t0
            if elapsed >= budget_s:
                break
            loss, ntok, info = step_fn(elapsed / budget_s)
            steps += 1
            tokens += ntok
            ema = loss if ema is None else 0.98 * ema + 0.02 * loss
            now = time.perf_counter()
            rate = tokens / (now - t0)
            text = f"step {steps} loss {ema:.4f} {info} {rate / 1e3:.1f}k tok/s"
            bar.update(task, completed=min(budget_s, now - t0), info=text)
            if not console.is_terminal and now - last_log >= log_every_s:
                console.print(f"[{name}] {(now - t0) / 60:5.1f} min  {text}")
                last_log = now
    wall = time.perf_counter() - t0
    console.print(f"[{name}] done: {steps} steps, {tokens / 1e6:.2f}M tokens, {wall / 60:.1f} min, loss(ema) {ema:.4f}")
    return {"steps": steps, "tokens": tokens, "minutes": round(wall / 60, 2), "final_loss_ema": round(float(ema), 4)}


def train_target(model: LlamaForCausalLM, train: torch.Tensor, a, gen: torch.Generator) -> dict:
    opt = make_optimizer(model, a.lr, a.weight_decay)
    model.train()

    def step(progress: float):
        short = progress < a.short_frac
        T = a.short_seq_len if short else a.seq_len
        B = max(1, a.batch_tokens // T)
        lr = lr_at(progress, a.lr, a.warmup, a.lr_floor)
        for g in opt.param_groups:
            g["lr"] = lr
        x = sample_batch(train, B, T, gen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model.logits(model(x[:, :-1]))
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item(), B * T, f"T{T} lr {lr:.2e}"

    stats = timed_loop("target", a.target_minutes * 60, step)
    model.eval()
    return stats


def head_inputs(target: LlamaForCausalLM, x: torch.Tensor, autocast: bool):
    """x [B, T] -> (ids, hidden, next hidden, next logits) for the T-1 head positions.

    Head position p (0..T-2) reads token x_{p+1} and target hidden h_p; it must predict h_{p+1} and the
    target's distribution for x_{p+2}, which are logits(h_{p+1}).
    """
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        h = target(x)
        logits = target.logits(h)
    h, logits = h.float(), logits.float()
    return x[:, 1:], h[:, :-1], h[:, 1:], logits[:, 1:]


def train_head(head: EagleHead, target: LlamaForCausalLM, train: torch.Tensor, a, gen: torch.Generator) -> dict:
    opt = make_optimizer(head, a.head_lr, 0.0)
    head.train()

    def step(progress: float):
        lr = lr_at(progress, a.head_lr, a.warmup, a.lr_floor)
        for g in opt.param_groups:
            g["lr"] = lr
        T = a.seq_len
        x = sample_batch(train, max(1, a.batch_tokens // T), T, gen)[:, :-1]
        ids, h_in, h_next, logits_next = head_inputs(target, x, autocast=True)
        scale = h_in.std()
        noise = (torch.rand(h_in.shape, generator=gen) - 0.5) * (a.noise * scale)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            d = head(ids, h_in + noise)
            draft_logits = head.logits(d)
        d = d.float()
        vloss = F.smooth_l1_loss(d, h_next)
        p = F.softmax(logits_next, -1)
        ploss = -(p * F.log_softmax(draft_logits.float(), -1)).sum(-1).mean()
        loss = vloss + a.ce_weight * ploss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), a.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            acc = (draft_logits.argmax(-1) == logits_next.argmax(-1)).float().mean().item()
        return loss.item(), ids.numel(), f"v {vloss.item():.4f} ce {ploss.item():.3f} top1 {acc:.3f} lr {lr:.2e}"

    stats = timed_loop("eagle", a.head_minutes * 60, step)
    head.eval()
    return stats


# ------------------------------------------------------------------------------------ evaluation

def windows(stream: torch.Tensor, T: int, batch: int = 8) -> list[torch.Tensor]:
    """Non-overlapping [b, T+1] windows (consecutive windows share one boundary token), in batches."""
    n = (stream.numel() - 1) // T
    w = torch.stack([stream[i * T: i * T + T + 1] for i in range(n)])
    return list(w.split(batch))


@torch.no_grad()
def eval_target(model: LlamaForCausalLM, heldout: torch.Tensor, T: int) -> dict:
    """Bits per byte over non-overlapping T-token windows (fp32), BOS targets left out."""
    total, count = 0.0, 0
    for x in windows(heldout, T):
        logits = model.logits(model(x[:, :-1])).float()
        y = x[:, 1:]
        nll = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), reduction="none")
        keep = y.reshape(-1) != BOS
        total += nll[keep].sum().item()
        count += int(keep.sum())
    return {"heldout_bits_per_byte": round(total / count / math.log(2), 4), "heldout_tokens": count}


@torch.no_grad()
def eval_head(head: EagleHead, target: LlamaForCausalLM, heldout: torch.Tensor, T: int) -> dict:
    """Teacher-forced top-1 agreement of the head's draft token with the target's greedy token (fp32)."""
    agree = agree_data = target_data = n = m = 0
    for w in windows(heldout, T):
        x = w[:, :-1]
        ids, h_in, _, logits_next = head_inputs(target, x, autocast=False)
        draft = head.logits(head(ids, h_in)).argmax(-1)
        tgt = logits_next.argmax(-1)
        true_next = x[:, 2:]
        agree += (draft == tgt).sum().item()
        agree_data += (draft[:, :-1] == true_next).sum().item()
        target_data += (tgt[:, :-1] == true_next).sum().item()
        n += tgt.numel()
        m += true_next.numel()
    return {"head_top1_agreement": round(agree / n, 4), "head_top1_vs_data": round(agree_data / m, 4),
            "target_top1_vs_data": round(target_data / m, 4), "positions": n}


class _Slots:
    """A one-request KV layout for the model's pool attention: position p lives in slot p + 1."""

    def __init__(self, module, num_positions: int):
        module.setup_kv(num_positions + 1, torch.float32)
        self.module = module
        self.table = torch.arange(1, num_positions + 1)[None]
        self.rows = torch.zeros(1, dtype=torch.long)

    def batch(self, start: int, q: int):
        return extend_batch(self.table, self.rows, torch.tensor([start]), torch.tensor([q]), q, start + q)


@torch.no_grad()
def greedy_generate(model: LlamaForCausalLM, prompt: list[int], n: int) -> list[int]:
    """Plain greedy decoding with the model's KV pool (prefill, then one token per forward)."""
    slots = _Slots(model, len(prompt) + n + 1)
    h = model(torch.tensor([prompt]), slots.batch(0, len(prompt)))[:, -1:]
    out, pos = [], len(prompt)
    for _ in range(n):
        nxt = int(model.logits(h).argmax(-1))
        out.append(nxt)
        if nxt == EOS:
            break
        h = model(torch.tensor([[nxt]]), slots.batch(pos, 1))
        pos += 1
    model.kv = None
    return out


@torch.no_grad()
def chain_acceptance(head: EagleHead, H: torch.Tensor, full: list[int], P: int, k: int) -> tuple[int, int]:
    """Simulate greedy chain EAGLE decoding with k draft steps over a known target-greedy continuation.

    ``full`` = prompt (P tokens) + the target's greedy tokens, ``H`` [N, D] the target's hiddens over it.
    Prefill emits full[P]; each round extends the head's KV with true (x_{p+1}, h_p) inputs up to the
    position before the last emitted token, drafts k tokens (later steps read the head's own hidden),
    and the target accepts the longest matching prefix plus one bonus token.
    Returns (tokens emitted by verify steps, verify steps).
    """
    N = len(full)
    slots = _Slots(head, N + k + 1)
    cached = 0  # head positions [0, cached) hold true inputs
    n = P + 1  # committed tokens
    emitted = rounds = 0
    while n < N:
        d = head(torch.tensor([full[cached + 1: n]]), H[cached: n - 1][None],
                 slots.batch(cached, n - 1 - cached))[:, -1:]
        cached = n - 1
        drafts, pos = [], n - 1
        for i in range(k):
            tok = int(head.logits(d).argmax(-1))
            drafts.append(tok)
            if i < k - 1:
                d = head(torch.tensor([[tok]]), d, slots.batch(pos, 1))
                pos += 1
        a = 0
        while a < k and n + a < N and drafts[a] == full[n + a]:
            a += 1
        step = min(a + 1, N - n)
        emitted += step
        rounds += 1
        n += step
    head.kv = None
    return emitted, rounds


def eval_acceptance(head, target, docs: list[bytes], prompts: int, prompt_len: int, gen_len: int,
                    steps: list[int], gen: torch.Generator) -> dict:
    cands = [d for d in docs if len(d) >= prompt_len + 16]
    perm = torch.randperm(len(cands), generator=gen).tolist()
    res = {k: [0, 0] for k in steps}
    for j in range(prompts):
        doc = cands[perm[j % len(perm)]]
        off = int(torch.randint(0, len(doc) - prompt_len, (1,), generator=gen))
        prompt = list(doc[off: off + prompt_len])
        full = prompt + greedy_generate(target, prompt, gen_len)
        with torch.no_grad():
            H = target(torch.tensor([full]))[0]  # causal: equal to the incremental hiddens
        for k in steps:
            e, r = chain_acceptance(head, H, full, len(prompt), k)
            res[k][0] += e
            res[k][1] += r
    return {"chain_acceptance_length": {str(k): round(e / max(1, r), 3) for k, (e, r) in res.items()},
            "acceptance_prompts": prompts, "acceptance_prompt_len": prompt_len, "acceptance_gen_len": gen_len}


# ------------------------------------------------------------------------------------------- main

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="specpipe/assets/tiny", help="output folder (target/, eagle/, train_report.json)")
    p.add_argument("--target-minutes", type=float, default=40.0, help="wall-clock budget of target training; 0 "
                   "reuses OUT/target")
    p.add_argument("--head-minutes", type=float, default=12.0, help="wall-clock budget of EAGLE head training")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=704)
    p.add_argument("--seq-len", type=int, default=512, help="training context (also max_position_embeddings)")
    p.add_argument("--short-seq-len", type=int, default=256, help="window length for the first --short-frac")
    p.add_argument("--short-frac", type=float, default=0.5, help="fraction of target time on short windows")
    p.add_argument("--batch-tokens", type=int, default=4096, help="tokens per optimizer step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--head-lr", type=float, default=2e-3)
    p.add_argument("--lr-floor", type=float, default=0.1, help="final LR as a fraction of the peak")
    p.add_argument("--warmup", type=float, default=0.03, help="warmup as a fraction of the time budget")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--noise", type=float, default=0.2, help="uniform input-feature noise width, x feature std")
    p.add_argument("--ce-weight", type=float, default=0.1, help="weight of the soft cross-entropy term")
    p.add_argument("--heldout-mod", type=int, default=64, help="a file is held out when hash %% mod == 0")
    p.add_argument("--no-bos", action="store_true", help="do not put BOS before each file")
    p.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts for the acceptance simulation")
    p.add_argument("--eval-gen", type=int, default=96, help="greedy tokens generated per acceptance prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args(argv)


def main(argv=None):
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    np.random.seed(a.seed)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    cmd = "python scripts/train_tiny.py " + " ".join(sys.argv[1:] if argv is None else argv)

    root, data, names = build_corpus(a.heldout_mod, bos=not a.no_bos)
    console.print(f"corpus {root}: train {len(names['train'])} files {data['train'].numel() / 1e6:.2f}M tokens, "
                  f"held-out {len(names['heldout'])} files {data['heldout'].numel() / 1e3:.1f}k tokens")

    cfg = make_config(a)
    gen = torch.Generator().manual_seed(a.seed)
    report = {"command": cmd, "seed": a.seed, "threads": a.threads, "torch": torch.__version__,
              "python": platform.python_version(), "stdlib": str(root),
              "corpus": {"train_files": len(names["train"]), "train_tokens": data["train"].numel(),
                         "heldout_files": len(names["heldout"]), "heldout_tokens": data["heldout"].numel(),
                         "heldout_mod": a.heldout_mod, "bos": not a.no_bos, "heldout_names": names["heldout"]},
              "args": vars(a)}

    if a.target_minutes > 0:
        target = LlamaForCausalLM(cfg)
        init_weights(target, cfg.num_hidden_layers, gen)
        report["target_train"] = train_target(target, data["train"], a, gen)
        round_to_bf16_(target)  # what ships; the head trains on exactly these weights
        save_target(target, out / "target")
    else:
        target = load_target(out / "target", cfg)
        console.print(f"reusing {out / 'target'}")
    target.eval().requires_grad_(False)
    n_target = sum(p.numel() for p in target.parameters())
    report["target"] = {"params": n_target, "hidden": a.hidden, "layers": a.layers, "heads": a.heads,
                        "kv_heads": a.kv_heads, "intermediate": a.intermediate, "context": a.seq_len}
    report["target_eval"] = eval_target(target, data["heldout"], a.seq_len)
    console.print(f"target held-out: {report['target_eval']['heldout_bits_per_byte']:.4f} bits/byte")

    head_gen = torch.Generator().manual_seed(a.seed + 1)
    head = EagleHead(cfg, target)
    init_weights(head, 1, head_gen)
    if a.head_minutes > 0:
        report["head_train"] = train_head(head, target, data["train"], a, head_gen)
    round_to_bf16_(head)
    save_eagle(head, cfg, out / "eagle")
    report["head"] = {"params": sum(p.numel() for p in head.parameters()), "noise": a.noise,
                      "ce_weight": a.ce_weight}
    report["head_eval"] = eval_head(head, target, data["heldout"], a.seq_len)
    console.print(f"head held-out teacher-forced top-1 agreement: {report['head_eval']['head_top1_agreement']:.4f}")
    t_acc = time.time()
    report["acceptance_eval"] = eval_acceptance(
        head, target, heldout_docs(root, names["heldout"]), a.eval_prompts, 128, a.eval_gen, [3, 4, 5, 6],
        torch.Generator().manual_seed(a.seed + 2))
    console.print("greedy chain acceptance length (k: accepted+1): "
                  f"{report['acceptance_eval']['chain_acceptance_length']}"
                  f" ({time.time() - t_acc:.0f} s)")

    report["files_bytes"] = {str(p.relative_to(out)): p.stat().st_size
                             for p in sorted(out.rglob("*"))
                             if p.is_file() and p.suffix in (".json", ".safetensors") and p.name != "train_report.json"}
    report["total_minutes"] = round((time.time() - t_start) / 60, 2)
    (out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    console.print(f"wrote {out} in {report['total_minutes']:.1f} min")


if __name__ == "__main__":
    main()
