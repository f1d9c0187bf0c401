"""Notes and warnings for the person running specpipe, through `logging`.

A note says what specpipe did instead of what was asked (a policy it could not apply, a setting it ignored, a
job it skipped). It goes to the `specpipe` logger, so Hydra writes it into each job's `.log` file too. The
console shows it as before: the bare message on stderr, from the handler `console_handler()` puts on the
`specpipe` logger (Hydra's own console handler is turned off in `conf/config.yaml`, so nothing shows twice).
To silence the console notes in your own program: `logging.getLogger("specpipe").setLevel(logging.ERROR)`.
"""
from __future__ import annotations

import logging
import sys

LOGGER = "specpipe"


class StderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is when a record comes (pytest's capture, a redirected stream), not to
    the stream that was current when the handler was made."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it; the property always reads sys.stderr
        pass


def console_handler() -> logging.Handler:
    """The `specpipe` logger's console handler (bare messages on stderr), added once per process."""
    log = logging.getLogger(LOGGER)
    for h in log.handlers:
        if isinstance(h, StderrHandler):
            return h
    h = StderrHandler()
    h.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(h)
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)
    return h


def logger(name: str) -> logging.Logger:
    """The logger for module `name` (a `specpipe.*` name, so its records reach the console handler)."""
    console_handler()
    return logging.getLogger(name)
