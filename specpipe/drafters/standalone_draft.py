"""Standalone draft model: a small causal LM (same tokenizer) drafting a chain or a tree.

Unlike an EAGLE head it needs no target hidden states: draft position p holds token x_p (no
shift). Its KV lives in its own pool indexed by the SAME slots as the target (the request's
req_to_token row), so committed draft KV sits at table[row, 0:L) and draft-tree KV goes to
scratch slots that are handed back after the round.

Per round (root = last committed token, position L, not cached anywhere yet):
  1. root forward: the root at position L into one scratch slot -> the draft's top-K -> step 0,
  2. S-1 tree steps over B*K branch tokens (depth i+1 at position L+1+i), exactly the EAGLE loop
     (`DraftTopK` + `draft_decode_batch`), giving the (score, token, parent) blocks `BuildTree`
     consumes,
  3. after verify: `extend_committed` writes the KV of the root and the accepted drafts at
     positions [L, L+A+1) (the bonus becomes the next root).
With `sampling` (chains only, topk=1) each step samples its token from the processed draft
distribution q instead of taking the top one, and `draft` also returns draft_probs [B,N,V] for
`VerifySampling.sample_rejection`.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from torch import Tensor

from specpipe.models.attention_batch import AttentionBatch, extend_batch
from specpipe.stages.padding import bucket
from specpipe.stages.prepare_decode import OutOfKVMemory
from specpipe.stages.base import Stage, branch
from specpipe.stages.draft_forward import advance_visibility, top_k
from specpipe.stages.draft_topk import DraftTopK
from specpipe.stages.verify_sampling import STREAM_DRAFT, process_logits, sample_tokens, uniform_coins


class StandaloneDrafter(Stage):
    name = "standalone_draft"
    model_branches = frozenset({"root_logits", "decode_logits", "extend"})

    def __init__(self, model, topk: int, num_steps: int, num_draft_tokens: Optional[int] = None,
                 fused_topk: bool = False):
        self.model = model
        self.K, self.S = topk, num_steps
        self.N = num_draft_tokens if num_draft_tokens is not None else num_steps + 1
        self.topk_stage = DraftTopK(topk, fused_topk)  # compile.draft_topk.fused (compile=whole), as EAGLE's

    def setup_kv(self, num_slots: int, dtype: Optional[torch.dtype] = None):
        return self.model.setup_kv(num_slots, dtype)

    # ---- branches: pure tensor code ----------------------------------------------------
    @branch
    def root_logits(self, ids: Tensor, batch: AttentionBatch) -> Tensor:
        """ids [B, 1] -> logits [B, V] of the token after the root."""
        return self.model.logits(self.model(ids, batch)[:, 0])

    @branch
    def decode_logits(self, ids: Tensor, batch: AttentionBatch) -> Tensor:
        """ids [B, K] branch tokens -> logits [B*K, V]."""
        B, K = ids.shape
        return self.model.logits(self.model(ids, batch)).reshape(B * K, -1)

    @branch
    def extend(self, ids: Tensor, batch: AttentionBatch) -> None:
        """Write draft KV for ids [B, Q] (prompt prefill or the committed tokens of a round)."""
        self.model(ids, batch)

    # ---- host orchestration ------------------------------------------------------------
    def prefill(self, ids: Tensor, batch: AttentionBatch) -> None:
        """Prompt prefill with the target's own prefill batch (positions [0, T), same slots)."""
        self.extend(ids, batch)

    def extend_committed(self, table: Tensor, rows_t: Tensor, starts: Tensor, ids: Tensor, lens: Tensor,
                         max_len: int) -> None:
        """After verify and `prep.commit`: ids [B', Q] tokens at positions starts + [0, lens), i.e.
        cat([root, commit], 1)[:, :Q] with lens = accepted + 1 (root and accepted drafts). `max_len`: a host
        bound on starts + lens (the committed lengths), so the step reads nothing back from the device."""
        if ids.shape[0] == 0:
            return
        self.extend(ids, extend_batch(table, rows_t, starts, lens, ids.shape[1], bucket(max_len)))

    def _select(self, logits: Tensor, sampling, coin_col: int, L_t: Tensor):
        """logits [R, V] -> (probs [R, K], ids [R, K], full q [R, V] or None)."""
        if sampling is None:
            p, idx = top_k(logits, self.K)
            return p, idx, None
        temperature, top_p, top_k_, seed, min_p, *filters = sampling  # filters: optional (None: read back)
        filters = filters[0] if filters else None
        q = process_logits(logits[:, None], temperature, top_p, top_k_, min_p, filters)[:, 0]  # [B, V] (K == 1: R == B)
        u = uniform_coins(seed, L_t, coin_col + 1, STREAM_DRAFT)[:, coin_col]
        tok = sample_tokens(q, u)[:, None]
        return q.gather(1, tok), tok, q

    def draft(self, prep, rows: np.ndarray, rows_t: Tensor, L: np.ndarray, L_t: Tensor, root: Tensor, sampling=None):
        """One draft round. rows (host) / rows_t [B] table rows, L host seq lens, L_t [B] seq lens, root [B].

        sampling: None (deterministic top-K tree) or (temperature [B], top_p [B], top_k [B], seed [B], min_p [B][,
        verify_sampling.Filters])
        for a sampled chain (topk must be 1). Returns (blocks, draft_probs): blocks = per-step
        (score, token, parent) as `BuildTree` takes them; draft_probs [B, N, V] or None.
        """
        B, K, S = root.shape[0], self.K, self.S
        if sampling is not None and K != 1:
            raise ValueError("sampled drafting (for rejection sampling) needs topk=1")
        dev, kv = root.device, self.model.kv
        sc = prep.draft_scratch(rows, rows_t, L, L_t, K, S, root=True)
        if sc is None:
            raise OutOfKVMemory("KV pool exhausted while drafting")
        root_slot = sc.root_slots()  # [B]
        Lp = bucket(int(L.max()) + 1)
        ar = torch.arange(Lp, device=dev)
        # the root's slot stands in for table position L in the prefix
        prefix_slots = prep.slots(rows_t, torch.zeros_like(L_t), Lp).scatter(1, L_t[:, None], root_slot[:, None])
        prefix_valid = ar[None, :] <= L_t[:, None]  # [B, Lp]
        batch = AttentionBatch(L_t[:, None], root_slot[:, None], prefix_slots, prefix_valid[:, None, :],
                               ar.expand(B, Lp))
        tp, ti, q = self._select(self.root_logits(root[:, None], batch), sampling, 0, L_t)
        sc.begin(prep, kv)  # page-aligned regions: every branch gets the prefix's partial page and the root
        qs = [q]
        hid = torch.zeros((B, 0), device=dev)  # no hidden states: DraftTopK just carries an empty width
        ids, hid, scores, pb, blk = self.topk_stage(0, tp, ti, hid, None)
        blocks = [blk]
        anc = torch.zeros((B, K, (S - 1) * K), dtype=torch.bool, device=dev)
        for i in range(S - 1):
            anc = advance_visibility(anc, pb, i)
            sc.follow(prep, kv, pb, i)
            tp, ti, q = self._select(self.decode_logits(ids.view(B, K), sc.step_batch(i, anc)), sampling, i + 1, L_t)
            qs.append(q)
            ids, hid, scores, pb, blk = self.topk_stage(i + 1, tp, ti, hid, scores)
            blocks.append(blk)
        prep.end_scratch(sc.state)
        if sampling is None:
            return blocks, None
        # chain: node j (depth j) is followed by the token sampled from q_j
        draft_probs = torch.stack(qs + [torch.zeros_like(qs[0])], 1)[:, : self.N]  # [B, N, V]
        return blocks, draft_probs

