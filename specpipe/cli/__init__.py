"""The command line: argv as Hydra reads it (argv.py), the checks before Hydra starts (precheck.py), --help and
shell completion (usage.py). The rules and messages of the checks live in specpipe.config, shared with SpecPipe."""
