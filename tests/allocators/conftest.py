"""Allocator tests: make ``specpipe`` importable and run Triton kernels in the interpreter on CPU."""
import importlib.util
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Triton reads TRITON_INTERPRET when a kernel is decorated; ours are decorated on first use.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_TRITON = importlib.util.find_spec("triton") is not None
