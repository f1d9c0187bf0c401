"""speculation=cost: each step, the verify width that maximises expected committed tokens per second.

For a batch of B requests and a verify width n (root included), a step commits B + E(n) tokens, E(n) the sum of
the kept nodes' estimated acceptance chances (each request keeps its n-1 most probable nodes: in the padded verify
batch they cost the same), and takes c(B, n) + d seconds: the verify side (prepare, forward, commit, the draft's
extend) measured per (B, n) as the run goes, and the draft stage d. n = 1 is a plain step: speculation off.

A token is worth the same in every request only while requests queue for a row: a request that finishes early
hands its row on. Once the queue is empty the batch drains, and the run ends with its slowest request: a token
accepted for a request that will finish before others saves nothing (on a real model at batch 8 with code
prompts, verifying 4 tokens per request cut the steps from 64 to 58 at twice a plain step's cost). So while
draining, each request's acceptance counts in proportion to how close it is to being the last to finish (its
tokens left over its tokens per step so far, `worth`), and E(n) is B times that weighted sum: with every
request level it is the plain sum again.

The curve starts unmeasured and is explored from the cheap end: a plain step first, then never wider than twice the
widest width measured so far (1, 2, 4, 8, ...). Past the widest measured width the curve follows its last segment's
slope, or is taken as flat while that segment starts at one row (an optimistic guess: a width is tried when it would
pay at that cost, and once measured it is known). Exploring from the full width instead cost a batch of 8 on a real
model as much as 3 plain steps, for a width it then never chose; extrapolating the first segment's slope (one row to
two is a jump on CPU: GEMV to GEMM) ruled out the full trees that paid on the shipped pair; a flat guess past 8 had
the same batch try 16 tokens a request (426 ms, six plain steps) where 4 to 8 had already risen 23 ms a token.
Timing noise only ever slows a step, so a point's first SEEN measurements keep their minimum; later ones move an
average (contexts grow). A fixed curve may be given instead: speculation.cost_ms. Later runs on the same loaded
target and settings go on from the curve measured so far (`LEARNED`).

A width past the plain step must promise min_gain more tokens per second than it (the argmax of noisy estimates is
biased up: choosing among them overrates the one chosen). A draft already made is verified at whatever width pays
from there, but drafting itself must pay too: a step whose best rate, draft stage included, is under a plain step's
without one (B over a plain step's cost, laid out at its cheapest width) counts as a step without a draft. After
skip_after such steps in a row, drafting pauses (its cost saved), and a probe drafts again every skip_after-th step.
Each probe that finds nothing worth making doubles the gap to the next, up to the gap at which probes cost PROBE of
the paused steps' time; a draft that pays resumes drafting. A cheap drafter keeps probing often (drafts come in
bursts: a repeated line); a dear one stops paying for probes that fail. (A weak EAGLE head on SmolLM2 drafted every
step for 0.3 accepted tokens at 22 ms, over a third of a 58 ms step: 0.82x plain. Its failed probes now back off to
every 19th step; an n-gram drafter's 1 ms stays at every 4th.)

A step is laid out wider than its nodes need (padding nodes, never accepted) when a wider measured width costs less:
on CPU, oneDNN's packed GEMMs run one row slower than four (SmolLM2's lm_head: 6.9 ms at one row, 5.6 ms at four),
so a batch of one verified 5 tokens in 48 ms and 1 in 53 ms.
"""
from __future__ import annotations

import weakref
from typing import Optional

import numpy as np
from omegaconf import OmegaConf

from specpipe.speculation.base import Policy

EMA = 0.25  # weight of a new measurement of c(B, n)
FREE = 0.03  # the full padded width counts as free when it costs at most this much more than the chosen one
PAD = 0.03  # a step is padded to a wider width that costs at least this much less (both measured, SEEN times)
SEEN = 3
PROBE = 0.02  # failed probes back off until they cost this share of the paused steps' time
MOST_PAUSED = 64  # steps between probes at most
LAST = 2.0  # steps: while draining, a request this many steps from the last to finish counts 1/e as much


