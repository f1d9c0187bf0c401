"""What every speculation policy shares: per-request limits, the keep-a-top-slice selection, what it learns from
each verify, and the telemetry metrics.json shows.

A policy is one class in specpipe/speculation/<option>.py named by its schema's `_target_`
(`config.speculation`). `decode.speculative.SpecPipeline` calls, per step:
  limits(reqs, L, waiting) -> [B]              most draft tokens each request may verify (0: a plain step)
  skip_draft(limits) -> bool                   no drafting at all this step (every request decodes plainly)
  shape(tree, draft_probs, conf, limits, L_t)  the tree to verify (`speculation.trim`)
  observe(...)                                 after the commit: what was accepted, and what the step cost
"""
from __future__ import annotations

import time
from collections import Counter
from typing import Optional

import numpy as np

from specpipe.speculation.acceptance import Acceptance, accepted_nodes
from specpipe.speculation.trim import HostTree, trim

CONTEXT_BINS = (0, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)  # acceptance vs context length


class Policy:
    compact = True  # verify only the kept nodes (static: the whole tree, dropped nodes unlinked)

    def __init__(self, s, num_draft_tokens: int, num_steps: int):
        self.N, self.S = num_draft_tokens, num_steps
        self.max_context = s.get("max_context")
        self.acceptance = Acceptance()
        self.widths: Counter = Counter()  # verify width (root included) -> steps
        self.by_context = np.zeros((len(CONTEXT_BINS), 2))  # per context bin: rounds, drafts accepted
        self.buckets: Optional[list] = None  # widths a compiled verify is laid out at (None: any width)
        self.skipped = 0  # steps that did not draft at all
        self.skipping = False  # this step did not draft
        self.drafted = False  # the step last observed verified a draft node of some request
        self.t_verify = 0.0  # when the step's verify work began (after drafting)
        self.verified: Optional[HostTree] = None  # the host view of the tree the step verifies (None: not read)

    @classmethod
    def build(cls, cfg, num_draft_tokens: int, num_steps: int, target=None) -> "Policy":
        """The policy `cfg.speculation` names; `target`: the loaded target model (`cost` keeps what it measured
        on it for later runs)."""
        return cls(cfg.speculation, num_draft_tokens, num_steps)

    @property
    def name(self) -> str:
        return type(self).__module__.rsplit(".", 1)[-1]

    # ---- what each request may draft ----------------------------------------------------
    def batch_limit(self, B: int, L: np.ndarray) -> np.ndarray:
        """[B] most draft tokens per request the policy itself allows (subclasses: schedule)."""
        return np.full(B, self.N - 1, dtype=np.int64)

    def limits(self, reqs, L: np.ndarray, waiting: int = 0) -> np.ndarray:
        """[B] most draft tokens each request verifies: the policy's, a prompt's `speculate: false` and
        `max_spec_tokens`, and speculation.max_context (a longer context decodes plainly). `waiting`: requests
        queued for a row (`cost` weighs what a token is worth by it)."""
        lim = self.batch_limit(len(reqs), L)
        own = np.asarray([self.N - 1 if r.max_spec_tokens is None else r.max_spec_tokens for r in reqs],
                         dtype=np.int64)
        off = np.asarray([not r.speculate for r in reqs])
        if self.max_context is not None:
            off |= L + 1 > self.max_context
        return np.where(off, 0, np.minimum(lim, own))

    def skip_draft(self, limits: np.ndarray) -> bool:
        return not limits.any()

    # ---- which nodes a step verifies ---------------------------------------------------
    def keep(self, ht: HostTree, conf, limits: np.ndarray) -> np.ndarray:
        """[B, N] the nodes to verify: each request's `limits` best by estimated path probability."""
        return self.top_slice(self.probs(ht, conf), ht.depth, limits)

    def probs(self, ht: HostTree, conf) -> np.ndarray:
        return self.acceptance.path_probs(ht.parent, ht.depth, ht.mask, conf, ht.rank)

    @staticmethod
    def top_slice(p: np.ndarray, depth: np.ndarray, limits: np.ndarray) -> np.ndarray:
        """[B, N] each row's root and its `limits` most probable nodes; ties go to the shallower, then the earlier
        node, so a parent (never less probable than its child) always ranks first: the slice is a tree."""
        B, N = p.shape
        order = np.lexsort((np.broadcast_to(np.arange(N), (B, N)), depth, -p), axis=1)
        rank = np.empty_like(order)
        np.put_along_axis(rank, order, np.arange(N), 1)
        return (rank <= limits[:, None]) & ((p > 0) | (np.arange(N) == 0))

    def shape(self, tree, draft_probs, conf, limits: np.ndarray, L_t):
        """The tree this step verifies, its draft_probs and conf in the same node order (L_t [B]: root positions)."""
        self.verified, self.skipping = None, False
        if not self.compact and (limits >= self.N - 1).all():  # static, no limit in play: no host read at all
            return tree, draft_probs, conf
        ht = HostTree.of(tree)
        keep = self.keep(ht, conf, limits)
        if keep.all():
            self.verified = ht
            return tree, draft_probs, conf
        width = self.layout_width(len(keep), int(keep.sum(1).max()))
        tree, self.verified, draft_probs, conf = trim(tree, ht, keep, L_t, self.compact, width, draft_probs, conf)
        return tree, draft_probs, conf

    def pad_to(self, B: int, n: int) -> int:
        """The width a step that verifies n nodes per request is laid out at (n, or wider where that is cheaper:
        `cost`)."""
        return n

    def layout_width(self, B: int, n: int) -> int:
        """The width a step verifying n nodes per request is laid out at. A compiled verify rounds it up to a bucket,
        and to the smallest bucket it has not run yet while there is one: the first steps meet every bucket, so
        every graph compiles during warm-up, not when a later step first widens."""
        w = self.pad_to(B, n)
        if self.buckets is None:
            return w
        fits = [b for b in self.buckets if b >= w]
        return next((b for b in fits if b not in self.widths), fits[0])

    def bucketed(self, n: int) -> None:
        """A compiled verify: lay trees out at powers of two up to the full width (log2 N graphs, not N)."""
        self.buckets = sorted({min(1 << i, n) for i in range(n.bit_length() + 1)} | {n})

    # ---- what a step teaches ------------------------------------------------------------
    def verify_begins(self) -> None:
        self.t_verify = time.perf_counter()

    def observe(self, tree, conf, counts: np.ndarray, ranks: np.ndarray, L: np.ndarray, draft_s: float,
                compiled: bool = False) -> None:
        """After the commit: the verified tree, drafts accepted [B] and the sibling rank accepted at each depth
        [B, S] (read back with the commit), contexts L [B], and the draft stage's seconds. `compiled`: the step
        compiled a graph, so its time is not what the step costs (a width first met would look too dear to
        choose again)."""
        B, width = tree.tokens.shape
        self.widths[width] += 1
        ht = self.verified
        drafted = (ht.parent >= 0).any(1) if ht is not None and width > 1 else np.zeros(B, dtype=bool)
        self.drafted = bool(drafted.any()) if ht is not None or self.skipping else width > 1  # (unread: static's)
        if drafted.any():
            accepted = accepted_nodes(ht.mask, ht.depth, ht.rank, counts, ranks)
            self.acceptance.observe(ht.parent, ht.depth, conf, accepted, ht.rank)
            bins = np.searchsorted(CONTEXT_BINS, L, side="right") - 1
            np.add.at(self.by_context, (bins[drafted], 0), 1)
            np.add.at(self.by_context, (bins[drafted], 1), counts[drafted])
        if not compiled:
            self.learn_cost(B, width, time.perf_counter() - self.t_verify, draft_s, bool(drafted.any()))

    def learn_cost(self, B: int, width: int, verify_s: float, draft_s: float, drafted: bool) -> None:
        """What the step cost at this verify width (padding included), and whether it verified any draft."""

    def skipped_step(self) -> None:
        self.skipped += 1
        self.verified, self.skipping = None, True

    def summary(self) -> dict:
        """metrics.json's `speculation`: the policy, the verify widths chosen, acceptance by context length."""
        rounds = self.by_context[:, 0]
        return {
            "policy": self.name,
            "verify_width_histogram": {int(w): n for w, n in sorted(self.widths.items())},
            "steps_without_draft": self.skipped,
            "acceptance_by_context": [
                {"context_from": CONTEXT_BINS[i], "rounds": int(rounds[i]),
                 "mean_accepted": float(self.by_context[i, 1] / rounds[i])}
                for i in range(len(CONTEXT_BINS)) if rounds[i]],
            "cost_curve_ms": self.cost_curve(),
        }

    def cost_curve(self) -> Optional[dict]:
        return None
