"""Drafters other than the EAGLE head: n-gram prompt lookup and a standalone draft model."""
from specpipe.drafters.ngram import NgramDrafter, pack_histories
from specpipe.drafters.standalone import StandaloneDrafter
from specpipe.drafters.tree import tree_from_parents

__all__ = ["NgramDrafter", "StandaloneDrafter", "pack_histories", "tree_from_parents"]
