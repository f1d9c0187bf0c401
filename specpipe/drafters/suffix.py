"""draft=suffix: suffix decoding, n-gram drafting from more than the request's own context.

Each request also matches in the newest finished requests' outputs (`SuffixCache`, up to draft.cache_tokens) and
in the other running requests' histories (draft.running_tokens), as SuffixDecoding and vLLM's method=suffix do.
The matching is the n-gram drafter's (`drafters.ngram.NgramProposer`, which takes the same settings): this option
is that drafter with the cross-request corpus on by default (conf/draft/suffix.yaml), and its own entry point.
"""
from __future__ import annotations

from specpipe.drafters.ngram import NgramProposer


class SuffixProposer(NgramProposer):
    """The n-gram drafter with a cross-request corpus (see the module docstring); `build` is the n-gram one's, which
    also carries the cache of finished outputs from one API call to the next."""
