"""Check a command line before Hydra starts: the flags Hydra would take with a traceback, then every job's
config (config/check.py). Hydra's own errors exit 1; specpipe promises exit 2 and one paragraph."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from specpipe.cli.argv import parse_command
from specpipe.config.check import check_overrides


def precheck(argv: list[str], api: bool = False) -> Optional[str]:
    """The message for the first bad flag or override combination, or None when all compose and validate.
    `api`: overrides of SpecPipe(...), which writes no Hydra output folder."""
    c = parse_command(argv)
    if any(a in ("--shell-completion", "-sc") for a in argv):
        said = completion_problem(c.overrides)
        if said:
            return said
    if c.skip:
        return None
    if c.config_dir is not None and not Path(c.config_dir).expanduser().is_dir():
        return (f"specpipe: invalid configuration: --config-dir {c.config_dir!r} is not a folder; give the "
                f"folder that holds your config groups (e.g. myconf/ with myconf/experiment/foo.yaml)")
    return check_overrides(c.overrides, config_name=c.config_name, config_dir=c.config_dir, multirun=c.multirun,
                           prints=c.prints, api=api, command=argv)


def completion_problem(overrides: list[str]) -> Optional[str]:
    """--shell-completion reads what to do from the overrides (Hydra's own error is a ValueError traceback)."""
    todo = [o for o in overrides if o.partition("=")[0] in ("install", "uninstall", "query")]
    if len(todo) != 1:
        return (f"specpipe: invalid command: --shell-completion needs one of install=SHELL, uninstall=SHELL "
                f"(SHELL: bash, zsh or fish), and got {' '.join(todo) if todo else 'none'}; e.g. "
                f"eval \"$(python -m specpipe -sc install=bash)\"")
    verb, _, shell = todo[0].partition("=")
    if verb != "query" and shell not in ("bash", "zsh", "fish"):
        return (f"specpipe: invalid command: --shell-completion {todo[0]}: completion is available for bash, zsh "
                f"and fish, not {shell or 'an unnamed shell'!r}; e.g. eval \"$(python -m specpipe -sc "
                f"{verb}=bash)\"")
    return None
