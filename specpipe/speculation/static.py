"""speculation=static: verify the drafter's whole tree every step, padding nodes included (the baseline).

Per-request limits still apply (`speculate: false`, `max_spec_tokens`, speculation.max_context): nodes past a
request's limit are unlinked in place, so the verify keeps its width."""
from __future__ import annotations

import numpy as np

from specpipe.speculation.base import Policy


class StaticPolicy(Policy):
    compact = False

    def keep(self, ht, conf, limits):
        """The nodes within each request's limit, in the drafter's own order (shallow first)."""
        p = np.where(ht.parent >= 0, 1.0 / (1.0 + ht.depth), 0.0)
        p[:, 0] = 1.0
        return self.top_slice(p, ht.depth, limits)

    def observe(self, tree, conf, counts, ranks, L, draft_s, compiled=False) -> None:
        """Counts only, no device read: static learns nothing, so its steps cost what they did before policies
        existed."""
        self.widths[tree.tokens.shape[1]] += 1
        self.drafted = not self.skipping  # (its whole tree, padding or not)
