"""Grammar masks along a draft tree: each node is checked against the grammar state its path reaches.

Per constrained request, one matcher sits at the state after its committed tokens (the root included). A step
walks the tree depth first from the root: at each node the matcher's mask of allowed next tokens is written for
that node, and a child is kept only when its token is allowed there (the matcher then consumes it, walks its
subtree, and rolls back). Verification applies each node's mask to the target's logits at that node, so the
committed tokens are those plain constrained decoding commits (greedy: exactly; sampling: in distribution, with
the draft distributions masked too, `mask_draft_probs`). Drafts the grammar forbids are pruned before verify.

Jump-forward: when the grammar allows one continuation only (`{"name": "`), those forced tokens lead the tree as
a chain from the root, and the drafter's nodes whose path agrees with the chain hang under it: the drafter's
tree was drafted from the root, so only a path that spelt the forced tokens is conditioned on them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from specpipe.stages.tree_layout import host, host_links, tree_from_parents


@dataclass
class Layout:
    """One request's kept nodes in the new order: tokens, parents (new indices), the old node each came from (-1: a
    forced token the drafter did not propose)."""
    tokens: list = field(default_factory=list)
    parent: list = field(default_factory=list)
    old: list = field(default_factory=list)
    forced: int = 0  # nodes of the forced chain
    pruned: int = 0  # drafted nodes left out (the grammar forbids them, or they hang under a pruned one)

    def add(self, token: int, parent: int, old: int) -> int:
        self.tokens.append(int(token))
        self.parent.append(parent)
        self.old.append(old)
        return len(self.tokens) - 1


def allowed(row: np.ndarray, t: int) -> bool:
    """Whether mask row [W] int32 allows token t."""
    return t >= 0 and (t >> 5) < row.shape[0] and bool((int(row[t >> 5]) >> (t & 31)) & 1)


def children(parent: np.ndarray) -> list:
    """parent [N] -> each node's linked children, in node order."""
    kids: list = [[] for _ in range(parent.shape[0])]
    for j, p in enumerate(parent.tolist()):
        if p >= 0:
            kids[p].append(j)
    return kids


def walk(engine, m, tokens: np.ndarray, parent: np.ndarray, forced: list, budget: int,
         masks: np.ndarray) -> Layout:
    """The kept tree of one request: the forced chain first (merged with drafted nodes that spell it), then every
    drafted node whose token its parent's state allows, at most `budget` nodes (root included). masks [N, W]:
    row j receives new node j's mask. The matcher ends where it began."""
    kids = children(parent)
    out = Layout()
    root = out.add(tokens[0], -1, 0)

    def expand(new: int, old: int, rest: list) -> None:
        engine.fill(m, masks[new])
        if rest:  # a forced token: the only one allowed, whatever was drafted
            f = rest[0]
            if len(out.tokens) >= budget or not allowed(masks[new], f):
                return
            same = [c for c in kids[old] if int(tokens[c]) == f] if old >= 0 else []
            c = out.add(f, new, same[0] if same else -1)
            out.forced += 1
            m.consume_token(f)
            expand(c, out.old[c], rest[1:])
            m.rollback(1)
            return
        if old < 0:
            return
        for k in kids[old]:
            t = int(tokens[k])
            if len(out.tokens) >= budget:
                return
            if allowed(masks[new], t) and m.consume_token(t):
                c = out.add(t, new, k)
                expand(c, k, [])
                m.rollback(1)

    expand(root, 0, forced)
    return out


