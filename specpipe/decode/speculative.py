"""One speculative round per step: propose a tree, verify it with one target forward, commit.

Carried per running request (device tensors, request-major): last_token [B], the last committed
token (its KV is not in the target cache yet; position L_b), plus whatever the proposer keeps.
The step has one host sync: reading the committed tokens to check stop conditions.
"""
from __future__ import annotations

import time
from typing import Optional

import numpy as np
import torch
from omegaconf import OmegaConf
from torch import Tensor

from specpipe.decode.metrics import recompile_count
from specpipe.decode.pipeline import Pipeline
from specpipe.grammar.tree import apply
from specpipe.stages.tree_layout import root_only_tree
from specpipe.speculation.static import StaticPolicy
from specpipe.speculation.trim import HostTree
from specpipe.stages.draft_scratch import scratch_tokens_per_request
from specpipe.stages.padding import bucket
from specpipe.stages.prepare_decode import OutOfKVMemory
from specpipe.stages.verify import Verify, commit_moves, round_stats, tree_batch
from specpipe.stages.verify_sampling import VerifySampling


class SpecPipeline(Pipeline):
    def __init__(self, target, proposer, allocator, device, max_requests, max_context, eos_token_id, metrics,
                 num_steps: int, num_draft_tokens: int, wrap, sampling=None, policy=None):
        super().__init__(target, allocator, device, max_requests, max_context, eos_token_id, metrics, sampling)
        self.S, self.N = num_steps, num_draft_tokens
        self.policy = policy if policy is not None else StaticPolicy(OmegaConf.create({}), num_draft_tokens,
                                                                         num_steps)
        self.growth = num_draft_tokens
        self.proposer = proposer
        proposer.report_conf = self.policy.compact  # the trimming policies rank nodes by it
        if proposer.conf_is_probability:
            self.policy.acceptance.prior_from_conf()
        self.fused_verify = False  # rounds verify through one `verify.round` call (run.plan_rounds decides)
        self.node_allowed = None  # [B, N, V] bool: each tree node's grammar mask this step (None: no constraint)
        # the draft flags verify.round reads for drafters that raise none (n-gram, suffix): sliced, never allocated
        # per round
        self.no_draft_flags = torch.zeros(max_requests, dtype=torch.bool, device=self.dev)
        self.feature_layers = getattr(proposer, "feature_layers", None)
        self.verify = Verify(target, num_steps, self.feature_layers)
        self.verify_sampling = VerifySampling(num_steps)
        self.prefill.feature_layers = self.feature_layers
        self.stages = [*proposer.stages, self.verify, self.verify_sampling, self.prefill, self.prep]
        for st in self.stages:
            st.bind(wrap)

    def join(self, reqs, pf, first) -> None:
        self.proposer.join(self, reqs, pf, first)
        super().join(reqs, pf, first)

    def keep(self, keep_t) -> None:
        super().keep(keep_t)
        self.proposer.keep(keep_t)

    def drop_finished(self) -> list:
        done = super().drop_finished()
        if done:
            self.proposer.finish(done)
        return done

    def scratch_tokens(self, batch_size):
        per_request = scratch_tokens_per_request(self.prep.ps, self.proposer.K, self.proposer.scratch_width)
        return batch_size * per_request

    def tree_slots(self, rows_t, L, L_t, N: int) -> tuple[Tensor, Tensor]:
        """The tree's slots (node j at table position L_b + j) [B, N] and the table columns the verify reads [B, Lv]."""
        return (self.prep.slots(rows_t, L_t, N),
                self.prep.slots(rows_t, torch.zeros_like(L_t), bucket(L.max() + N)))

    def draft(self, rows_t, L, L_t, limits):
        """The round's tree as the speculation policy shapes it, its draft probabilities and node confidences
        (`Proposer.node_conf`, host [B, N] or None): no drafting at all when no request may draft this step."""
        pol = self.policy
        if pol.skip_draft(limits):
            pol.skipped_step()
            self.proposer.bad = None
            # a plain step through the verify: the root, and padding nodes where the policy finds a wider step cheaper
            root = self.last_token[:, None].repeat(1, pol.layout_width(len(self.reqs), 1))  # [B, w]
            return root_only_tree(root, L_t), None, None
        self.proposer.node_conf = None
        tree, draft_probs = self.proposer.propose(self, rows_t, L, L_t)
        return pol.shape(tree, draft_probs, self.proposer.node_conf, limits, L_t)

    def constrain(self, tree, draft_probs, conf, limits, L_t):
        """The tree as the constrained requests' grammars allow it (`grammar.tree`): forced chains first, drafts the
        grammar forbids pruned, each node's mask kept for the verify (`node_allowed`)."""
        g = self.grammar
        ms = g.of(self.reqs) if g is not None else []
        if not any(m is not None for m in ms):
            self.node_allowed = None
            return tree, draft_probs, conf
        outs, Nv, changed = g.layout(ms, tree, limits, L_t, lambda need: self.verify_width(need, tree))
        for r, o in zip(self.reqs, outs):
            if o is not None:
                r.grammar_forced_tokens += o.forced
                r.grammar_pruned_tokens += o.pruned
        if changed:
            tree, draft_probs, conf = g.relayout(tree, outs, Nv, L_t, draft_probs, conf)
            self.policy.verified = HostTree.of(tree) if self.policy.compact else None
        self.node_allowed = g.node_masks(len(self.reqs), tree.tokens.shape[1])
        return tree, draft_probs, conf

    def verify_width(self, need: int, tree) -> int:
        """The width a constrained tree of `need` nodes is laid out at: the policy's (a static policy keeps the
        tree's width, a compiled verify pads to its bucket)."""
        pol = self.policy
        if not pol.compact:
            return max(need, tree.tokens.shape[1])
        return next((b for b in pol.buckets if b >= need), need) if pol.buckets is not None else need

    def verify_round_problem(self) -> str:
        """Why greedy rounds cannot verify through one `verify.round` call in this run ('' when they can)."""
        if not self.sampling.greedy:
            return "some request samples (verify_sampling runs those rounds)"
        if self.sampling.penalized:
            return "a repetition penalty changes each tree node's logits first"
        if self.logprobs:
            return "workload.logprobs reads the raw logits"
        return self.prep.batch_view_problem()

    def accept(self, logits, tree, draft_probs, L_t):
        """Greedy acceptance, or lossless sampling (rejection sampling for sampled chains, else target-only);
        with a repetition penalty, each node's logits are penalized for its own context (prompt, output, path)."""
        logits = apply(self.sampling.penalize_tree(logits, tree.tokens, tree.mask), self.node_allowed)
        if self.sampling.greedy:
            return self.verify.greedy(logits.argmax(-1), tree.tokens, tree.parent, tree.mask)
        s = self.sampling
        probs = self.verify_sampling.probs(logits, s.temperature, s.top_p, s.top_k, s.min_p, s.filters)
        if draft_probs is not None:
            return self.verify_sampling.sample_rejection(probs, draft_probs, tree.tokens, tree.parent, s.seed, L_t)
        return self.verify_sampling.sample(probs, tree.tokens, tree.parent, s.seed, L_t)

    def unconstrained_count(self, logits, tree):
        """[B] drafts the target's unmasked greedy choice would have accepted on this tree (None: no constraint in
        play, or sampling): acceptance without the constraint, for the telemetry."""
        if self.node_allowed is None or not self.sampling.greedy:
            return None
        return self.verify.greedy(logits.argmax(-1), tree.tokens, tree.parent, tree.mask)[1]

    def round_stats(self, tree, accept_index, logits, in_place):
        """`stages.verify.round_stats` with the proposer's non-finite draft flags."""
        return round_stats(tree.parent, accept_index, logits, in_place, self.proposer.bad)

    @torch.no_grad()
    def step(self) -> list:
        """One speculative round; returns requests retracted for lack of KV (to re-queue)."""
        retracted = self.make_room()
        if not self.reqs:
            return retracted
        B, S = len(self.reqs), self.S
        m = self.metrics
        rows_t = torch.from_numpy(self.rows).to(self.dev)
        L = self.prep.seq_len[self.rows].copy()
        L_t = torch.from_numpy(L).to(self.dev)
        if self.sampling.penalized:  # contexts hold the cached tokens and the root (drafts are path tokens)
            self.sampling.limit(int(L.max()) + 1)
        t_draft, graphs = time.perf_counter(), recompile_count()
        with m.stage("draft"):
            limits = self.policy.limits(self.reqs, L, self.waiting)  # [B] draft tokens each request may verify
            tree, draft_probs, conf = self.draft(rows_t, L, L_t, limits)
        if self.grammar is not None:
            with m.stage("grammar"):
                tree, draft_probs, conf = self.constrain(tree, draft_probs, conf, limits, L_t)
        self.policy.verify_begins()
        draft_s = self.policy.t_verify - t_draft - self.proposer.untimed_s
        self.proposer.untimed_s = 0.0
        N = tree.tokens.shape[1]  # the verify width this step
        fused = self.fused_verify and self.node_allowed is None  # (grammar masks apply between forward and accept)
        with m.stage("prepare_decode"):
            if not self.prep.reserve(self.rows, np.full(B, N, dtype=np.int64)):
                raise OutOfKVMemory("KV pool exhausted before verify")
            vslots, kv_slots = self.tree_slots(rows_t, L, L_t, N)
        with m.stage("verify"):
            if fused:
                bad = self.proposer.bad if self.proposer.bad is not None else self.no_draft_flags[:B]
                vhidden, accept_index, count, commit, src, tgt, ints, *next_start = self.verify.round(
                    tree.tokens, tree.positions, tree.mask, tree.parent, tree.depth, vslots, kv_slots, L_t, bad,
                    self.prep.table[rows_t] if self.verify.draft is not None else vslots)
                raw = free = None
            else:
                vbatch = self.prep.decorate(tree_batch(tree.positions, tree.mask, tree.depth, vslots, kv_slots, L_t))
                logits, vhidden = self.verify.target_forward(tree.tokens, vbatch)
                raw = self.raw_logits(logits)
                accept_index, count, commit = self.accept(logits, tree, draft_probs, L_t)
                self.sampling.note(commit, count)
                free = self.unconstrained_count(logits, tree)
        with m.stage("commit"):
            d = torch.arange(S + 1, device=self.dev)
            if not fused:
                src, tgt, in_place = commit_moves(vslots, accept_index, count)
                ints = torch.cat([count[:, None], commit, self.round_stats(tree, accept_index, logits, in_place)], 1)
            host, lps = self.read_back(ints,  # the one host sync of the step
                                       self.token_logprobs(raw, commit, accept_index.clamp(min=0)))
            kept = self.commit_host(host, lps)
            if not fused and free is not None:
                for r, n in zip(self.reqs, free.tolist()):
                    r.unconstrained_accepted_tokens += n
            kept_t = torch.from_numpy(kept).to(self.dev)
            if not all(h[-2] for h in host):  # (kept <= count + 1: a request stopped early keeps fewer)
                # entries that need no move copy a slot onto itself, so the copy has a fixed size (no
                # boolean indexing, which would read the mask back to the host on an accelerator)
                move = (d[None, :] < kept_t[:, None]) & (src != tgt)
                self.prep.move_kv(self.target.kv, torch.where(move, tgt, src).reshape(-1), src.reshape(-1))
            unfinished = np.asarray([not r.finished for r in self.reqs])
            self.prep.commit(self.rows[unfinished], (L + kept)[unfinished])
            self.prep.after_commit(self.rows[unfinished])
        counts = np.asarray([h[0] for h in host], dtype=np.int64)
        with m.stage("draft_extend"):
            if fused and next_start[0] is not None and np.array_equal(kept[unfinished], counts[unfinished] + 1):
                # verify.round already ran the head's extend as if every request kept count + 1 tokens: those that
                # go on did (the others leave the batch in drop_finished)
                self.proposer.topk_p, self.proposer.topk_index, self.proposer.draft_hidden, self.last_token = next_start
            elif unfinished.any():
                self.extend_drafter(unfinished, commit, vhidden, accept_index, L_t, kept_t, rows_t)
        self.policy.observe(tree, conf, counts, np.asarray([h[S + 2: 2 * S + 2] for h in host]), L, draft_s,
                            compiled=recompile_count() != graphs)
        m.step_plain = not self.policy.drafted
        self.drop_finished()
        m.num_verify_steps += 1
        return retracted

    def commit_host(self, host: list, lps) -> np.ndarray:
        """The commit's host side: each request's tokens, the run's and each request's counts; [B] tokens kept."""
        S = self.S
        kept = np.asarray([self.commit_request(r, h, None if lps is None else lps[i])
                           for i, (r, h) in enumerate(zip(self.reqs, host))])
        self.metrics.record_round([h[0] for h in host], [h[S + 2: 2 * S + 2] for h in host], [h[-3] for h in host])
        for r, h in zip(self.reqs, host):
            count_request(r, h[0], h[-3])
        return kept

    def extend_drafter(self, unfinished, commit, vhidden, accept_index, L_t, kept_t, rows_t) -> None:
        """The drafter takes in the committed tokens of the requests that go on; each one's newest token becomes
        the next round's root."""
        old_last = self.last_token
        u = torch.from_numpy(np.flatnonzero(unfinished)).to(self.dev)
        self.proposer.after_verify(self, u, commit, vhidden, accept_index, L_t, kept_t, rows_t, old_last)
        self.last_token = old_last.clone()
        self.last_token[u] = commit[u].gather(1, (kept_t[u] - 1)[:, None])[:, 0]

    def commit_request(self, req, h: list, logprobs: Optional[list] = None) -> int:
        """Host side of one request's round: h = [count, commit (S+1), ranks (S), linked, in place, status]; logprobs:
        the raw target log-probability of each committed token (workload.logprobs)."""
        if h[-1] != 1:
            who = "target" if h[-1] == 0 else "draft"
            self.fail(req, f"the {who}'s logits contained NaN or inf; this request was stopped")
            return 0
        return self.append_checked(req, h[1: h[0] + 2], logprobs)


def count_request(r, accepted: int, drafted: int) -> None:
    """A request's own telemetry for one round: draft tokens verified, accepted, and its histogram."""
    r.num_draft_tokens += drafted
    r.num_accepted_tokens += accepted
    if len(r.accept_histogram) <= accepted:
        r.accept_histogram.extend([0] * (accepted + 1 - len(r.accept_histogram)))
    r.accept_histogram[accepted] += 1
