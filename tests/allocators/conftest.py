"""Allocator tests: make ``specpipe`` importable; Triton kernels get CUDA tensors on a GPU, the interpreter on CPU.

A compiled Triton kernel reads its inputs through device pointers, so on a machine with a GPU (where
TRITON_INTERPRET stays off) the kernel and allocator tests must hand it CUDA tensors: `DEVICE` is where
they put them.
"""
import importlib.util
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda") if HAS_CUDA else torch.device("cpu")  # the kernels' (and allocators') tensors
# Triton reads TRITON_INTERPRET when a kernel is decorated; ours are decorated on first use.
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_TRITON = importlib.util.find_spec("triton") is not None
