"""A target prefill's result as the drafters read it, padded or packed (every prompt as a segment of one
row, no padding), and the conversions between the two forms."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from specpipe.models.attention import Attention
from specpipe.models.attention_batch import AttentionBatch


def dense_attention(module) -> bool:
    """Every attention layer in `module` attends fully (no sliding window, no sparse top-k), so a packed
    prefill batch (requests as segments of one row) suits it."""
    return all(a.window is None and a.top_k is None for a in module.modules() if isinstance(a, Attention))


@dataclass
class Prefill:
    """One admission's target prefill, as the drafters' join reads it: the padded [B, T] view, and the packed
    one (every prompt as a segment of one row, no padding) when the target's forward ran packed, so a draft
    model with dense attention runs over the prompts without the padding too."""
    rows: np.ndarray
    lens: np.ndarray  # [B] prompt lengths
    ids: Tensor  # [B, T] prompt ids, zeros after each prompt
    batch: AttentionBatch  # the padded extend batch
    last: Tensor  # [B] row position of each prompt's newest token
    packed: Optional[AttentionBatch] = None  # the packed batch; None when the forward ran padded
    flat: Optional[Tensor] = None  # [sum(lens)] index of each real token in the flattened [B * T]
    packed_hidden: Optional[Tensor] = None  # [1, sum(lens), H]
    _hidden: Optional[Tensor] = None

    @property
    def hidden(self) -> Tensor:
        """[B, T, H] target hidden states (zeros at the padding); unpacked on first use."""
        if self._hidden is None:
            B, T = self.ids.shape
            self._hidden = unpack(self.packed_hidden, self.flat, B, T)
        return self._hidden

    def packed_for(self, module) -> bool:
        """Whether a draft forward of `module` over the prompts can take the packed form."""
        return self.packed is not None and dense_attention(module)

    @property
    def ends(self) -> Tensor:
        """[B] position of each prompt's newest token in the packed row."""
        return torch.from_numpy(np.cumsum(self.lens) - 1).to(self.last.device)


def unpack(x: Tensor, flat: Tensor, B: int, T: int) -> Tensor:
    """[1, sum(lens), ...] packed rows -> [B, T, ...] padded (zeros at the padding)."""
    out = x.new_zeros((B * T, *x.shape[2:]))
    return out.index_copy_(0, flat, x[0]).view(B, T, *x.shape[2:])
