"""The EAGLE draft round as one function: step 0's flatten, then S-1 head forwards, each followed by its top-k
re-rank, then the verify tree built from their candidates.

Run step by step (the default, `compile.draft_loop.steps=eager`), every draft step is a separate call of
`draft_forward.decode`, `draft_topk.first/later` and finally `build_tree.build`, each under its own policy,
with Python between them (visibility mask, attention batch). Compiled as one function, a round makes one call: the guards, wrapper and
host ops of the other calls go (on the shipped pair's CPU run, 2.9 -> 1.9 ms of drafting per round at
topk=1, num_steps=4). The body calls the other stages' *unwrapped* bodies, so under this policy their own
policies do not apply to the round (the extend still runs `draft_forward.extend`).

It covers the flat draft scratch (page size 1: the token allocator, and hisparse without hot buffers'
observation): there every step reads the same slot columns and the ancestry mask tells branches apart. The
page-aligned branch regions of larger pages copy each parent's columns between steps and the SWA window pool
translates slots on the host, so those rounds run step by step (`EagleProposer.fused_reason` says why once).
"""
from __future__ import annotations

import torch
from torch import Tensor

from specpipe.pipeline import finite_rows
from specpipe.stages.base import Stage, branch, per_shape
from specpipe.stages.build_tree import BuildTree, candidates
from specpipe.stages.draft_forward import DraftForward, advance_visibility, draft_decode_batch
from specpipe.stages.draft_topk import DraftTopK


class DraftLoop(Stage):
    name = "draft_loop"
    model_branches = frozenset({"steps"})

    def __init__(self, draft_fwd: DraftForward, topk_stage: DraftTopK, tree_stage: BuildTree, num_steps: int):
        self.draft_fwd, self.topk_stage, self.tree_stage = draft_fwd, topk_stage, tree_stage
        self.K, self.S = topk_stage.topk, num_steps
        self.steps = per_shape(self.steps, (self.K, self.S, tree_stage.num_draft_tokens))  # unrolls S steps

    @branch
    def steps(self, topk_p: Tensor, topk_index: Tensor, hidden: Tensor, prefix_slots: Tensor, prefix_valid: Tensor,
              cols: Tensor, seq_lens: Tensor, verified_id: Tensor) -> tuple:
        """topk_p/topk_index [B, K], hidden [B, H]: the extend's top-k; the flat scratch's prefix_slots/prefix_valid
        [B, Lp], cols [B, S-1, K] and seq_lens [B]; verified_id [B] the root token -> (the `Tree`'s fields,
        bad [B]: the request's draft scores hold NaN or inf)."""
        B, K, S = topk_p.shape[0], self.K, self.S
        fwd, tk = self.draft_fwd, self.topk_stage
        ids, hid, scores, pb, blk = DraftTopK.first(tk, topk_p, topk_index, hidden)
        blocks = [blk]
        anc = torch.zeros((B, K, (S - 1) * K), dtype=torch.bool, device=topk_p.device)
        for i in range(S - 1):
            anc = advance_visibility(anc, pb, i)
            batch = draft_decode_batch(prefix_slots, prefix_valid, cols, anc, i, seq_lens)
            tp, ti, hout = DraftForward.decode(fwd, ids.view(B, K), hid.view(B, K, -1), batch)
            ids, hid, scores, pb, (s_blk, t_blk, sel) = DraftTopK.later(tk, tp, ti, hout, scores)
            blocks.append((s_blk, t_blk, sel + (K * K * i + K)))
        cand_scores, cand_tokens, parent_list = candidates(*zip(*blocks))
        tree = BuildTree.build(self.tree_stage, verified_id, cand_scores, cand_tokens, parent_list, seq_lens)
        return tree, ~finite_rows(cand_scores)
