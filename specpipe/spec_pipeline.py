"""One EAGLE round per step: draft the tree, build it, verify it with one target forward, commit.

Carried per running request (device tensors, request-major):
  last_token [B]  the last committed token (its KV is not in the target cache yet; position L_b)
  topk_p, topk_index [B, K]  the draft's distribution for the token after it
  draft_hidden [B, H]  the draft's hidden state at position L_b - 1
The step has one host sync: reading the committed tokens to check stop conditions.
"""
from __future__ import annotations

import numpy as np
import torch

from specpipe.models.attention_batch import AttentionBatch, extend_batch
from specpipe.pipeline import OutOfKVMemory, Pipeline, bucket
from specpipe.stages.build_tree import BuildTree
from specpipe.stages.draft_forward import DraftForward, draft_decode_batch
from specpipe.stages.draft_topk import DraftTopK
from specpipe.stages.verify import Verify


class EaglePipeline(Pipeline):
    def __init__(self, target, head, allocator, device, max_requests, max_context, eos_token_id, metrics,
                 topk: int, num_steps: int, num_draft_tokens: int, wrap, fused_topk: bool = False):
        super().__init__(target, allocator, device, max_requests, max_context, eos_token_id, metrics)
        self.K, self.S, self.N = topk, num_steps, num_draft_tokens
        self.head = head
        self.topk_stage = DraftTopK(topk, fused_topk)
        self.tree_stage = BuildTree(topk, num_steps, num_draft_tokens)
        self.verify = Verify(target, num_steps)
        self.draft_fwd = DraftForward(head, topk)
        self.stages = [self.topk_stage, self.tree_stage, self.verify, self.draft_fwd, self.prep]
        for st in self.stages:
            st.bind(wrap)

    # ---- admission ---------------------------------------------------------------------
    def join(self, reqs, rows_np, ids, hidden, batch, last, first) -> None:
        """Draft extend over the prompt: position p takes (token x_{p+1}, target hidden h_p)."""
        ids_d = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], 1).scatter(1, last[:, None], first[:, None])
        with torch.no_grad():
            p, idx, h = self.draft_fwd.extend(ids_d, hidden, batch, last)
        had = len(self.reqs)
        super().join(reqs, rows_np, ids, hidden, batch, last, first)
        if had:
            self.topk_p = torch.cat([self.topk_p, p])
            self.topk_index = torch.cat([self.topk_index, idx])
            self.draft_hidden = torch.cat([self.draft_hidden, h])
        else:
            self.topk_p, self.topk_index, self.draft_hidden = p, idx, h

    def keep(self, keep_t) -> None:
        super().keep(keep_t)
        self.topk_p, self.topk_index = self.topk_p[keep_t], self.topk_index[keep_t]
        self.draft_hidden = self.draft_hidden[keep_t]

    # ---- one round ---------------------------------------------------------------------
    def draft(self, rows_t, L, L_t):
        """S-1 draft forwards; returns the per-step score/token/parent blocks for tree building."""
        B, K, S = len(self.reqs), self.K, self.S
        sc = self.prep.scratch(B * K * (S - 1))
        if sc is None:
            raise OutOfKVMemory("KV pool exhausted while drafting")
        scratch_slots, state = sc
        scratch = scratch_slots.view(B, S - 1, K)
        Lp = bucket(L.max())
        prefix_slots = self.prep.slots(rows_t, torch.zeros_like(L_t), Lp)
        prefix_valid = torch.arange(Lp, device=self.dev)[None, :] < L_t[:, None]
        anc = torch.zeros((B, K, (S - 1) * K), dtype=torch.bool, device=self.dev)
        kk = torch.arange(K, device=self.dev)
        ids, hid, scores, pb, blk = self.topk_stage(0, self.topk_p, self.topk_index, self.draft_hidden, None)
        blocks = [blk]
        for i in range(S - 1):
            if i > 0:  # each new branch inherits its parent branch's visible draft tokens
                anc = anc.gather(1, pb[:, :, None].expand(-1, -1, anc.shape[2]))
            anc[:, kk, i * K + kk] = True
            batch = self.prep.decorate(draft_decode_batch(prefix_slots, prefix_valid, scratch, anc, i, L_t))
            tp, ti, hout = self.draft_fwd.decode(ids.view(B, K), hid.view(B, K, -1), batch)
            ids, hid, scores, pb, blk = self.topk_stage(i + 1, tp, ti, hout, scores)
            blocks.append(blk)
        self.prep.end_scratch(state)
        return blocks

    def verify_batch(self, tree, rows_t, L, L_t) -> AttentionBatch:
        """Prefix fully visible plus the tree mask; tree node j sits at table position L_b + j."""
        B, N = len(self.reqs), self.N
        vslots = self.prep.slots(rows_t, L_t, N)  # [B, N]
        Lv = bucket(L.max() + N)
        kv_slots = self.prep.slots(rows_t, torch.zeros_like(L_t), Lv)
        c = torch.arange(Lv, device=self.dev)
        j = c[None, :] - L_t[:, None]  # [B, Lv] tree index of each column
        in_tree = (j >= 0) & (j < N)
        jc = j.clamp(0, N - 1)
        tree_vis = tree.mask.gather(2, jc[:, None, :].expand(B, N, Lv)) & in_tree[:, None, :]
        mask = (c[None, :] < L_t[:, None])[:, None, :] | tree_vis  # [B, N, Lv]
        kv_pos = torch.where(in_tree, L_t[:, None] + tree.depth.gather(1, jc), c[None, :].expand(B, Lv))
        return self.prep.decorate(AttentionBatch(tree.positions, vslots, kv_slots, mask, kv_pos))

    @torch.no_grad()
    def step(self) -> None:
        B, K, S, N = len(self.reqs), self.K, self.S, self.N
        m = self.metrics
        rows_t = torch.from_numpy(self.rows).to(self.dev)
        L = self.prep.seq_len[self.rows].copy()
        L_t = torch.from_numpy(L).to(self.dev)
        with m.stage("draft"):
            blocks = self.draft(rows_t, L, L_t)
        with m.stage("build_tree"):
            s_l, t_l, p_l = (list(x) for x in zip(*blocks))
            tree = self.tree_stage(self.last_token, s_l, t_l, p_l, L_t)
        with m.stage("prepare_decode"):
            if not self.prep.reserve(self.rows, np.full(B, N, dtype=np.int64)):
                raise OutOfKVMemory("KV pool exhausted before verify")
            vbatch = self.verify_batch(tree, rows_t, L, L_t)
        with m.stage("verify"):
            logits, vhidden = self.verify.target_forward(tree.tokens, vbatch)
            accept_index, count, commit = self.verify.greedy(logits.argmax(-1), tree.tokens, tree.parent)
        with m.stage("commit"):
            host = torch.cat([count[:, None], commit], 1).tolist()  # the one host sync of the step
            kept = np.asarray([self.append_tokens(r, h[1: h[0] + 2]) for r, h in zip(self.reqs, host)])
            m.record_accepts([h[0] for h in host])
            kept_t = torch.from_numpy(kept).to(self.dev)
            d = torch.arange(S + 1, device=self.dev)
            src = vbatch.out_slots.gather(1, accept_index.clamp(min=0))  # [B, S+1] slots of accepted nodes
            tgt = vbatch.out_slots.gather(1, d.clamp(max=N - 1).expand(B, S + 1))  # contiguous positions
            move = (d[None, :] < kept_t[:, None]) & (src != tgt)
            self.prep.move_kv(self.target.kv, tgt[move], src[move])
            unfinished = np.asarray([not r.finished for r in self.reqs])
            self.prep.commit(self.rows[unfinished], (L + kept)[unfinished])
            self.prep.after_commit(self.rows[unfinished])
        with m.stage("draft_extend"):
            self.extend_after_verify(unfinished, commit, vhidden, accept_index, L_t, kept_t, rows_t)
        self.drop_finished()
        m.num_verify_steps += 1

    def extend_after_verify(self, unfinished, commit, vhidden, accept_index, L_t, kept_t, rows_t) -> None:
        """Draft over the committed tokens so the next round starts from the new bonus token."""
        if not unfinished.any():
            return
        u = torch.from_numpy(np.flatnonzero(unfinished)).to(self.dev)
        H = vhidden.shape[-1]
        hid = vhidden.gather(1, accept_index.clamp(min=0)[:, :, None].expand(-1, -1, H))[u]  # [B', S+1, H]
        ids, lens, starts = commit[u], kept_t[u], L_t[u]
        Lmax = int(self.prep.seq_len[self.rows[unfinished]].max())
        batch = self.prep.decorate(extend_batch(self.prep.table, rows_t[u], starts, lens, self.S + 1, bucket(Lmax)))
        p, idx, h = self.draft_fwd.extend(ids, hid, batch, lens - 1)
        self.topk_p[u], self.topk_index[u], self.draft_hidden[u] = p, idx, h
        self.last_token[u] = ids.gather(1, (lens - 1)[:, None])[:, 0]