class TreeGrammar:
    """The running batch's matchers (by request), its mask buffer, and the per-step tree walk."""

    def __init__(self, engine, jump_forward: bool, max_requests: int, max_nodes: int, num_steps: int, dev):
        self.engine, self.jump_forward = engine, jump_forward
        self.S, self.dev = num_steps, dev
        self.V, W = engine.V, engine.words
        self.masks = np.full((max_requests, max_nodes, W), -1, dtype=np.int32)  # [B, N, W]: -1 allows every token
        self.matchers: dict = {}  # id(request) -> its matcher (at the state after its committed tokens)

    # ---- requests --------------------------------------------------------------------------
    def admit(self, reqs) -> list:
        """Matchers for the constrained requests among `reqs` (a resumed one's replays what it generated); those
        whose constraint cannot be built are failed (returned)."""
        failed = []
        for r in reqs:
            if r.constraint is None or id(r) in self.matchers:
                continue
            m, why = self.engine.matcher(r.constraint, r.output_ids)
            if m is None:
                r.finish_reason, r.error = "error", f"its constraint cannot be used: {why}"
                failed.append(r)
            else:
                self.matchers[id(r)] = m
        return failed

    def of(self, reqs) -> list:
        """Each request's matcher, None for free ones."""
        return [self.matchers.get(id(r)) for r in reqs]

    def finish(self, reqs) -> None:
        for r in reqs:
            self.matchers.pop(id(r), None)

    def commit(self, r, tokens: list) -> tuple[int, str]:
        """Advance r's matcher by its committed tokens: (how many it takes, why it refused the next one: a dead end;
        "" when it took them all or its grammar is complete). An EOS the grammar allows ends the request there, so what
        follows it does not matter."""
        m = self.matchers.get(id(r))
        if m is None or not tokens:
            return len(tokens), ""
        n = m.try_consume_tokens(list(tokens))
        if n == len(tokens) or (tokens[n] in self.engine.eos and (m.is_accepting() or m.is_stopped())):
            return len(tokens), ""
        if m.is_stopped() and not m.is_error():  # complete, and nothing may follow (an EOS the run ignores)
            return n, ""
        why = self.engine.error(m) or "its grammar does not allow it there"
        return n, (f"its grammar reached a dead end after {len(r.output_ids) + n} generated tokens (token "
                   f"{tokens[n]}: {why}); the output so far is kept, and does not complete the grammar")

    # ---- masks -----------------------------------------------------------------------------
    def root_masks(self, ms: list) -> Optional[Tensor]:
        """[B, V] bool: the tokens each request may take next (every token for free requests); None when no request
        is constrained."""
        if not any(m is not None for m in ms):
            return None
        B = len(ms)
        self.masks[:B, 0] = -1
        for b, m in enumerate(ms):
            if m is not None:
                self.engine.fill(m, self.masks[b, 0])
        return self.expand(self.masks[:B, :1])[:, 0]

    def expand(self, words: np.ndarray) -> Tensor:
        """[B, N, W] int32 mask words -> [B, N, V] uint8 0/1 on the device (bits unpacked on the host: one copy). A
        row that allows nothing (a node past a dead end) allows everything: it is never committed as such, because
        the commit stops at the dead end (`commit`), and a row of nothing would turn sampling's probabilities NaN."""
        empty = ~words.any(-1)
        if empty.any():
            words = np.where(empty[..., None], np.int32(-1), words)
        bits = np.unpackbits(np.ascontiguousarray(words).view(np.uint8), axis=-1, count=self.V, bitorder="little")
        return torch.from_numpy(bits).to(self.dev)

    # ---- the tree --------------------------------------------------------------------------
    def layout(self, ms: list, tree, limits: np.ndarray, L_t: Tensor, width) -> tuple:
        """Walk each constrained request's tree. Returns (layouts [B] (None: the request is free), the width to lay
        out, whether any constrained tree changed). `width(need)`: the verify width for `need` nodes (the
        policy's: the full width when it does not narrow, a compiled verify's bucket)."""
        tokens, parent = host(tree.tokens), host(tree.parent)
        B = tokens.shape[0]
        self.masks[:B] = -1
        outs, changed = [], False
        for b, m in enumerate(ms):
            if m is None:
                outs.append(None)
                continue
            budget = min(self.masks.shape[1], int(limits[b]) + 1)  # nodes, root included (the verify's room)
            forced = self.engine.forced(m)[: min(self.S, budget - 1)] if self.jump_forward and budget > 1 else []
            lay = walk(self.engine, m, tokens[b], parent[b], forced, budget, self.masks[b])
            outs.append(lay)
            drafted = int((parent[b] >= 0).sum())
            lay.pruned = drafted - sum(1 for o in lay.old[1:] if o >= 0)
            changed |= lay.old != list(range(len(lay.old))) or len(lay.old) != drafted + 1
        used = [len(o.tokens) if o is not None else linked_width(parent[b]) for b, o in enumerate(outs)]
        return outs, width(max(used)), changed

    def relayout(self, tree, outs: list, Nv: int, L_t: Tensor, draft_probs: Optional[Tensor], conf):
        """The tree of the walked layouts (free requests keep their first Nv nodes), its draft_probs (masked and
        renormalised per node) and conf, in the new order."""
        tokens, parent = host(tree.tokens), host(tree.parent)
        B, N = tokens.shape
        new_tok = np.repeat(tokens[:, :1], Nv, 1)
        new_par = np.full((B, Nv), -1, dtype=np.int64)
        old = np.full((B, Nv), -1, dtype=np.int64)
        for b, o in enumerate(outs):
            if o is None:
                n = min(N, Nv)
                new_tok[b, :n], new_par[b, :n], old[b, :n] = tokens[b, :n], parent[b, :n], np.arange(n)
            else:
                n = len(o.tokens)
                new_tok[b, :n], new_par[b, :n], old[b, :n] = o.tokens, o.parent, o.old
        t = torch.from_numpy
        new_tree = tree_from_parents(t(new_tok).to(self.dev), t(new_par).to(self.dev), L_t, self.S)
        if draft_probs is not None:
            draft_probs = self.relay_draft_probs(draft_probs, new_tok, new_par, old, outs)
        if conf is not None:
            conf = np.where(old >= 0, conf[np.arange(B)[:, None], np.maximum(old, 0)], 1.0)
        return new_tree, draft_probs, conf

    def relay_draft_probs(self, draft_probs: Tensor, tokens: np.ndarray, parent: np.ndarray, old: np.ndarray,
                          outs: list) -> Tensor:
        """Row v = the distribution v's child was drawn from, in the new order, so that rejection sampling stays
        lossless: a forced child was not drawn but proposed outright (its row is one-hot: accepted with its target
        probability, else the bonus comes from the rest of the target distribution); a drafted one was drawn from
        the drafter's row, and it was kept because the grammar allows it, so conditioned on being kept it was drawn
        from that row restricted to what the grammar allows (masked, renormalised). A pruned draft left its parent
        childless: the bonus there is drawn from the target's distribution, which is what a rejected draw ends in
        on average."""
        B, Nv = tokens.shape
        idx = torch.from_numpy(np.maximum(old, 0)).to(self.dev)
        rows = draft_probs.gather(1, idx[:, :, None].expand(-1, -1, draft_probs.shape[-1]))  # [B, Nv, V]
        mask = self.expand(self.masks[:B, :Nv])
        masked = rows * mask.to(rows.dtype)
        masked = masked / masked.sum(-1, keepdim=True).clamp(min=1e-30)
        constrained = torch.tensor([o is not None for o in outs], device=self.dev)[:, None, None]  # [B, 1, 1]
        rows = torch.where(constrained, masked, rows)
        # a node whose first child is forced (not drafted): one-hot on that child's token
        first_child = host_links(parent)[0]  # [B, Nv] (-1: none)
        forced_kid = (first_child >= 0) & (np.take_along_axis(old, np.maximum(first_child, 0), 1) < 0)
        if forced_kid.any():
            kid_tok = np.take_along_axis(tokens, np.maximum(first_child, 0), 1)
            one_hot = torch.nn.functional.one_hot(torch.from_numpy(kid_tok).to(self.dev), rows.shape[-1])
            rows = torch.where(torch.from_numpy(forced_kid).to(self.dev)[:, :, None], one_hot.to(rows.dtype), rows)
        return rows

    def node_masks(self, B: int, Nv: int) -> Tensor:
        """[B, Nv, V] bool: each node's allowed next tokens (filled by the last `layout`)."""
        return self.expand(self.masks[:B, :Nv])


