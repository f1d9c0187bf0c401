"""Decode preparation: the request -> slot table and the KV lengths, without per-step Python churn.

Host-side lengths live in preallocated numpy arrays indexed by table row (no list growth per
step); page counts are computed once, in closed form, and passed to the allocator as
`num_new_pages`, so the allocator does no counting of its own. Each row owns positions
[0, alloc_len); the first seq_len of them hold committed KV.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from torch import Tensor

from specpipe.stages.base import Stage


def ranges(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flattened (segment, position) pairs of the ranges [starts_i, ends_i), segment-major."""
    counts = np.maximum(ends - starts, 0)
    total = int(counts.sum())
    seg = np.repeat(np.arange(len(counts)), counts)
    offsets = np.cumsum(counts) - counts
    pos = np.arange(total) - np.repeat(offsets, counts) + np.repeat(starts, counts)
    return seg, pos


class PrepareDecode(Stage):
    name = "prepare_decode"

    def __init__(self, allocator, max_requests: int, max_context: int, device: torch.device):
        self.alloc = allocator
        self.ps = allocator.page_size
        self.device = device
        self.table = torch.zeros((max_requests, max_context), dtype=torch.int64, device=device)  # [R, C]
        self.seq_len = np.zeros(max_requests, dtype=np.int64)  # committed KV tokens per row
        self.alloc_len = np.zeros(max_requests, dtype=np.int64)  # owned positions per row
        self.peak_used = 0
        self._free_rows = list(range(max_requests - 1, -1, -1))

    @property
    def max_context(self) -> int:
        return self.table.shape[1]

    def acquire_row(self) -> Optional[int]:
        return self._free_rows.pop() if self._free_rows else None

    def release_rows(self, rows: list[int]) -> None:
        """Free every slot the rows own and hand the rows back."""
        if not rows:
            return
        r = np.asarray(rows, dtype=np.int64)
        seg, pos = ranges(np.zeros_like(r), self.alloc_len[r])
        if len(pos):
            self.alloc.free(self.table[torch.from_numpy(r[seg]).to(self.device), torch.from_numpy(pos).to(self.device)])
        self.seq_len[r] = 0
        self.alloc_len[r] = 0
        self._free_rows.extend(rows)

    def reserve(self, rows: np.ndarray, need: np.ndarray) -> bool:
        """Make each row own positions [0, seq_len + need). False (nothing changed) when out of memory."""
        cur = self.alloc_len[rows]
        nxt = np.maximum(cur, self.seq_len[rows] + need)
        grow = nxt > cur
        if not grow.any():
            return True
        r, c, n = rows[grow], cur[grow], nxt[grow]
        ps = self.ps
        pages = int(((n + ps - 1) // ps - (c + ps - 1) // ps).sum())  # closed form, host ints only
        r_t = torch.from_numpy(r).to(self.device)
        c_t = torch.from_numpy(c).to(self.device)
        last_loc = torch.where(c_t > 0, self.table[r_t, (c_t - 1).clamp(min=0)], torch.full_like(c_t, -1))
        slots = self.alloc.alloc_extend(c_t, torch.from_numpy(n).to(self.device), last_loc,
                                        num_new_pages=pages, extend_num_tokens=int((n - c).sum()))
        if slots is None:
            return False
        seg, pos = ranges(c, n)
        self.table[torch.from_numpy(r[seg]).to(self.device), torch.from_numpy(pos).to(self.device)] = slots
        self.alloc_len[r] = n
        self.peak_used = max(self.peak_used, self.alloc.size - self.alloc.available())
        return True

    def slots(self, rows_t: Tensor, starts: Tensor, width: int) -> Tensor:
        """[B, width] slots of positions starts_b + [0, width)."""
        cols = starts[:, None] + torch.arange(width, device=self.device)
        return self.table[rows_t[:, None], cols.clamp(max=self.max_context - 1)]

    def scratch(self, n: int):
        """n throw-away slots (draft KV) and the allocator state to restore afterwards, or None on OOM."""
        state = self.alloc.backup_state()
        ps = self.ps
        slots = self.alloc.alloc(-(-n // ps) * ps) if n else torch.empty(0, dtype=torch.int64, device=self.device)
        if slots is None:
            return None
        return slots[:n], state

    def end_scratch(self, state) -> None:
        self.alloc.restore_state(state)

    # ---- allocator-specific views (hooks; plain allocators need none) ---------------------
    def decorate(self, batch):
        """Add allocator-specific slot views (e.g. window-pool slots) to an AttentionBatch."""
        return batch

    def move_kv(self, pool, tgt: Tensor, src: Tensor) -> None:
        """Copy accepted K/V from tree slots to contiguous slots in every pool the allocator feeds."""
        pool.move(tgt, src)

    def after_commit(self, rows: np.ndarray) -> None:
        """Called after committed lengths change (e.g. to free window-pool slots that left the window)."""

    def commit(self, rows: np.ndarray, new_seq: np.ndarray) -> None:
        """Record committed lengths; free owned pages that lie wholly past the committed tokens."""
        ps = self.ps
        self.seq_len[rows] = new_seq
        keep = np.minimum(-(-new_seq // ps) * ps, self.alloc_len[rows])
        seg, pos = ranges(keep, self.alloc_len[rows])
        if len(pos):
            self.alloc.free(self.table[torch.from_numpy(rows[seg]).to(self.device), torch.from_numpy(pos).to(self.device)])
        self.alloc_len[rows] = keep
