"""draft=standalone: a small causal LM with the target's tokenizer drafts a chain or a tree with its own KV pool
(the model's forwards are the `standalone_draft` stage, `drafters.standalone_draft`)."""
from __future__ import annotations

from functools import partial

import torch

from specpipe.config.schema import StandaloneDraftConf
from specpipe.drafters.base import DraftSetup, Proposer, non_finite
from specpipe.drafters.standalone_draft import StandaloneDrafter
from specpipe.stages.build_tree import BuildTree, Tree


class StandaloneProposer(Proposer):
    """A small causal LM with its own KV pool drafts a chain or a tree (`drafters.standalone_draft`)."""

    @classmethod
    def build(cls, cfg, pair, setup: DraftSetup) -> "StandaloneProposer":
        """Over `pair.standalone` (`models.cache.ensure_draft_model` loads it); a chain (topk=1) samples its drafts when
        some request samples, for rejection sampling."""
        d = cfg.draft
        drafter = StandaloneDrafter(pair.standalone, d.topk, d.num_steps, d.num_draft_tokens,
                                    fused_topk=bool(cfg.compile.draft_topk.fused))
        return cls(drafter, sampled_chain=setup.sampled and d.topk == 1)

    def __init__(self, drafter, sampled_chain: bool):
        self.sd = drafter
        self.K = drafter.K
        self.sampled_chain = sampled_chain
        self.bad = None
        self.S = drafter.S
        self.tree_stage = BuildTree(drafter.K, drafter.S, drafter.N)
        self.stages = [drafter, drafter.topk_stage, self.tree_stage]
        self.windowed = any(getattr(m, "window", None) is not None for m in drafter.model.modules())

    def join(self, pipe, reqs, pf, first) -> None:
        """Draft KV over the prompts: packed when the target's prefill ran packed and the extend runs eager (a
        compiled or graphed extend takes the padded form: one row per prompt, the decode rounds' batch kind)."""
        extend, compiled = self.sd.extend, "extend" in getattr(self.sd, "wrapped", ())
        if compiled and self.windowed:  # banded prefill loops over the prompt length: eager, see EagleProposer
            extend, compiled = partial(type(self.sd).extend, self.sd), False
        if pf.packed_for(self.sd.model) and not compiled:
            extend(pf.ids.reshape(1, -1)[:, pf.flat], pf.packed)
        else:
            extend(pf.ids, pf.batch)

    @property
    def scratch_width(self) -> int:
        return StandaloneDraftConf.scratch_columns(self.S)

    def propose(self, pipe, rows_t, L, L_t):
        s = pipe.sampling
        sampling = (s.temperature, s.top_p, s.top_k, s.seed, s.min_p, s.filters) if self.sampled_chain else None
        blocks, draft_probs = self.sd.draft(pipe.prep, pipe.rows, rows_t, L, L_t, pipe.last_token, sampling=sampling)
        s_l, t_l, p_l = (list(x) for x in zip(*blocks))
        self.bad = non_finite(s_l, len(pipe.reqs))
        tree: Tree = self.tree_stage(pipe.last_token, s_l, t_l, p_l, L_t)
        return tree, draft_probs

    def after_verify(self, pipe, u, commit, vhidden, accept_index, L_t, kept_t, rows_t, old_last) -> None:
        ids = torch.cat([old_last[:, None], commit], 1)[u, : self.S + 1]
        self.sd.extend_committed(pipe.prep.table, rows_t[u], L_t[u], ids, kept_t[u],
                                 int(pipe.prep.seq_len[pipe.rows].max()))  # host lengths, already committed
