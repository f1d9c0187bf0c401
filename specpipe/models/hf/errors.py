"""The one error every Hugging Face folder problem raises, so the CLI prints it as one paragraph (exit 2)."""
from __future__ import annotations

from specpipe.errors import SpecpipeError


class CheckpointError(SpecpipeError, ValueError):
    """A model folder that cannot be loaded; the message names the file and the field or tensor."""
