"""specpipe: a declarative, config-driven speculative decoding pipeline."""
__version__ = "0.1.0"


def __getattr__(name):  # `from specpipe import SpecPipe` without importing torch for `python -m specpipe --help`
    if name in ("SpecPipe", "Completion", "StreamEvent"):
        from specpipe import api

        return getattr(api, name)
    if name == "SpecpipeError":  # what the API raises for bad overrides and inputs
        from specpipe.errors import SpecpipeError

        return SpecpipeError
    raise AttributeError(f"module 'specpipe' has no attribute {name!r}")
