"""Committed tokens an EAGLE head has not extended over yet: while drafting pauses, its extend waits.

After every verify, the head runs its extend over the committed tokens (their ids and the target's hidden states),
so that its KV and its next start (top-k, hidden) are ready for the next round. While `speculation=cost` has paused
drafting, no round reads them: on SmolLM2-135M a trained EAGLE-3 head's extend cost ~6 ms of a ~55 ms plain step,
spent on drafts never made. `HeldTokens` keeps those steps' ids and hidden states per KV row instead; the head
extends over all of them in one call when a round drafts again (or the buffer fills), which also costs less than
one call per step. Rows index the buffer (the request-row table's rows), so a batch that reorders as requests leave
or join needs no moves. A row's held positions run from `covered` (what the head's KV holds) to the committed
length; each step writes its S+1 columns from its root's offset, and the next step's columns overwrite what lay
past its kept count.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from torch import Tensor

HELD_STEPS = 32  # a row holds at most this many positions (plus one step's columns) before the head catches up


class HeldTokens:
    def __init__(self, max_requests: int, width: int):
        self.width = width  # S + 1: the columns one step commits at most
        self.covered = np.zeros(max_requests, dtype=np.int64)  # per row: positions the head's KV holds
        self.held = np.zeros(max_requests, dtype=bool)  # per row: some committed tokens wait for the head
        self.ids: Optional[Tensor] = None  # [R, HELD_STEPS + width]
        self.hidden: Optional[Tensor] = None  # [R, HELD_STEPS + width, F] the target's features
        self.step_cols: Optional[Tensor] = None  # [S+1] 0..S: one step's columns from its root's

    def caught_up(self, rows: np.ndarray, seq_len: np.ndarray) -> None:
        """The head's KV covers every committed position of `rows` (`seq_len`: their committed lengths), after a
        prompt's extend or an extend over the held tokens."""
        self.covered[rows] = seq_len
        self.held[rows] = False

    def hold(self, rows: np.ndarray, rows_t: Tensor, L_t: Tensor, ids: Tensor, hidden: Tensor) -> None:
        """This step's committed ids [B', S+1] and features [B', S+1, F] of the requests in `rows` (their root
        positions L_t [B']), written at their offsets past what each row's head KV holds."""
        if self.ids is None or self.hidden.shape[-1] != hidden.shape[-1] or self.hidden.dtype != hidden.dtype:
            R, cols = len(self.covered), HELD_STEPS + self.width
            self.ids = torch.zeros(R, cols, dtype=ids.dtype, device=ids.device)
            self.hidden = torch.zeros(R, cols, hidden.shape[-1], dtype=hidden.dtype, device=hidden.device)
            self.step_cols = torch.arange(self.width, device=ids.device)
        off = L_t - torch.from_numpy(self.covered[rows]).to(L_t.device)  # [B'] offset of the root's column
        cols = off[:, None] + self.step_cols  # [B', S+1]
        self.ids[rows_t[:, None], cols] = ids
        self.hidden[rows_t[:, None], cols] = hidden
        self.held[rows] = True

    def full(self, rows: np.ndarray, seq_len: np.ndarray) -> bool:
        """Whether another step could write past the buffer for some row."""
        return bool((seq_len - self.covered[rows]).max(initial=0) > HELD_STEPS)

    def pending(self, rows: np.ndarray, seq_len: np.ndarray, only: Optional[np.ndarray] = None):
        """(batch indices whose rows hold tokens, how many each) for a batch on `rows` at committed `seq_len`
        (`only`: those of these rows)."""
        b = np.flatnonzero(self.held[rows] & (seq_len > self.covered[rows]) &
                           (np.isin(rows, only) if only is not None else True))
        return b, seq_len[b] - self.covered[rows[b]]
