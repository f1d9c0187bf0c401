"""Check a list of overrides before anything runs: each sweep point composes and validates, or one paragraph says
why not.

Composing each override combination up front is cheap (no torch work), and it means a multirun with one bad
point fails before any job runs. `python -m specpipe` (cli/precheck.py) and SpecPipe(...) both check here.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from specpipe.config.compose import compose_config, config_dirs, group_options, keys_hint
from specpipe.config.hydra_settings import hydra_problem
from specpipe.config.override_errors import explain, omegaconf_error
from specpipe.config.overrides import sweep_points

# workload keys that choose the CLI's prompts: SpecPipe's calls take theirs as arguments
API_UNREAD = ("workload.prompts_file", "workload.prompt_set", "workload.num_prompts")
NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def check_overrides(overrides: list[str], config_name: str = "config", config_dir: Optional[str] = None,
                    multirun: bool = False, prints: bool = False, api: bool = False,
                    command: Optional[list[str]] = None) -> Optional[str]:
    """The message for the first bad override combination, or None when all compose and validate.
    `multirun`: -m was given; `prints`: --cfg/--info (the overrides must compose; the run rules wait);
    `api`: overrides of SpecPipe(...), which writes no Hydra output folder; `command`: the words typed."""
    return OverrideCheck(list(overrides), config_name, config_dir, multirun, prints, api,
                         list(command if command is not None else overrides)).run()


def key_of(p) -> str:
    """A parsed override's key without its +/~ prefixes."""
    return p.get_key_element().lstrip("+~")