def linked_width(parent: np.ndarray) -> int:
    """Nodes a free request's row needs: up to its last linked node."""
    linked = np.flatnonzero(parent >= 0)
    return int(linked[-1]) + 1 if linked.size else 1


def apply(logits: Tensor, allowed: Optional[Tensor]) -> Tensor:
    """Logits with the tokens `allowed` [.., V] (0/1) forbids pushed to -1e30 (-inf in half precision): a new tensor,
    the raw logits stay for the finiteness check and logprobs. An added bias, not masked_fill, which costs several
    times more on CPU over [B, N, V]."""
    if allowed is None:
        return logits
    V = logits.shape[-1]
    if allowed.shape[-1] != V:  # a model vocabulary padded past the tokenizer's: the padding ids are never allowed
        allowed = torch.nn.functional.pad(allowed, (0, max(0, V - allowed.shape[-1])))[..., :V]
    return logits + allowed.to(logits.dtype).sub_(1).mul_(FORBIDDEN)


FORBIDDEN = 1e30  # the logit bias of a forbidden token (finite in float32: (1 - 1) * bias stays 0, never NaN)


def build_grammar(g, tokenizer, vocab_size: int, eos, max_requests: int, max_nodes: int, num_steps: int,
                  dev) -> TreeGrammar:
    """The run's TreeGrammar over the engine `g` (the grammar= group's config) names."""
    from hydra.utils import get_class

    engine = get_class(g._target_)(g, tokenizer, vocab_size, list(eos))
    return TreeGrammar(engine, bool(g.jump_forward), max_requests, max_nodes, num_steps, dev)
