"""specpipe: a declarative, config-driven speculative decoding pipeline."""
__version__ = "0.1.0"
