"""The EAGLE draft round as one function: step 0's flatten, then S-1 head forwards, each followed by its top-k
re-rank, then the verify tree built from their candidates.

Run step by step (the default, `compile.draft_loop.steps=eager`), every draft step is a separate call of
`draft_forward.decode`, `draft_topk.first/later` and finally `build_tree.build`, each under its own policy,
with Python between them (visibility mask, attention batch). Compiled as one function, a round makes one call:
the guards, wrapper and host ops of the other calls go (on the shipped pair's CPU run, 2.9 -> 1.9 ms of
drafting per round at topk=1, num_steps=4). The body calls the other stages' *unwrapped* bodies, so under
this policy their own policies do not apply to the round (the extend still runs `draft_forward.extend`).

Both draft scratch layouts run inside it (`stages.draft_scratch`): the flat scratch of page size 1, where every
step reads the same slot columns and the ancestry mask tells branches apart, and the page-aligned branch regions
of larger pages, whose copies of each parent's columns between steps (`BranchRegions.follow`) are tensor code
too; only the regions' first mirror, sized on the host, runs before the call. Allocators that decorate attention
batches on the host (the SWA window pool's slot translation, hisparse's hot buffers) run their rounds step by
step (`EagleProposer.plan_rounds` says why once).
"""
from __future__ import annotations

import torch
from torch import Tensor

from specpipe.stages.base import Stage, branch, per_shape
from specpipe.stages.build_tree import BuildTree, candidates
from specpipe.stages.draft_forward import DraftForward, advance_visibility
from specpipe.stages.draft_topk import DraftTopK
from specpipe.stages.finite import finite_rows


class DraftLoop(Stage):
    name = "draft_loop"
    model_branches = frozenset({"steps"})

    def __init__(self, draft_fwd: DraftForward, topk_stage: DraftTopK, tree_stage: BuildTree, num_steps: int):
        self.draft_fwd, self.topk_stage, self.tree_stage = draft_fwd, topk_stage, tree_stage
        self.K, self.S = topk_stage.topk, num_steps
        # the round's scratch layout (FlatScratch or BranchRegions, as draft_scratch chose it) and its first tree
        # column, set by EagleProposer.propose; where BranchRegions.follow copies, set by EagleProposer.plan_rounds
        self.layout, self.first, self.prep, self.kv = None, 0, None, None
        self.steps = per_shape(self.steps, (self.K, self.S, tree_stage.num_draft_tokens))  # unrolls S steps

    @branch
    def steps(self, topk_p: Tensor, topk_index: Tensor, hidden: Tensor, verified_id: Tensor, seq_lens: Tensor,
              *scratch: Tensor) -> tuple:
        """topk_p/topk_index [B, K], hidden [B, H]: the extend's top-k; verified_id [B] the root token at position
        seq_lens [B]; scratch: the round's draft scratch as `tensors()` gives it -> (the `Tree`'s fields, bad [B]:
        the request's draft scores hold NaN or inf)."""
        B, K, S = topk_p.shape[0], self.K, self.S
        fwd, tk = self.draft_fwd, self.topk_stage
        sc = self.layout.from_tensors(self.first, *scratch)
        ids, hid, scores, pb, blk = DraftTopK.first(tk, topk_p, topk_index, hidden)
        blocks = [blk]
        anc = torch.zeros((B, K, (S - 1) * K), dtype=torch.bool, device=topk_p.device)
        for i in range(S - 1):
            anc = advance_visibility(anc, pb, i)
            sc.follow(self.prep, self.kv, pb, i)
            batch = sc.step_batch(i, anc)
            tp, ti, hout = DraftForward.decode(fwd, ids.view(B, K), hid.view(B, K, -1), batch)
            ids, hid, scores, pb, (s_blk, t_blk, sel) = DraftTopK.later(tk, tp, ti, hout, scores)
            blocks.append((s_blk, t_blk, sel + (K * K * i + K)))
        cand_scores, cand_tokens, parent_list = candidates(*zip(*blocks))
        tree = BuildTree.build(self.tree_stage, verified_id, cand_scores, cand_tokens, parent_list, seq_lens)
        return tree, ~finite_rows(cand_scores)
