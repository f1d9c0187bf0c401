"""Hydra config groups (a package, so an installed `specpipe` command finds them as pkg://specpipe.conf)."""
