"""User-facing errors: a ConfigError collects every problem so the user fixes them in one go."""
from __future__ import annotations


class SpecpipeError(Exception):
    """An error caused by the user's input; printed as one paragraph, exit code 2, no traceback."""

    exit_code = 2


class ConfigError(SpecpipeError):
    def __init__(self, errors: list[str] | str):
        self.errors = [errors] if isinstance(errors, str) else list(errors)
        super().__init__(self.format())

    def format(self) -> str:
        if len(self.errors) == 1:
            return f"specpipe: invalid configuration: {self.errors[0]}"
        lines = "\n".join(f"  - {e}" for e in self.errors)
        return f"specpipe: invalid configuration ({len(self.errors)} problems):\n{lines}"


class DeviceUnavailableError(SpecpipeError):
    """The requested device cannot be used on this machine (message says what is missing)."""


class InputError(SpecpipeError):
    """A prompts file or other run input that cannot be read."""


class OutputError(SpecpipeError):
    """The run finished but its files could not be written (a full disk, a folder gone read-only)."""

    exit_code = 1