class CostCurve:
    """c(B, n) in seconds: measured points per batch size, linear between them, flat before the first, the last
    segment's slope after the last."""

    def __init__(self, fixed: Optional[dict] = None):
        self.points: dict[int, dict[int, float]] = {}
        self.seen: dict[tuple[int, int], int] = {}  # (B, n) -> measurements
        self.fixed = fixed is not None
        for b, row in (fixed or {}).items():
            self.points[int(b)] = {int(n): float(ms) / 1000 for n, ms in row.items()}
            self.seen.update({(int(b), int(n)): SEEN for n in row})

    def learn(self, B: int, n: int, seconds: float) -> None:
        if self.fixed:
            return
        row = self.points.setdefault(B, {})
        seen = self.seen.get((B, n), 0)
        row[n] = min(row.get(n, seconds), seconds) if seen < SEEN else (1 - EMA) * row[n] + EMA * seconds
        self.seen[B, n] = seen + 1

    def sure(self, B: int, most: int) -> dict[int, float]:
        """B's widths up to `most` measured SEEN times, and what each costs."""
        return {w: c for w, c in self.points.get(B, {}).items() if w <= most and self.seen.get((B, w), 0) >= SEEN}

    def cheapest(self, B: int, n: int, most: int) -> int:
        """The measured width in [n, most] that costs least at B, when it undercuts n's own cost by PAD (else n)."""
        sure = {w: c for w, c in self.sure(B, most).items() if w >= n}
        if n not in sure:
            return n
        w = min(sure, key=sure.get)
        return w if sure[w] < (1 - PAD) * sure[n] else n

    def laid_out(self, B: int, widths: np.ndarray, most: int) -> np.ndarray:
        """c(B, n) for each width n as the step is laid out: at `cheapest`'s wider measured width where it pays."""
        cost = self(B, widths)
        sure = self.sure(B, most)
        if not sure:
            return cost
        ws, cs = np.fromiter(sure, dtype=np.int64), np.fromiter(sure.values(), dtype=np.float64)
        best = np.where(ws[None, :] >= widths[:, None], cs[None, :], np.inf).min(1)
        return np.where(best < (1 - PAD) * cost, best, cost)

    def known(self, B: int, n: Optional[int] = None) -> bool:
        """Whether B has a measured point at n; without n, whether the curve at B can be estimated (two points at
        B, or at some batch size whose shape B borrows)."""
        if self.fixed and self.points:
            return True
        if n is not None:
            return n in self.points.get(B, {})
        return any(len(r) >= 2 for r in self.points.values())

    def row(self, B: int) -> dict:
        """B's points. A batch size with fewer than two borrows the shape of the nearest one with two or more,
        scaled to its own point where it has one: a batch that shrinks as requests finish is not explored again
        at every size (the width's effect, not the absolute cost, is what the choice depends on)."""
        own = self.points.get(B, {})
        if len(own) >= 2:
            return own
        others = [b for b, r in self.points.items() if len(r) >= 2]
        if not others:
            return own
        near = self.points[min(others, key=lambda b: (abs(b - B), b))]
        if not own:
            return near
        (n, c), = own.items()
        scale = c / float(self(min(others, key=lambda b: (abs(b - B), b)), np.asarray([n]))[0])
        return {k: v * scale for k, v in near.items()}

    def __call__(self, B: int, widths: np.ndarray) -> np.ndarray:
        row = self.row(B)
        ns = np.asarray(sorted(row), dtype=np.float64)
        cs = np.asarray([row[n] for n in sorted(row)])
        out = np.interp(widths, ns, cs)
        # past the last point, the last segment's slope (never falling); a learned curve whose last segment starts
        # at one row is guessed flat there instead (one row to two is the GEMV-to-GEMM jump on CPU, not a slope)
        if len(ns) > 1 and (self.fixed or ns[-2] >= 2):
            slope = max(0.0, (cs[-1] - cs[-2]) / (ns[-1] - ns[-2]))
            out = np.where(widths > ns[-1], cs[-1] + slope * (widths - ns[-1]), out)
        return out


# target model -> {the settings a step's cost depends on: (curve, draft stage seconds per batch size)}
LEARNED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
COST_GROUPS = ("device", "compile", "allocator", "draft", "sampling")  # the config groups that key it


