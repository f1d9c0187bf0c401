"""Multi-step training of an EAGLE head: the head fed its own hidden states for k steps, each step attending as
it will when it drafts (HASS's and EAGLE-3's training-time test).

When specpipe drafts, head position p reads (token x_{p+1}, the target's feature at p) at RoPE position p and
predicts x_{p+2}; draft step j >= 1 of that chain reads (token x_{p+1+j}, the head's own output of step j-1) at
position p+j. Its query attends to the keys written with the target's features at positions <= p (the committed
context) and to its own chain's keys of steps 1..j (positions p+1..p+j), nothing else. `ttt_forward` computes every
chain of a batch at once, step by step: step 0 is plain causal attention (exactly the module's forward with
batch=None); step j adds, to the causal scores over step 0's keys, the diagonal scores against each earlier
step's key of the same position. The layers' own modules (projections, norms, MLP) do the rest, so the weights
trained are the ones `draft.path` loads and drafts with (tests/train/test_ttt.py checks a chain against the
head's incremental decode through its KV pool).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from specpipe.models.attention import rotate_half
from specpipe.models.eagle3 import Eagle3Head


def _shift(x: Tensor, by: int, fill=0) -> Tensor:
    """x[:, by:] padded at the end to x's length (dim 1)."""
    if by == 0:
        return x
    pad = x.new_full((x.shape[0], by, *x.shape[2:]), fill)
    return torch.cat([x[:, by:], pad], 1)


def attention(attn, x: Tensor, cos: Tensor, sin: Tensor, cache: list) -> Tensor:
    """`attn` (models.attention.Attention) over x [B, L, *] at this step; `cache` holds the earlier steps' (k, v)
    [B, Hkv, L, D] and gets this step's."""
    B, L, _ = x.shape
    nh, nkv, hd = attn.n_heads, attn.n_kv, attn.hd
    q = attn.q_proj(x).view(B, L, nh, hd)
    k = attn.k_proj(x).view(B, L, nkv, hd)
    v = attn.v_proj(x).view(B, L, nkv, hd)
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q = (q * cos + rotate_half(q) * sin).transpose(1, 2)  # [B, H, L, D]
    k = (k * cos + rotate_half(k) * sin).transpose(1, 2)
    v = v.transpose(1, 2)
    cache.append((k, v))
    if len(cache) == 1:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    else:
        g = nh // nkv
        k0, v0 = (t.repeat_interleave(g, 1) for t in cache[0])
        scale = hd ** -0.5
        s0 = (q @ k0.transpose(-1, -2)) * scale  # [B, H, L, L]
        causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
        s0 = s0.masked_fill(~causal, float("-inf"))
        ks = [ki.repeat_interleave(g, 1) for ki, _ in cache[1:]]
        vs = [vi.repeat_interleave(g, 1) for _, vi in cache[1:]]
        sd = torch.stack([(q * ki).sum(-1) for ki in ks], -1) * scale  # [B, H, L, j]
        w = torch.softmax(torch.cat([s0.float(), sd.float()], -1), -1).to(v0.dtype)
        o = w[..., :L] @ v0
        for i, vi in enumerate(vs):
            o = o + w[..., L + i, None] * vi
    return attn.o_proj(o.transpose(1, 2).reshape(B, L, nh * hd))


def decoder_layer(layer, x: Tensor, cos: Tensor, sin: Tensor, cache: list) -> Tensor:
    """models.llama.DecoderLayer's forward with this step's attention."""
    x = x + attention(layer.self_attn, layer.input_layernorm(x), cos, sin, cache)
    return x + layer.mlp(layer.post_attention_layernorm(x))


def head_step(head, tokens: Tensor, hidden: Tensor, positions: Tensor, caches: list, own: bool) -> Tensor:
    """One draft step of `head` (EagleHead or Eagle3Head) over every position: tokens [B, L], hidden [B, L, F]
    (the target's features, or with `own` the head's previous output) -> [B, L, H], as the head's forward."""
    if not isinstance(head, Eagle3Head):
        x = head.fc(torch.cat((head.embed(tokens), hidden.to(head.fc.weight.dtype)), -1))
        cos, sin = head.rotary(positions, x.dtype)
        for i, layer in enumerate(head.layers):
            x = decoder_layer(layer, x, cos, sin, caches[i])
        return x
    h = hidden.to(head.lm_head.weight.dtype)
    cos, sin = head.rotary(positions, h.dtype)
    if head.fc is not None and not own:
        if head.fc_norm is not None:
            h = torch.cat([n(c) for n, c in zip(head.fc_norm, h.chunk(len(head.fc_norm), -1))], -1)
        if head.input_norm is not None:
            h = head.input_norm(h)
        h = head.fc(h)
    m = head.midlayer
    normed = m.hidden_norm(h)
    residual = normed if m.norm_before_residual else h
    x = torch.cat((m.input_layernorm(head.embed(tokens).to(h.dtype)), normed), -1)
    x = residual + attention(m.self_attn, x, cos, sin, caches[0])
    x = x + m.mlp(m.post_attention_layernorm(x))
    for i, layer in enumerate(head.layers.values(), 1):
        x = decoder_layer(layer, x, cos, sin, caches[i])
    return head.norm(x) if head.norm_output else x


