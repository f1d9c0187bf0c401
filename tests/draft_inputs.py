"""Realistic inputs for one draft round of DraftTopK and BuildTree, without running a model.

Shapes and view-ness follow spec_pipeline.EaglePipeline.draft: step 0 gets the request's own top-k
([B, K] probs/ids, [B, H] hidden); step i >= 1 gets the draft forward's reshaped outputs
([B*K, K] and [B*K, H], views of [B, K, K] / [B, K, H] tensors). Random floats: no top-k ties,
so eager and compiled code must agree exactly.
"""
from __future__ import annotations

import torch


def step_inputs(B: int, K: int, H: int, i: int, gen: torch.Generator, vocab: int = 258):
    """(topk_p, topk_index, hidden) for draft step i."""
    rows = B if i == 0 else B * K
    p = torch.rand(rows, K, generator=gen).softmax(-1).sort(-1, descending=True).values
    idx = torch.randint(0, vocab, (rows, K), generator=gen)
    hid = torch.randn(rows, H, generator=gen)
    if i == 0:
        return p, idx, hid
    return p.view(B, K, K).reshape(B * K, K), idx.view(B, K, K).reshape(B * K, K), hid.view(B, K, H).reshape(B * K, H)


def draft_round(stage, B: int, K: int, H: int, num_steps: int, seed: int = 0):
    """Run steps 0..num_steps-1 through `stage` (a DraftTopK); returns every step's outputs."""
    gen = torch.Generator().manual_seed(seed)
    outs, scores = [], None
    for i in range(num_steps):
        p, idx, hid = step_inputs(B, K, H, i, gen)
        out = stage(i, p, idx, hid, scores)
        scores = out[2]
        outs.append(out)
    return outs


def tree_inputs(outs, B: int, seed: int = 0):
    """BuildTree.__call__ arguments from a draft round's outputs."""
    gen = torch.Generator().manual_seed(seed + 1)
    blocks = [o[4] for o in outs]
    verified = torch.randint(0, 258, (B,), generator=gen)
    seq_lens = torch.randint(5, 50, (B,), generator=gen)
    s_l, t_l, p_l = (list(x) for x in zip(*blocks))
    return verified, s_l, t_l, p_l, seq_lens