class CostPolicy(Policy):
    @classmethod
    def build(cls, cfg, num_draft_tokens: int, num_steps: int, target=None) -> "CostPolicy":
        """A run with the same loaded target and the same settings (sweeps, bench rows, the Python API's calls)
        goes on from the curve the earlier runs measured: what a step costs is a property of the model, the
        device and these settings, not of one run's prompts (acceptance, which is, starts afresh)."""
        pol = cls(cfg.speculation, num_draft_tokens, num_steps)
        if target is not None and not pol.curve.fixed:
            key = OmegaConf.to_yaml({g: cfg[g] for g in COST_GROUPS if g in cfg}, resolve=True)
            pol.curve, pol.draft_s = LEARNED.setdefault(target, {}).setdefault(key, (pol.curve, pol.draft_s))
        return pol

    def __init__(self, s, num_draft_tokens: int, num_steps: int):
        super().__init__(s, num_draft_tokens, num_steps)
        self.curve = CostCurve(s.get("cost_ms"))
        self.skip_after = int(s.skip_after)
        self.min_gain = float(s.get("min_gain", 0.0))
        self.draft_s: dict[int, float] = {}  # batch size -> EMA of the draft stage
        self.plain_run = 0  # steps in a row that verified no draft
        self.paused = 0  # steps since the last probe while drafting pauses
        self.every = self.skip_after  # steps from one probe to the next
        self.warm = False  # a step has been taken
        self.proposed = False  # this step ran the drafter (its draft stage is a measurement of d)
        self.paid = False  # this step's draft, draft stage included, beat a plain step without one
        self.draining: Optional[list] = None  # this step's requests when none wait for a row (`worth`)

    def limits(self, reqs, L: np.ndarray, waiting: int = 0) -> np.ndarray:
        self.draining = None if waiting else reqs  # (weighed in `width`, only on steps that draft)
        return super().limits(reqs, L, waiting)

    def skip_draft(self, limits: np.ndarray) -> bool:
        if not limits.any():
            return True
        if self.skip_after and self.plain_run >= self.skip_after:
            self.paused += 1
            if self.paused < self.every:
                return True
            self.paused = 0  # a probe
        return False

    def widest_gap(self, B: int) -> int:
        """The most steps between probes: where the probes' draft stages cost PROBE of the paused steps' time
        (skip_after at least)."""
        d = self.draft_s.get(B)
        if not d or not self.curve.row(B):
            return self.skip_after
        plain = float(self.curve.laid_out(B, np.asarray([1]), self.N)[0])
        return int(min(MOST_PAUSED, max(self.skip_after, np.ceil(d / (PROBE * plain)))))

    def skipped_step(self) -> None:
        super().skipped_step()
        self.proposed = self.paid = False

    def keep(self, ht, conf, limits):
        self.proposed = True
        p = self.probs(ht, conf)
        n = self.width(p, limits)
        keep = self.top_slice(p, ht.depth, np.minimum(limits, n - 1))
        B, N = p.shape
        if keep.sum() == ((ht.parent >= 0) & (p > 0)).sum() + B and self.curve.known(B, N) and \
                self.curve(B, np.asarray([N]))[0] <= self.curve(B, np.asarray([n]))[0] * (1 + FREE):
            return np.ones_like(keep)  # every real draft kept, and the padding costs nothing: skip laying it out
        return keep

    def width(self, p: np.ndarray, limits: np.ndarray) -> int:
        """The verify width (root included) with the most expected tokens per second."""
        B = p.shape[0]
        self.paid = False
        most = int(np.minimum((p[:, 1:] > 0).sum(1), limits).max()) + 1
        if most == 1:
            return 1
        row = self.curve.row(B)
        if not row:  # nothing measured yet: a plain step is the curve's first point
            return 1
        tail = -np.sort(-p[:, 1:], axis=1)  # [B, N-1] most probable first
        tail = np.where(np.arange(tail.shape[1])[None, :] < limits[:, None], tail, 0.0)
        w = worth(self.draining) if self.draining is not None and len(self.draining) == B else np.full(B, 1.0 / B)
        gain = B * np.concatenate([[0.0], np.cumsum(w @ tail)])[:most]  # E(n) for n = 1..most
        widths = np.arange(1, most + 1)
        cost = self.curve.laid_out(B, widths, self.N)  # (padded where a wider width is cheaper: pad_to)
        rate = (B + gain) / (cost + self.draft_s.get(B, 0.0))
        rate[1:] /= 1 + self.min_gain  # (a draft must promise min_gain more than a plain step to be verified)
        n = int(widths[np.argmax(rate)])
        self.paid = bool(rate.max() > B / cost[0])  # against a plain step, with no draft stage at all
        return n if self.curve.fixed else min(n, 2 * max(row))  # explore at most twice the widest measured

    def pad_to(self, B: int, n: int) -> int:
        return self.curve.cheapest(B, n, self.N)

    def learn_cost(self, B: int, width: int, verify_s: float, draft_s: float, drafted: bool) -> None:
        if not self.warm:  # the run's first step pays one-time costs: not a measurement
            self.warm = True
            return
        self.curve.learn(B, width, verify_s)
        if self.proposed and draft_s > 0:  # (a paused step's few host ops are not the draft stage)
            old = self.draft_s.get(B)
            self.draft_s[B] = draft_s if old is None else (1 - EMA) * old + EMA * draft_s
        if drafted and self.paid:
            self.plain_run, self.paused, self.every = 0, 0, self.skip_after
            return
        if self.proposed and self.skip_after and self.plain_run >= self.skip_after:  # a probe found nothing
            self.every = min(2 * self.every, max(self.every, self.widest_gap(B)))
        self.plain_run += 1

    def cost_curve(self) -> Optional[dict]:
        return {int(b): {int(n): round(s * 1000, 3) for n, s in sorted(row.items())}
                for b, row in sorted(self.curve.points.items())}


def worth(reqs) -> np.ndarray:
    """[B] while a batch drains: each request's share of what an accepted token is worth, sums to 1. The run ends
    with its last request, so the share falls off (e per LAST steps) with how many steps sooner than the last one a
    request is expected to finish: its tokens left (to max_new_tokens) over its tokens per step so far."""
    out = np.asarray([len(r.output_ids) for r in reqs], dtype=np.float64)
    acc = np.asarray([r.num_accepted_tokens for r in reqs], dtype=np.float64)
    left = np.asarray([r.max_new_tokens for r in reqs], dtype=np.float64) - out
    steps = left * (out - acc + 1) / (out + 1)  # left / tokens per step (one prior step of one token)
    w = np.exp((steps - steps.max()) / LAST)
    return w / w.sum()
