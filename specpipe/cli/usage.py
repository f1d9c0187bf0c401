"""What the command line offers: `--help`'s usage text and shell completion's options, both without the
schemas' base_* entries that every config group also holds in Hydra's config store."""
from __future__ import annotations

from typing import Optional

from specpipe.cli.argv import parse_command
from specpipe.config.compose import config_dirs, config_groups, default_options, group_options


def usage(argv: Optional[list] = None) -> str:
    """`python -m specpipe --help`: how to run it and every config group's options (Hydra's own help lists
    the schemas' base_* entries too, which are not options). `argv`: the command, whose `-cd` and
    hydra.searchpath folders add groups and options."""
    c = parse_command(list(argv or []))
    dirs = [d for d in config_dirs(c.config_dir, c.overrides) if d.is_dir()]
    defaults = default_options()
    groups = config_groups(dirs)
    width = max(map(len, groups))
    lines = []
    for g in groups:
        default = defaults.get(g)
        opts = [o for o in group_options(g, dirs) if o != default]
        first = [f"{default} (default)"] if default else ["(none by default)"]
        lines.append(f"  {g:<{width}}  {', '.join(first + opts)}")
    return "\n".join([
        "specpipe: config-driven speculative decoding (EAGLE trees, n-gram / suffix, standalone drafts).",
        "",
        "Usage:",
        "  python -m specpipe [group=option ...] [key=value ...]    one run (outputs/DATE/TIME/)",
        "  python -m specpipe -m key=v1,v2 group=a,b ...            a sweep, one job per combination (multirun/)",
        "  python -m specpipe --cfg job [overrides]                 print the composed config: every key and value",
        "  python -m specpipe.report SWEEP_DIR                      a sweep's table (CSV, markdown) and plot",
        "",
        "Config groups (group=option):",
        *lines,
        "",
        "Examples:",
        "  python -m specpipe draft.topk=4 draft.num_steps=5 allocator=paged",
        "  python -m specpipe model=hf model.path=DIR draft.path=HEAD_DIR workload.prompts_file=prompts.jsonl",
        "  python -m specpipe -m draft.topk=1,4,8 allocator=token,paged",
        "",
        "docs/configuration.md documents every option, docs/outputs.md every metric. Hydra's own help: "
        "python -m specpipe --hydra-help",
    ])


def hide_schemas_from_completion() -> None:
    """Shell completion lists a group's options from Hydra's config store too, where the schemas' base_* entries
    live; they are not options (the precheck refuses them), so completion leaves them out. Hydra has no public
    hook for the options completion offers: the config store's listing (which only listings use; composing
    loads an entry by name) is filtered for this process, which then only completes and exits."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    if getattr(store.list, "_specpipe", False):
        return
    listed = store.list

    def options(path: str) -> list[str]:
        return [o for o in listed(path) if not o.startswith("base_")]

    options._specpipe = True
    store.list = options
