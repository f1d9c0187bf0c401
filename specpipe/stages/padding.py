"""Padded widths: every step pads its token and slot counts up to a bucket, so the shapes a compiled
graph sees (and the recompiles they cause) change rarely."""
from __future__ import annotations


def bucket(n: int, q: int = 16) -> int:
    """Round up to a multiple of q so padded widths (and compiled shapes) change rarely."""
    return max(q, -(-int(n) // q) * q)
