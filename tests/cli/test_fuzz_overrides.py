"""Fuzz the command line's overrides (issue #46): keys from the schemas and their typos, group=option with real
and bogus options, ~key and +key, values of every JSON type and interpolations. Each override list goes through
the checks `python -m specpipe` runs before decoding (argv handling, cli/precheck.py -> config/check.py, which
composes with config/compose.py and validates with config/validate.py) and SpecPipe's own check: each says what is
wrong in one paragraph or passes, and the config of a list that passes names only shipped classes. A few real
`python -m specpipe` runs check that nothing ends in a traceback or another exit code than 0 and 2.
FUZZ_EXAMPLES=N for a long run (tests/fuzz_strategies.py)."""
import os
import subprocess
import sys

import pytest
from hypothesis import Phase, event, example, given
from hypothesis import strategies as st
from omegaconf import DictConfig

from fuzz_strategies import LONG, RUN_UNSAFE, bounded, flags, fuzz_settings, overrides, shipped_targets
from specpipe.cli.argv import expand_globs, flags_first, parse_command
from specpipe.cli.precheck import precheck
from specpipe.config import check, compose
from specpipe.config.check import check_overrides
from specpipe.config.compose import compose_config
from specpipe.config.overrides import expand_home

TINY = ["model=random_tiny", "workload.num_prompts=1", "workload.max_new_tokens=2"]


def only_shipped_targets(cfg) -> None:
    """A config that passed the checks builds only classes its groups' schemas name (issue #46 item 1: a prefix
    such as specpipe.run.torch.load reached torch.load)."""
    allowed = shipped_targets()

    def walk(node, where: str) -> None:
        if not isinstance(node, DictConfig):
            return
        if "_target_" in node:
            group = where.split(".")[0]
            target = node.get("_target_")
            assert "." not in where and target in allowed.get(group, ()), f"{where}._target_={target!r} passed"
        for k in node.keys():
            walk(node._get_node(k), f"{where}.{k}" if where else str(k))

    walk(cfg, "")


class Composed:
    """compose_config, recording what the check composed: a list that passes is then checked on the config the
    check itself composed (composing is most of the check's time, so not again)."""

    def __init__(self):
        self.configs = []

    def __call__(self, *args, **kwargs):
        cfg = compose_config(*args, **kwargs)
        self.configs.append(cfg)
        return cfg

    def check_passed(self, prints: bool, multirun: bool) -> None:
        """The run's config (the last composed) builds only shipped classes; a sweep's points (validated as
        each job starts) and a printed config (never built) are not checked."""
        base = next((c for c in self.configs if "hydra" in c), None)  # the first point, with Hydra's node
        assert base is not None, "the check passed a command without composing its config"
        if not (prints or multirun or str(base.hydra.mode) == "RunMode.MULTIRUN"):
            only_shipped_targets(self.configs[-1])


HINTS: dict = {}  # the configs composed only to list valid keys and options in a message, by their arguments


def composed_for_hints(*args, **kwargs):
    """compose_config for the helpers that read a config to word a message (config/compose.py's keys_hint,
    valid_keys, default_value; override_errors): they compose the same few configs (the default, one per group
    option) again and again, so these are composed once per session. The check's own composing is not cached."""
    key = repr((args, sorted(kwargs.items())))
    if key not in HINTS:
        HINTS[key] = compose_config(*args, **kwargs)
    return HINTS[key]


@pytest.fixture
def composed(monkeypatch):
    rec = Composed()
    monkeypatch.setattr(check, "compose_config", rec)
    monkeypatch.setattr(compose, "compose_config", composed_for_hints)
    return rec


def said(msg, argv) -> None:
    assert msg is None or (isinstance(msg, str) and msg.startswith("specpipe:") and "Traceback" not in msg), \
        (argv, msg)
    event("passed" if msg is None else " ".join(msg.split(":")[1].split()[:3]))  # --hypothesis-show-statistics


# issue #46's own cases (items 1, 5 and 6), always run first
@example(argv=["model._target_=specpipe.run.torch.load"])
@example(argv=["allocator._target_=specpipe.allocators.swa.SWAAllocator"])
@example(argv=["allocator._target_=specpipe.nonexistent.Foo"])
@example(argv=["~device", "device.num_threads=1"])
@example(argv=["seed=${seed}"])
@example(argv=["seed=" + "1" * 5000])
@given(argv=st.tuples(flags(), overrides()).map(lambda t: t[0] + t[1]))
@fuzz_settings("overrides_cli")
def test_command_line_checks_say_what_is_wrong_or_pass(argv, composed):
    with bounded(60, f"the pre-run check of {argv}"):
        argv = expand_globs(flags_first(expand_home(list(argv))))  # as __main__.main does before precheck
        composed.configs.clear()
        msg = precheck(argv)
        said(msg, argv)
        c = parse_command(argv)
        if msg is None and not c.skip:
            composed.check_passed(c.prints, c.multirun)


@example(ovs=["allocator._target_=specpipe.api.json.dumps"])  # issue #46 item 1: accepted, then generate() raised
@given(ovs=overrides())
@fuzz_settings("overrides_api")
def test_api_override_checks_say_what_is_wrong_or_pass(ovs, composed):
    """SpecPipe(...)'s check (the constructor's first step; tests/test_fuzz_api.py builds some for real)."""
    with bounded(60, f"SpecPipe's check of {ovs}"):
        if any("=" not in o or o.startswith("-") for o in ovs):
            return  # SpecPipe refuses these itself, before the check
        ovs = expand_home(list(ovs))
        composed.configs.clear()
        msg = check_overrides(ovs, api=True)
        said(msg, ovs)
        if msg is None:
            composed.check_passed(prints=False, multirun=False)


argv_safe = overrides(exclude=RUN_UNSAFE, max_size=3).map(lambda ovs: [o for o in ovs if "\x00" not in o])


@example(ovs=["model._target_=specpipe.run.torch.load"])  # issue #46 item 1: really called torch.load, exit 1
@example(ovs=["allocator._target_=specpipe.allocators.swa.SWAAllocator"])  # item 5: a traceback
# found by this fuzz (FUZZ_EXAMPLES=20000): random_tiny's init_std / residual_scale had no range, so nan or inf (or
# 1e300) built NaN weights and every request failed at prefill, exit 1; now a config error (exit 2)
@example(ovs=["model.init_std=nan"])
@given(ovs=argv_safe)
@fuzz_settings("cli_subprocess", phases=[Phase.explicit, Phase.generate] + [Phase.shrink] * bool(LONG))
def test_python_m_specpipe_exits_0_or_2_without_a_traceback(ovs, tmp_path_factory):
    """Real runs: exit 0 (decoded) or 2 (one paragraph), never a traceback or Hydra's exit 1."""
    cwd = tmp_path_factory.mktemp("fuzz_cli")
    env = dict(os.environ, OMP_NUM_THREADS="1", HYDRA_FULL_ERROR="0")
    p = subprocess.run([sys.executable, "-m", "specpipe", *TINY, *ovs, f"hydra.run.dir={cwd / 'run'}"], cwd=cwd,
                       env=env, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    event(f"exit {p.returncode}")
    assert p.returncode in (0, 2) and "Traceback" not in p.stderr + p.stdout, (ovs, p.returncode, p.stderr[-3000:])
