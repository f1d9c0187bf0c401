"""KV-cache allocators. Importing the package never imports triton (kernels load on demand)."""
from specpipe.allocators.base import KVAllocator, num_new_pages
from specpipe.allocators.hisparse import HiSparseAllocator, HotBuffer
from specpipe.allocators.paged import PagedAllocator
from specpipe.allocators.swa import SWAAllocator
from specpipe.allocators.token import TokenAllocator

__all__ = ["KVAllocator", "TokenAllocator", "PagedAllocator", "SWAAllocator",
           "HiSparseAllocator", "HotBuffer", "num_new_pages"]
