"""The target's features over the data, computed once in large batches and kept in memory as shards.

A shard is one training batch: windows of similar length padded together. For each position it holds the
head's input features (EAGLE-3: the three aux layers' outputs concatenated; EAGLE-1: the final hidden, which is
also EAGLE-1's regression target), and the target's top-k log-probabilities and ids as soft labels. The target
runs specpipe's own forward with batch=None (plain causal attention), under bf16 autocast when asked.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

LOGIT_ROWS = 1024  # rows of the lm_head, softmax and top-k at a time (a [4096, 49152] fp32 block is 800 MB)


@dataclass
class Shard:
    ids: Tensor  # [B, L] int64, padded with 0
    real: Tensor  # [B, L] bool: a token of the sequence (padding False)
    labelled: Tensor  # [B, L] bool: the target's distribution at this position is a label (Seq.score_from on)
    feats: Tensor  # [B, L, F] the head's input features (bf16 when autocast)
    top_lp: Tensor  # [B, L, K] the target's top-k log-probabilities
    top_id: Tensor  # [B, L, K] int32, their ids; [..., 0] is the target's greedy token

    @property
    def tokens(self) -> int:
        return int(self.real.sum())

    @property
    def nbytes(self) -> int:
        return sum(t.element_size() * t.numel() for t in (self.ids, self.real, self.labelled, self.feats,
                                                          self.top_lp, self.top_id))


def windows(seqs: list, seq_len: int) -> list[tuple[list, int]]:
    """(ids, score_from) windows of at most `seq_len` tokens: a longer sequence is cut into consecutive ones. A
    window with no label (the part of a long prompt before its continuation) is left out: it would cost features
    and training and teach nothing, and a batch of only such windows has no loss at all."""
    out = []
    for s in seqs:
        for a in range(0, max(1, len(s.ids) - 1), seq_len):
            w, first = s.ids[a:a + seq_len], max(0, s.score_from - a)
            if len(w) >= 2 and first < len(w):
                out.append((w, first))
    return out


def group(wins: list, batch_tokens: int, seed: int, bucket: int = 64) -> list[list]:
    """Windows grouped into batches of at most `batch_tokens` padded tokens: shuffled, sorted by length within
    buckets (little padding), batches in a shuffled order (a time budget that stops early keeps a random part)."""
    rng = random.Random(seed)
    wins = list(wins)
    rng.shuffle(wins)
    batches = []
    for a in range(0, len(wins), bucket):
        part = sorted(wins[a:a + bucket], key=lambda w: -len(w[0]))
        cur: list = []
        for w in part:
            if cur and (len(cur) + 1) * len(cur[0][0]) > batch_tokens:
                batches.append(cur)
                cur = []
            cur.append(w)
        if cur:
            batches.append(cur)
    rng.shuffle(batches)
    return batches


def batches_first_own(seqs: list, seq_len: int, batch_tokens: int, seed: int) -> list[list]:
    """`group`'s batches, the target's own continuations (self-distillation) before the corpus: the time budget
    that stops the features early keeps all of them. They are what the head meets when it drafts, and each cost
    a decode to make. (On SmolLM2 a 15-minute feature budget covers about a sixth of the 1.9M tokens of data: in
    shuffled order it kept about a sixth of the continuations that 18 minutes of decoding had made.)"""
    own = [s for s in seqs if s.origin != "corpus"]
    rest = [s for s in seqs if s.origin == "corpus"]
    return group(windows(own, seq_len), batch_tokens, seed) + group(windows(rest, seq_len), batch_tokens, seed)


def pad(batch: list) -> tuple[Tensor, Tensor, Tensor]:
    """(ids [B, L], real [B, L], labelled [B, L]) of a batch of windows."""
    L = max(len(w) for w, _ in batch)
    ids = torch.zeros(len(batch), L, dtype=torch.int64)
    real = torch.zeros(len(batch), L, dtype=torch.bool)
    lab = torch.zeros(len(batch), L, dtype=torch.bool)
    for i, (w, first) in enumerate(batch):
        ids[i, :len(w)] = torch.tensor(w)
        real[i, :len(w)] = True
        lab[i, first:len(w)] = True
    return ids, real, lab


@torch.no_grad()
def target_features(target, ids: Tensor, aux_layers: Optional[list], k: int, autocast: bool,
                    device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """(feats [B, L, F], top-k log-probs [B, L, K], their ids [B, L, K]) of one forward of the target."""
    ids = ids.to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        if aux_layers:
            h, feats = target(ids, aux_layers=aux_layers)
        else:
            h = feats = target(ids)
        flat = h.reshape(-1, h.shape[-1])
        lps, tops = [], []
        for a in range(0, flat.shape[0], LOGIT_ROWS):
            lp = torch.log_softmax(target.logits(flat[a:a + LOGIT_ROWS]).float(), -1)
            v, i = lp.topk(k, -1)
            lps.append(v)
            tops.append(i)
    B, L = ids.shape
    store = torch.bfloat16 if autocast else feats.dtype
    return (feats.to("cpu", store), torch.cat(lps).view(B, L, k).to("cpu", torch.bfloat16),
            torch.cat(tops).view(B, L, k).to("cpu", torch.int32))


def make_shards(target, seqs: list, aux_layers: Optional[list], cfg, seconds: Optional[float], device,
                tick: Optional[Callable] = None, max_bytes: Optional[float] = None,
                max_tokens: Optional[int] = None, max_batches: Optional[int] = None) -> list[Shard]:
    """Shards of `seqs` until the time (`seconds`), memory (`max_bytes`), token or batch budget is spent (None:
    all)."""
    d, t = cfg.data, cfg.train
    seq_len = min(d.seq_len, target.config.max_position_embeddings)  # no window past the context it knows
    batches = batches_first_own(seqs, seq_len, t.batch_tokens, cfg.seed)[:max_batches]
    t0, out, used, tokens = time.perf_counter(), [], 0, 0
    for b in batches:
        ids, real, lab = pad(b)
        feats, lp, top = target_features(target, ids, aux_layers, d.soft_topk, t.autocast, device)
        out.append(Shard(ids, real, lab & real, feats, lp, top))
        used, tokens = used + out[-1].nbytes, tokens + out[-1].tokens
        took = time.perf_counter() - t0
        if tick is not None:
            tick(took, f"{len(out)}/{len(batches)} batches, {tokens / 1e3:.0f}k tok, {used / 2 ** 30:.2f} GiB")
        if (seconds is not None and took >= seconds) or (max_bytes is not None and used >= max_bytes) or \
                (max_tokens is not None and tokens >= max_tokens):
            break
    return out


def token_counts(shards: list[Shard], vocab: int) -> Tensor:
    """[V] how often each token is the target's greedy choice or a data token at a labelled position: the
    draft vocabulary keeps the most frequent (EAGLE-3's d2t / t2d)."""
    counts = torch.zeros(vocab, dtype=torch.int64)
    for s in shards:
        counts += torch.bincount(s.top_id[..., 0][s.labelled].long(), minlength=vocab)[:vocab]
        counts += torch.bincount(s.ids[s.real], minlength=vocab)[:vocab]
    return counts
