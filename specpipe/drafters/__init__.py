"""Drafters: one file per `draft=` option, each one class built from its schema's `_target_` (`drafters.base`), and
the matching and model code they draft with (n-gram trie, suffix cache, standalone model stage)."""
from specpipe.drafters.ngram_trie import NgramDrafter, pack_histories
from specpipe.drafters.standalone_draft import StandaloneDrafter

__all__ = ["NgramDrafter", "StandaloneDrafter", "pack_histories"]
