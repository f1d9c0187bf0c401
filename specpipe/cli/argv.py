"""The command line as Hydra's parser reads it: flags with their values, overrides, globs over config groups."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from specpipe.config.compose import config_dirs, group_options

FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p", "--config-name", "-cn", "--config-path", "-cp",
                    "--config-dir", "-cd", "--experimental-rerun", "--info", "-i"}
SKIP_FLAGS = {"--help", "-h", "--hydra-help", "--config-path", "-cp", "--shell-completion", "-sc", "--version",
              "--experimental-rerun"}  # Hydra answers these itself (or they name configs the check cannot find)
PRINT_FLAGS = {"--cfg", "-c", "--info", "-i"}  # print a config: its overrides must compose, the run rules wait
OPTIONAL_VALUE = {"--info", "-i"}  # the value may be left out


@dataclass
class CommandLine:
    overrides: list = field(default_factory=list)
    multirun: bool = False  # -m / --multirun
    skip: bool = False
    prints: bool = False  # --cfg / --info
    config_dir: Optional[str] = None  # -cd: searched before the package's conf/
    config_name: str = "config"


def words(argv: list[str]) -> list[list[str]]:
    """argv grouped as Hydra's parser reads it: a flag with the value it takes, or one override."""
    out, i = [], 0
    while i < len(argv):
        a, nxt = argv[i], argv[i + 1] if i + 1 < len(argv) else None
        takes = a in FLAGS_WITH_VALUE and nxt is not None and not (
            a in OPTIONAL_VALUE and ("=" in nxt or nxt.startswith("-")))
        out.append(argv[i:i + 1 + takes])
        i += 1 + takes
    return out


def parse_command(argv: list[str]) -> CommandLine:
    c = CommandLine()
    for w in words(argv):
        flag, eq, inline = w[0].partition("=")
        value = inline if eq else (w[1] if len(w) > 1 else None)
        if w[0] in ("-m", "--multirun"):
            c.multirun = True
        elif w[0].startswith("-"):
            c.skip |= flag in SKIP_FLAGS
            c.prints |= flag in PRINT_FLAGS
            if flag in ("--config-dir", "-cd"):
                c.config_dir = value
            elif flag in ("--config-name", "-cn"):
                c.config_name = value or "config"
        else:
            c.overrides.append(w[0])
    return c


def split_args(argv: list[str]) -> tuple[list[str], bool, bool]:
    """(overrides, multirun flag, skip): skip when Hydra is asked for help or a config path."""
    c = parse_command(argv)
    return c.overrides, c.multirun, c.skip


def flags_first(argv: list[str]) -> list[str]:
    """Hydra's parser takes flags only before the overrides (`draft.topk=2 -m x=1,2` is an argparse error);
    move every flag, with its value, in front."""
    flags, rest, last = [], [], []
    for w in words(argv):
        # a bare --info goes last: in front of the overrides it would take the first one as its value
        (rest if not w[0].startswith("-") else last if len(w) == 1 and w[0] in OPTIONAL_VALUE else flags).extend(w)
    return flags + rest + last


def expand_globs(argv: list[str]) -> list[str]:
    """`allocator=glob(t*)` -> `allocator=token`: Hydra's glob would also match the schemas' base_* entries
    that every group holds in the ConfigStore, and its check here has no config loader to list options."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import Glob

    c = parse_command(argv)
    dirs = config_dirs(c.config_dir, c.overrides)
    out = []
    for a in argv:
        if not a.startswith("-") and "glob(" in a:
            try:
                o = OverridesParser.create().parse_override(a)
            except Exception:
                o = None  # the check names the problem
            options = group_options(o.get_key_element().lstrip("+~"), dirs) if o is not None else []
            if o is not None and isinstance(o.value(), Glob) and options:
                picked = o.value().filter(options)
                a = f"{o.get_key_element()}={','.join(picked)}" if picked else a
        out.append(a)
    return out
