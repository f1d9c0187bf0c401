"""build(node): the only call of hydra.utils.instantiate, restricted to targets inside specpipe."""
from __future__ import annotations

from typing import Any

from specpipe.errors import ConfigError, SpecpipeError

ALLOWED_PREFIX = "specpipe."


def check_target(target: Any, where: str) -> str | None:
    """An error message when a `_target_` points outside the specpipe package, else None."""
    if not isinstance(target, str) or not target.startswith(ALLOWED_PREFIX):
        return (f"{where}._target_={target!r} is refused: only classes and functions inside the "
                f"'specpipe' package may be built from a config (valid: a 'specpipe.*' name from the "
                f"shipped schemas; choose an option of the config group instead of a custom target)")
    return None


def build(node: Any, where: str, **kwargs: Any) -> Any:
    from hydra.utils import instantiate

    err = check_target(node.get("_target_"), where)
    if err:
        raise ConfigError(err)
    try:
        return instantiate(node, **kwargs)
    except Exception as e:  # hydra wraps errors raised while building: surface the user-facing ones
        cause = e
        while cause is not None and not isinstance(cause, SpecpipeError):
            cause = cause.__cause__ or cause.__context__
        if cause is not None:
            raise cause from None
        raise