@dataclass
class OverrideCheck:
    """One command's checks, in the order a user meets the problems: the overrides' text, their parse, the first
    point's config (self.base, which the later checks read), the sweep's shape, Hydra's settings, every point.
    Each check returns the message for the first problem it finds, or None."""

    overrides: list[str]
    config_name: str = "config"
    config_dir: Optional[str] = None
    multirun_flag: bool = False  # -m / --multirun (a sweep preset or hydra.mode=MULTIRUN sweeps too)
    prints: bool = False
    api: bool = False
    command: list[str] = field(default_factory=list)

    def __post_init__(self):
        self.dirs = config_dirs(self.config_dir, self.overrides)

    def run(self) -> Optional[str]:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        said = self.typed_problem()
        if said:
            return said
        try:
            self.parsed = OverridesParser.create().parse_overrides(self.overrides)
        except Exception as e:
            return explain(e, self.overrides, self.dirs)
        self.keys = [key_of(p) for p in self.parsed]
        self.swept = [p for p in self.parsed if p.is_sweep_override()]
        return (self.parsed_problem() or self.compose_first() or self.sweep_problem() or self.api_problem()
                or self.launch_problem() or self.points_problem())

    def typed_problem(self) -> Optional[str]:
        """Overrides Hydra would take wrongly or refuse with a traceback, told from their text."""
        for o in self.overrides:
            key = o.lstrip("+").partition("=")[0]
            if not key.strip("~ "):
                return (f"specpipe: invalid override {o!r}: the key before '=' is missing; overrides are key=value "
                        f"(e.g. draft.topk=4) or group=option (e.g. allocator=paged)")
            name = key.lstrip("~")
            if o.startswith("~") and not name.startswith("hydra") and not any((d / name).is_dir() for d in self.dirs):
                return (f"specpipe: invalid override {o}: a setting cannot be removed (the schema needs every key); "
                        f"set a value instead, {key.lstrip('~')}=VALUE.")
        return None

    def parsed_problem(self) -> Optional[str]:
        """A sweep preset's params set directly, or a schema named as an option (Hydra's own errors for these
        are "Unexpected type: None", "Could not override", or a run of the schema's defaults)."""
        for p in self.parsed:
            if key_of(p) == "hydra.sweeper.params" and isinstance(p.value(), dict):
                plain = " ".join(f"{k}={v}" for k, v in p.value().items())
                return (f"specpipe: invalid override {p.input_line}: a sweep's values are given as plain keys, not "
                        f"as hydra.sweeper.params; write -m {plain}")
            if key_of(p).startswith("hydra.sweeper.params."):
                plain = p.input_line.lstrip("+~").removeprefix("hydra.sweeper.params.")
                return (f"specpipe: invalid override {p.input_line}: a sweep preset's values are replaced by the "
                        f"same key given plainly; write {plain} (with -m for several values).")
        for p in self.parsed:  # the schemas every option extends are in the group's namespace, but run nothing
            group, options = key_of(p), group_options(key_of(p), self.dirs)
            try:
                values = list(p.sweep_string_iterator()) if p.is_sweep_override() else [str(p.value())]
            except Exception:
                values = []
            # (a YAML file named base_* in the group's folder is an option)
            schema = next((v for v in values if v.startswith("base_") and v not in options), None)
            if schema is not None and "." not in group and options:
                return (f"specpipe: invalid override {group}={schema}: {schema} is the schema that {group} options "
                        f"extend (a user's {group} YAML lists it in its defaults), not an option (valid: "
                        f"{', '.join(options)}).")
        return None

    def compose_first(self) -> Optional[str]:
        """Composes the first point (every override with its first value: a sweep's keys can need its groups)
        into self.base, the config the later checks read."""
        from hydra.errors import MissingConfigException

        first = []
        for p in self.parsed:
            try:
                first.append(f"{p.get_key_element()}={next(iter(p.sweep_string_iterator()))}" if p.is_sweep_override()
                             else p.input_line)
            except Exception:  # glob() on a key, interval(), an empty range: sweep_points() names the problem
                pass
        try:
            self.base = compose_config(first, self.config_name, hydra=True, config_dir=self.config_dir)
        except MissingConfigException as e:
            if e.missing_cfg_file != self.config_name:
                return explain(e, first, self.dirs)
            mine = sorted({p.stem for d in self.dirs if d.is_dir() for p in d.glob("*.yaml")})
            return (f"specpipe: invalid command: --config-name {self.config_name!r}: no such config in the config "
                    f"folders searched (valid: {', '.join(mine)}); a primary config of your own is "
                    f"myconf/NAME.yaml, used as -cd myconf -cn NAME.")
        except Exception as e:
            return explain(e, first, self.dirs)
        self.multirun = self.multirun_flag or str(self.base.hydra.mode) == "RunMode.MULTIRUN"  # presets set hydra.mode
        return None

    def sweep_problem(self) -> Optional[str]:
        """Sweeps that would run other jobs than the ones asked for, or none."""
        lost = next((p for i, p in enumerate(self.parsed)
                     if p.is_sweep_override() and self.keys[i] in self.keys[i + 1:]), None)
        if lost is not None:  # Hydra keeps the last one: `draft.topk=1,2 draft.topk=4` ran one job, silently
            key = key_of(lost)
            given = " ".join(p.input_line for p in self.parsed if key_of(p) == key)
            return (f"specpipe: invalid override: {key} is given more than once ({given}) and the sweep "
                    f"{lost.input_line} is not the last, so it would be dropped (the last one counts). Give {key} "
                    f"once, with every value to sweep.")
        bad_bool = self.number_for_a_bool()
        if bad_bool is not None:
            return bad_bool
        if self.prints and (self.multirun_flag or self.swept):
            return ("specpipe: invalid command: --cfg and --info print one composed config, and this command is a "
                    "sweep (-m, or several values for a key); drop -m and give one value per key to see one job's "
                    "config")
        if self.api:
            return None  # api_problem() says why SpecPipe takes no sweep
        return self.sweep_base_problem() or self.sweep_form_problem()

    def number_for_a_bool(self) -> Optional[str]:
        """OmegaConf reads a number given for a true/false setting as its truth (workload.ignore_eos=2 is true):
        the error for the first such override, or None."""
        from omegaconf import OmegaConf

        for p in self.parsed:
            key = key_of(p)
            if key.startswith("hydra"):
                continue
            try:
                if not isinstance(OmegaConf.select(self.base, key, default=None), bool):
                    continue
                values = list(p.sweep_string_iterator()) if p.is_sweep_override() else [p.value()]
            except Exception:  # not a plain key (a group, a glob): composing names what is wrong
                continue
            bad = next((v for v in values if not isinstance(v, bool) and NUMBER.fullmatch(str(v).strip())), None)
            if bad is not None:
                return (f"specpipe: invalid value for {key}: {str(bad)!r} is not true or false; give {key}=true or "
                        f"{key}=false.")
        return None

    def sweep_base_problem(self) -> Optional[str]:
        """Hydra composes a sweep's base config with its plain overrides and no swept value: a key that only
        some of the swept group's options have fails there."""
        if not (self.multirun and self.swept):
            return None
        plain = [p.input_line for p in self.parsed if not p.is_sweep_override()]
        try:
            compose_config(plain, self.config_name, hydra=True, config_dir=self.config_dir)
            return None
        except Exception as e:
            err = omegaconf_error(e)
            key = err.full_key if err is not None and re.fullmatch(r"[\w.]+", err.full_key) else None
        group = key.split(".")[0] if key else None
        groups = [p.input_line for p in self.swept if p.get_key_element().lstrip("+") == group]
        if not groups:
            return None
        return (f"specpipe: invalid override {key}: Hydra first composes a sweep's config without its swept values "
                f"(so with the default {group} option), and {key} is not a setting there; it belongs to only some "
                f"of {groups[0]}. Sweep each {group} option in a command of its own (python -m specpipe -m "
                f"{group}=OPTION {key}=...).")

    def sweep_form_problem(self) -> Optional[str]:
        """Several presets, values without -m, or Hydra's own settings swept."""
        presets = next((p for p in self.swept if p.get_key_element().lstrip("+") == "sweep"), None)
        if presets is not None:
            return (f"specpipe: invalid override {presets.input_line}: one ready sweep per command (each sets its "
                    f"own hydra.sweeper.params); run them one after another, e.g. python -m specpipe sweep="
                    f"{next(iter(presets.sweep_string_iterator()), 'tree_shape')}")
        if self.swept and not self.multirun:
            return (f"specpipe: invalid override {self.swept[0].input_line}: several values (or a sweep function) "
                    f"make a sweep, so add -m: python -m specpipe -m {' '.join(self.command)}")
        hydra_swept = next((p for p in self.swept if key_of(p).startswith("hydra")), None)
        if hydra_swept is not None:
            return (f"specpipe: invalid override {hydra_swept.input_line}: Hydra's own settings cannot be swept; "
                    f"sweep the run's keys (e.g. draft.topk=1,2).")
        return None

    def api_problem(self) -> Optional[str]:
        """SpecPipe builds one pipeline and writes no Hydra folder: sweeps and settings it never reads."""
        if not self.api:
            return None
        if self.multirun or self.swept:  # a sweep would run its first point silently
            what = next((p.input_line for p in self.swept), None) or next(
                (o for o in self.overrides if o.lstrip("+").startswith(("sweep=", "hydra.mode"))), "a sweep")
            return (f"specpipe: invalid override {what}: SpecPipe runs one configuration, and this is a sweep "
                    f"(several values, a sweep preset or hydra.mode=MULTIRUN); give one value per key, and run "
                    f"sweeps with python -m specpipe -m ... (or build one SpecPipe per point)")
        unread = next((p.input_line for p, k in zip(self.parsed, self.keys) if k in API_UNREAD
                       or (k.startswith(("hydra.", "hydra/")) and k not in ("hydra.searchpath", "hydra.mode"))), None)
        if unread is None:
            return None
        key = unread.lstrip("+~").partition("=")[0]
        why = ("generate() and stream() take the prompts as their argument); leave it out" if key in API_UNREAD
               else "it writes no Hydra output folder and launches no jobs, so Hydra's own settings do nothing "
                    "here; generate(out_dir=...) writes metrics.json and completions.jsonl); leave it out (of "
                    "Hydra's settings, hydra.searchpath, for config folders of your own, is read)")
        return f"specpipe: invalid override {unread}: SpecPipe does not read {key} ({why}"

    def launch_problem(self) -> Optional[str]:
        """Hydra's output folders and launcher, which would fail inside Hydra (a run that prints a config, and
        SpecPipe, launch nothing)."""
        if self.api or self.prints:
            return None
        why = hydra_problem(self.base, self.multirun, tuple(k for k in self.keys if k.startswith("hydra.")))
        if why:
            return why
        if self.multirun and "BasicLauncher" not in str(self.base.hydra.launcher.get("_target_", "")) \
                and self.base.workload.get("prompts_file") == "-":
            name = self.base.hydra.runtime.choices.get("hydra/launcher", "")
            return (f"specpipe: invalid configuration: workload.prompts_file=- (standard input) reaches only this "
                    f"process, and hydra/launcher={name} runs the jobs in other processes; write the prompts to a "
                    f"file (workload.prompts_file=prompts.jsonl), or use the default in-process launcher")
        return None

    def points_problem(self) -> Optional[str]:
        """Every point of the sweep (or the one run) composes, and a run's config validates."""
        from specpipe.config.build import target_problems
        from specpipe.config.validate import validate
        from specpipe.errors import ConfigError

        own = [o for o in self.overrides if not o.lstrip("+~").startswith("hydra")]
        hydra_own = [o for o in self.overrides if o.lstrip("+~").startswith("hydra")]
        from_preset = []
        if self.multirun:  # a sweep preset's own points (hydra.sweeper.params) meet the command's groups too
            preset = self.base.hydra.sweeper.get("params") or {}
            from_preset = [f"{k}={v}" for k, v in preset.items() if k not in set(self.keys) and v is not None]
            own = own + from_preset
        sampled = "BasicSweeper" not in str(self.base.hydra.sweeper.get("_target_", ""))
        try:
            combos = sweep_points(own, sampled=sampled, dirs=self.dirs) if self.multirun else [own]
        except ValueError as e:
            return str(e) if str(e).startswith("specpipe:") else explain(e, own, self.dirs)
        except Exception as e:
            return explain(e, own, self.dirs)
        for combo in combos:
            try:
                cfg = compose_config(combo + hydra_own, self.config_name, config_dir=self.config_dir)
            except Exception as e:
                return self.preset_problem(e, from_preset) or explain(e, combo, self.dirs)
            refused = target_problems(cfg, "") if self.multirun else []  # a job's own checks come later; not these
            if refused:
                return str(ConfigError(refused))
            if not self.multirun and not self.prints:
                try:
                    validate(cfg)
                except ConfigError as e:
                    return str(e)
                except Exception as e:  # an override the rules did not foresee: still no traceback
                    return explain(e, combo, self.dirs)
        return None

    def preset_problem(self, exc: BaseException, from_preset: list[str]) -> Optional[str]:
        """A key that a sweep preset sweeps (not one the user typed), missing from the group option the command
        chose: the message names the preset."""
        from omegaconf.errors import ConfigAttributeError, ConfigKeyError

        err = omegaconf_error(exc)
        if not isinstance(err, (ConfigAttributeError, ConfigKeyError)):
            return None
        key = next((k for k in (o.split("=", 1)[0] for o in from_preset) if k == err.full_key), None)
        if key is None:
            return None
        name = self.base.hydra.runtime.choices.get("sweep") or "?"
        group = key.split(".")[0]
        chosen = self.base.hydra.runtime.choices.get(group)
        hint = keys_hint([f"{group}={chosen}"], group)
        return (f"specpipe: invalid override {group}={chosen}: the ready sweep sweep={name} sweeps {key}, which is "
                f"not a setting of {group}={chosen}{hint}; keep the sweep's own {group} option, or sweep "
                f"{group}={chosen}'s keys yourself (python -m specpipe -m {group}={chosen} {group}.KEY=v1,v2).")
