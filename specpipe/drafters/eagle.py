"""draft=eagle: an EAGLE head drafts a tree from the target's hidden states (EAGLE-1/2 heads, and EAGLE-3 heads,
which read several of the target's layers: `feature_layers`)."""
from __future__ import annotations

import time
from functools import partial

import numpy as np
import torch

from specpipe.config.schema import EagleDraftConf
from specpipe.drafters.base import DraftSetup, Proposer, non_finite
from specpipe.drafters.held_extend import HeldTokens
from specpipe.errors import ConfigError
from specpipe.models.attention_batch import extend_batch
from specpipe.models.cache import no_head_message
from specpipe.stages.build_tree import BuildTree, Tree
from specpipe.stages.draft_forward import advance_visibility, DraftForward
from specpipe.stages.draft_loop import DraftLoop
from specpipe.stages.draft_topk import DraftTopK
from specpipe.stages.padding import bucket
from specpipe.stages.prepare_decode import OutOfKVMemory


class EagleProposer(Proposer):
    """An EAGLE head (EAGLE-1/2, or EAGLE-3 reading several target layers): tree drafting from the target's hidden
    states, its KV in a pool indexed by the target's slots."""

    conf_is_probability = True  # node_conf: the head's softmax probability of the node given its parent

    @classmethod
    def build(cls, cfg, pair, setup: DraftSetup) -> "EagleProposer":
        d = cfg.draft
        if pair.draft is None:  # (`models.cache.check_draft_model` says so before anything is built; a direct call too)
            raise ConfigError(no_head_message(pair, EagleDraftConf.label(d)))
        return cls(pair.draft, d.topk, d.num_steps, d.num_draft_tokens, fused_topk=bool(cfg.compile.draft_topk.fused),
                   max_requests=setup.max_requests)

    def __init__(self, head, topk: int, num_steps: int, num_draft_tokens: int, fused_topk: bool = False,
                 max_requests: int = 0):
        self.head = head
        self.K, self.S, self.N = topk, num_steps, num_draft_tokens
        self.topk_stage = DraftTopK(topk, fused_topk)
        self.tree_stage = BuildTree(topk, num_steps, num_draft_tokens)
        self.draft_fwd = DraftForward(head, topk)
        self.loop = DraftLoop(self.draft_fwd, self.topk_stage, self.tree_stage, num_steps)
        self.stages = [self.topk_stage, self.tree_stage, self.draft_fwd, self.loop]
        self.one_call = False  # the round's steps run as one `draft_loop.steps` call (see plan_rounds)
        self.bad = None  # [B] draft logits non-finite this round
        self.feature_layers = getattr(head, "aux_layers", None)  # EAGLE-3 reads several target layers
        self.topk_p = self.topk_index = self.draft_hidden = None
        self.windowed = any(getattr(m, "window", None) is not None for m in head.modules())  # banded prefill
        self._decode_fn = None  # see _decode
        self.max_requests = max_requests
        self.held = None  # HeldTokens where the extend may wait for the next round that drafts (`plan`)
        self.drafted = False  # propose ran since the last verify

    def join(self, pipe, reqs, pf, first) -> None:
        """Draft extend over the prompt: position p takes (token x_{p+1}, target hidden h_p); packed (no padding)
        when the target's prefill ran packed."""
        ids = pf.ids
        ids_d = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], 1).scatter(1, pf.last[:, None], first[:, None])
        # packed, the prompts are segments of one row while `pf.ends` has one entry per prompt; a compiled or
        # graphed extend takes the padded form, whose inputs all have one row per prompt (one batch size). A head
        # with sliding-window layers prefills eagerly: its banded attention loops over the prompt's length, which
        # a compiled extend specialized (a recompile for every new prompt length, then eager past the limit)
        extend, compiled = self.draft_fwd.extend, "extend" in getattr(self.draft_fwd, "wrapped", ())
        if compiled and self.windowed:
            extend, compiled = partial(type(self.draft_fwd).extend, self.draft_fwd), False
        if pf.packed_for(self.head) and not compiled:
            p, idx, h = extend(ids_d.reshape(1, -1)[:, pf.flat], pf.packed_hidden, pf.packed, pf.ends)
        else:
            p, idx, h = extend(ids_d, pf.hidden, pf.batch, pf.last)
        if self.held is not None:
            self.held.caught_up(pf.rows, pipe.prep.seq_len[pf.rows])  # (the prefill committed them)
        if self.topk_p is None or self.topk_p.shape[0] == 0:
            self.topk_p, self.topk_index, self.draft_hidden = p, idx, h
        else:
            self.topk_p = torch.cat([self.topk_p, p])
            self.topk_index = torch.cat([self.topk_index, idx])
            self.draft_hidden = torch.cat([self.draft_hidden, h])

    def keep(self, keep_t) -> None:
        self.topk_p, self.topk_index = self.topk_p[keep_t], self.topk_index[keep_t]
        self.draft_hidden = self.draft_hidden[keep_t]

    @property
    def scratch_width(self) -> int:
        return EagleDraftConf.scratch_columns(self.S)

    @property
    def round_extend(self):
        """A fused `verify.round` runs the head's extend over the committed tokens inside its call."""
        return self.draft_fwd

    def _decode(self):
        """The draft decode the rounds call, resolved once after the stage's branches were bound (compiled or eager
        as the policy says, a sliding-window head's too)."""
        if self._decode_fn is None:
            fwd = self.draft_fwd
            self._decode_fn = fwd.decode
        return self._decode_fn

    def plan_rounds(self, prep) -> str:
        """Whether the rounds' steps run as one `draft_loop.steps` call: when its policy wrapped it and the
        allocator's attention batches need no host-side views (either scratch layout runs inside it). Returns why
        not when the policy asked for it and the allocator cannot ('' otherwise)."""
        asked = "steps" in getattr(self.loop, "wrapped", ())
        why = prep.batch_view_problem()
        self.one_call = asked and not why
        self.loop.prep, self.loop.kv = prep, self.head.kv
        return why if asked else ""

    def plan(self, cfg, prep, allocator_name: str):
        # the extend may wait over steps that draft nothing where it runs eagerly over full attention, in a pool that
        # frees no slot mid-run (a window pool could hand a held position's slot on before the head writes it)
        eager = "extend" not in getattr(self.draft_fwd, "wrapped", ())
        if eager and not self.windowed and allocator_name in ("token", "paged") and self.max_requests:
            self.held = HeldTokens(self.max_requests, self.S + 1)
        why = self.plan_rounds(prep)
        if not why:
            return None
        return (f"compile.draft_loop.steps={cfg.compile.draft_loop.steps}",
                f"the draft steps run one call each with allocator={allocator_name}, since {why}; "
                "compile.draft_forward.decode and compile.draft_topk.* set how those calls run")

    def propose(self, pipe, rows_t, L, L_t):
        t = time.perf_counter()
        self.catch_up(pipe)
        self.untimed_s = time.perf_counter() - t
        self.drafted = True
        B, prep, kv = len(pipe.reqs), pipe.prep, self.head.kv
        sc = prep.draft_scratch(pipe.rows, rows_t, L, L_t, self.K, self.S - 1)
        if sc is None:
            raise OutOfKVMemory("KV pool exhausted while drafting")
        if self.one_call:  # batches need no host-side decoration: the round's steps are one tensor function
            sc.begin(prep, kv)  # (page-aligned regions: the mirror of the prefix's partial page, sized on the host)
            self.loop.layout, self.loop.first = type(sc), sc.first  # the layout draft_scratch chose (not re-derived)
            tree, self.bad = self.loop.steps(self.topk_p, self.topk_index, self.draft_hidden, pipe.last_token, L_t,
                                             *sc.tensors())
            prep.end_scratch(sc.state)
            return Tree(*tree), None
        blocks = self.step_by_step(prep, kv, sc, B)
        prep.end_scratch(sc.state)
        s_l, t_l, p_l = (list(x) for x in zip(*blocks))
        self.bad = non_finite(s_l, B)
        tree = self.tree_stage(pipe.last_token, s_l, t_l, p_l, L_t)
        if self.report_conf:
            self.node_conf = conditional_probs(s_l, tree.parent, self.tree_stage.num_draft_tokens)
        return tree, None

    def step_by_step(self, prep, kv, sc, B: int) -> list:
        """The round's tree steps, one call per draft forward and top-k, each under its own policy."""
        K, S = self.K, self.S
        sc.begin(prep, kv)
        anc = torch.zeros((B, K, (S - 1) * K), dtype=torch.bool, device=prep.device)
        decode = self._decode()
        ids, hid, scores, pb, blk = self.topk_stage(0, self.topk_p, self.topk_index, self.draft_hidden, None)
        blocks = [blk]
        for i in range(S - 1):
            anc = advance_visibility(anc, pb, i)
            sc.follow(prep, kv, pb, i)
            batch = prep.decorate(sc.step_batch(i, anc))
            tp, ti, hout = decode(ids.view(B, K), hid.view(B, K, -1), batch)
            ids, hid, scores, pb, blk = self.topk_stage(i + 1, tp, ti, hout, scores)
            blocks.append(blk)
        return blocks

    def after_verify(self, pipe, u, commit, vhidden, accept_index, L_t, kept_t, rows_t, old_last) -> None:
        """Draft over the committed tokens so the next round starts from the new bonus token."""
        H = vhidden.shape[-1]
        hid = vhidden.gather(1, accept_index.clamp(min=0)[:, :, None].expand(-1, -1, H))[u]  # [B', S+1, H]
        ids, lens, starts = commit[u], kept_t[u], L_t[u]
        live = pipe.rows[[not r.finished for r in pipe.reqs]]  # the rows of u, on the host
        seq = pipe.prep.seq_len  # host lengths, already committed: no device read
        held = self.held if self.held is not None and not pipe.fused_verify else None  # (a fused round extends)
        drafted, self.drafted = self.drafted, False
        if held is not None and (not drafted or held.held[pipe.rows].any()):
            held.hold(live, rows_t[u], starts, ids, hid)  # a step that drafted nothing: the head waits
            if drafted or held.full(live, seq[live]):
                self.catch_up(pipe, live)
            return
        batch = pipe.prep.decorate(extend_batch(pipe.prep.table, rows_t[u], starts, lens, self.S + 1,
                                                bucket(int(seq[pipe.rows].max()))))
        p, idx, h = self.draft_fwd.extend(ids, hid, batch, lens - 1)
        self.topk_p[u], self.topk_index[u], self.draft_hidden[u] = p, idx, h
        if held is not None:
            held.caught_up(live, seq[live])

    def catch_up(self, pipe, live=None) -> None:
        """The head extends over every token held for the batch's rows (`live`: only those rows), in one call, so
        its next start is the one a round drafts from."""
        held, rows = self.held, pipe.rows
        if held is None:
            return
        seq = pipe.prep.seq_len[rows]
        b, n = held.pending(rows, seq, live)
        if not len(b):
            return
        dev = pipe.dev
        r_t, lens = torch.from_numpy(rows[b]).to(dev), torch.from_numpy(n).to(dev)
        starts = torch.from_numpy(held.covered[rows[b]]).to(dev)
        Q = int(n.max())
        batch = pipe.prep.decorate(extend_batch(pipe.prep.table, r_t, starts, lens, Q, bucket(int(seq[b].max()))))
        p, idx, h = self.draft_fwd.extend(held.ids[r_t, :Q], held.hidden[r_t, :Q], batch, lens - 1)
        b_t = torch.from_numpy(b).to(dev)
        self.topk_p[b_t], self.topk_index[b_t], self.draft_hidden[b_t] = p, idx, h
        held.caught_up(rows[b], seq[b])


def conditional_probs(score_list: list, parent: torch.Tensor, N: int) -> np.ndarray:
    """Host [B, N]: each tree node's draft probability given its parent (`Proposer.node_conf`). The scores are
    cumulative path probabilities; `BuildTree` keeps the N-1 best in ascending id order, so the same selection
    finds each node's, and a node's over its parent's is its own step's probability."""
    B = parent.shape[0]
    scores = torch.cat([s.reshape(B, -1) for s in score_list], 1).float().cpu().numpy()  # [B, M]
    sel = np.sort(np.argsort(-scores, axis=1, kind="stable")[:, : N - 1], axis=1)
    path = np.concatenate([np.ones((B, 1)), np.take_along_axis(scores, sel, 1)], 1)
    par = parent.cpu().numpy()
    above = np.take_along_axis(path, np.maximum(par, 0), 1)
    conf = np.where(par >= 0, path / np.maximum(above, 1e-30), 0.0)
    conf[:, 0] = 1.0
    return np.clip(conf, 0.0, 1.0)
