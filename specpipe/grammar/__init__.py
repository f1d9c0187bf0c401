"""Constrained decoding: token masks from a grammar engine, applied along every draft tree (`grammar.tree`)."""