def ttt_forward(head, ids: Tensor, feats: Tensor, steps: int) -> list[Tensor]:
    """The head's outputs of draft steps 0..steps-1 at every position p: [B, L, H] each. Step j at p read token
    ids[p+1+j] (0 past the end) and predicts the target's distribution at p+1+j."""
    B, L = ids.shape
    n_layers = 1 + len(head.layers) if isinstance(head, Eagle3Head) else len(head.layers)
    caches: list = [[] for _ in range(n_layers)]
    base = torch.arange(L, device=ids.device)[None].expand(B, L)
    outs, hidden = [], feats
    for j in range(steps):
        hidden = head_step(head, _shift(ids, 1 + j), hidden, base + j, caches, own=j > 0)
        outs.append(hidden)
    return outs


def draft_logits(head, hidden: Tensor) -> Tensor:
    """Logits over the head's draft vocabulary (EAGLE-3) or the target's (EAGLE-1)."""
    return head.draft_logits(hidden) if isinstance(head, Eagle3Head) else head.logits(hidden)


def to_draft_ids(head, target_ids: Tensor) -> Tensor:
    """Target ids -> draft ids (-1: not in the draft vocabulary); EAGLE-1 drafts over the target's own."""
    if not isinstance(head, Eagle3Head):
        return target_ids.long()
    index = torch.full((head.t2d.numel(),), -1, dtype=torch.long, device=target_ids.device)
    index[head.to_target(torch.arange(head.draft_vocab_size, device=target_ids.device))] = \
        torch.arange(head.draft_vocab_size, device=target_ids.device)
    return index[target_ids.long()]


def soft_ce(logits: Tensor, top_lp: Tensor, top_draft: Tensor) -> Tensor:
    """Per-row cross-entropy of the draft's logits [N, Vd] against the target's top-k distribution (log-probs
    [N, K] over draft ids [N, K], -1 where the draft vocabulary lacks the token), renormalised over the kept ids."""
    logq = torch.log_softmax(logits.float(), -1)
    keep = top_draft >= 0
    p = top_lp.float().exp() * keep
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-9)
    return -(p * logq.gather(-1, top_draft.clamp_min(0))).sum(-1)


def step_targets(shard, j: int, device, hidden: bool) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
    """Step j's labels at every position p: (mask [B, L], top-k log-probs, top-k ids at p+1+j, and with `hidden`
    the target's next hidden, EAGLE-1's regression target)."""
    by = 1 + j
    mask = _shift(shard.labelled, by, False).to(device)
    lp = _shift(shard.top_lp, by).to(device)
    top = _shift(shard.top_id, by).to(device)
    return mask, lp, top, _shift(shard.feats, by).to(device) if hidden else None


def ttt_loss(head, shard, hc, steps: int, decay: float, noise: float, gen: Optional[torch.Generator],
             device) -> tuple[Tensor, dict]:
    """The weighted loss over `steps` draft steps of a shard, and per step its top-1 agreement with the target."""
    ids, feats = shard.ids.to(device), shard.feats.to(device).float()
    if noise > 0:  # EAGLE's uniform feature noise, scaled by each input layer's std
        parts = len(head.aux_layers) if isinstance(head, Eagle3Head) and head.fc is not None else 1
        std = torch.stack([c.std() for c in feats.chunk(parts, -1)]).repeat_interleave(feats.shape[-1] // parts)
        feats = feats + (torch.rand(feats.shape, generator=gen).to(device) - 0.5) * noise * std
    outs = ttt_forward(head, ids, feats, steps)
    total, weights, stats = 0.0, 0.0, {}
    for j, out in enumerate(outs):
        mask, lp, top, nxt = step_targets(shard, j, device, bool(hc.hidden_weight))
        if not mask.any():
            continue
        rows = out[mask]  # [N, H]
        logits = draft_logits(head, rows)
        loss = hc.ce_weight * soft_ce(logits, lp[mask], to_draft_ids(head, top[mask])).mean()
        if hc.hidden_weight:
            loss = loss + hc.hidden_weight * F.smooth_l1_loss(rows.float(), nxt[mask].float())
        w = decay ** j
        total, weights = total + w * loss, weights + w
        with torch.no_grad():
            stats[f"top1_{j}"] = float((picked(head, logits) == top[mask][:, 0].long()).float().mean())
            stats[f"loss_{j}"] = loss.item()
    return total / max(weights, 1e-9), stats


def picked(head, logits: Tensor) -> Tensor:
    """The target ids of the draft's greedy choices."""
    best = logits.argmax(-1)
    return head.to_target(best) if isinstance(head, Eagle3Head) else best
