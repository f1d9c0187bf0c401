"""The optimisation loop: AdamW on the head's own parameters, a cosine learning rate over the training time, a
wall-clock budget, a checkpoint every few minutes (and on Ctrl-C / SIGTERM), and resume from one.

The checkpoint (out/checkpoint/) holds the data (data.pt: token ids, so a resumed run decodes nothing again) and
the training state (state.pt: the head, the optimiser, the step and the training seconds spent), both read back
with torch.load(weights_only=True): tensors and plain values only.
"""
from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Callable, Optional

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from specpipe.train.heads import trainable
from specpipe.train.ttt import ttt_loss

LOG_EVERY_S = 30.0  # progress lines when stderr is not a terminal (a log file, a test)


def lr_at(progress: float, peak: float, warmup: float, floor: float) -> float:
    """Linear warmup over the first `warmup` of the run, then cosine decay to `floor` x peak."""
    if progress < warmup:
        return peak * max(progress, 1e-3) / warmup
    t = min(1.0, (progress - warmup) / max(1e-9, 1.0 - warmup))
    return peak * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * t)))


class Bars:
    """One progress bar per phase (rich, on stderr), and a plain line every LOG_EVERY_S where stderr is no
    terminal, so a log file shows progress too."""

    def __init__(self):
        self.console = Console(stderr=True, highlight=False, markup=False)
        self.progress = Progress(TextColumn("{task.description:<9}"), BarColumn(), TextColumn("{task.fields[info]}"),
                                 TimeElapsedColumn(), TimeRemainingColumn(), console=self.console)
        self.last = 0.0

    def __enter__(self):
        self.progress.start()
        return self

    def __exit__(self, *exc):
        self.progress.stop()

    def phase(self, name: str, total_s: float) -> Callable[[float, str], None]:
        task = self.progress.add_task(name, total=max(total_s, 1e-6), info="")

        def tick(elapsed: float, info: str = "") -> None:
            self.progress.update(task, completed=min(elapsed, total_s), info=info)
            now = time.perf_counter()
            if not self.console.is_terminal and now - self.last >= LOG_EVERY_S:
                self.console.print(f"[{name}] {elapsed / 60:5.1f} min  {info}")
                self.last = now
        return tick

    def done(self, name: str, text: str) -> None:
        self.console.print(f"[{name}] {text}")


class Checkpoint:
    """out/checkpoint/: data.pt and state.pt, each written to a temporary file and renamed (a stopped write
    leaves the previous one)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def _save(self, obj, name: str) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.folder / f".{name}.tmp"
        torch.save(obj, tmp)
        os.replace(tmp, self.folder / name)

    def _load(self, name: str):
        path = self.folder / name
        return torch.load(path, weights_only=True) if path.is_file() else None

    def save_data(self, state: dict) -> None:
        self._save(state, "data.pt")

    def load_data(self) -> Optional[dict]:
        return self._load("data.pt")

    def save_state(self, state: dict) -> None:
        self._save(state, "state.pt")

    def load_state(self) -> Optional[dict]:
        return self._load("state.pt")

    def exists(self) -> bool:
        return (self.folder / "data.pt").is_file() or (self.folder / "state.pt").is_file()


def make_optimizer(head, cfg, state: Optional[dict]) -> torch.optim.AdamW:
    """AdamW on the head's own parameters: weight decay on matrices only."""
    params = trainable(head)
    decay = [p for p in params if p.dim() >= 2]
    other = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.train.weight_decay},
                             {"params": other, "weight_decay": 0.0}], lr=cfg.train.lr, betas=(0.9, 0.95), eps=1e-8)
    if state is not None:
        opt.load_state_dict(state["optimizer"])
    return opt


def fit(head, shards: list, cfg, budget_s: float, save: Callable, state: Optional[dict],
        tick: Callable, device) -> dict:
    """Train until `budget_s` training seconds (counting a resumed run's earlier ones) or train.max_steps;
    `save(progress, optimizer)` writes a checkpoint (every train.checkpoint_minutes, at the end, and when stopped)."""
    t, hc = cfg.train, cfg.head
    opt = make_optimizer(head, cfg, state)
    step, done_s = (state["step"], state["train_seconds"]) if state else (0, 0.0)
    tokens = state.get("tokens", 0) if state else 0
    head.train()
    t0 = last_save = time.perf_counter()
    ema: dict = dict(state.get("ema", {})) if state else {}

    def progress_now() -> dict:
        return {"step": step, "train_seconds": done_s + time.perf_counter() - t0, "tokens": tokens, "ema": ema}

    try:
        while True:
            spent = done_s + time.perf_counter() - t0
            if spent >= budget_s or (t.max_steps is not None and step >= t.max_steps) or not shards:
                break
            frac = spent / budget_s
            if t.max_steps:
                frac = max(frac, step / t.max_steps)
            lr = lr_at(frac, t.lr, t.warmup, t.lr_floor)
            for g in opt.param_groups:
                g["lr"] = lr
            epoch, at = divmod(step, len(shards))
            order = torch.randperm(len(shards), generator=torch.Generator().manual_seed(cfg.seed * 7919 + epoch))
            shard = shards[int(order[at])]
            gen = torch.Generator().manual_seed(cfg.seed * 104729 + step)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=t.autocast):
                loss, stats = ttt_loss(head, shard, hc, t.steps, t.step_decay, hc.noise, gen, device)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable(head), t.clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step, tokens = step + 1, tokens + shard.tokens
            for k, v in {"loss": loss.item(), **stats}.items():
                ema[k] = v if k not in ema else 0.95 * ema[k] + 0.05 * v
            top1 = " ".join(f"{ema[f'top1_{j}']:.2f}" for j in range(t.steps) if f"top1_{j}" in ema)
            tick(spent, f"step {step} loss {ema['loss']:.3f} top1/step {top1} lr {lr:.1e} epoch {epoch + 1}")
            if time.perf_counter() - last_save >= t.checkpoint_minutes * 60:
                save(progress_now(), opt)
                last_save = time.perf_counter()
    except KeyboardInterrupt:
        save(progress_now(), opt)
        raise
    finally:
        head.eval()
    save(progress_now(), opt)
    out = progress_now()
    out.update(epochs=round(step / max(1, len(shards)), 2), shards=len(shards))
    return out
