"""A `_target_` is built only when it is, as written, the class its node's schema names (issue #46: a prefix rule
let `specpipe.run.torch.load` through to torch.load). The check imports nothing, and build() applies it again."""
import sys

import pytest
from omegaconf import OmegaConf

from helpers import compose
from specpipe.config.build import build, check_target, group_targets, target_problems
from specpipe.config.validate import validate
from specpipe.errors import ConfigError

ALLOCATORS = "allocator={token,paged,swa,hisparse}"

# (override, what the message says besides the value and the group's options); the issue's examples first
REFUSED = [
    ("model._target_=specpipe.app.torch.load", "no model option's schema names it"),  # the issue's spelling
    ("model._target_=specpipe.run.torch.load", "an alias through another module is refused too"),  # app.py's name now
    ("allocator._target_=specpipe.app.os.system", "no allocator option's schema names it"),
    ("allocator._target_=specpipe.run.os.system", "no allocator option's schema names it"),
    ("allocator._target_=specpipe.run.json.dumps", "no allocator option's schema names it"),
    ("allocator._target_=specpipe.nonexistent.Foo", "no allocator option's schema names it"),
    ("allocator._target_=os.system", "no allocator option's schema names it"),
    ("allocator._target_=specpipe.allocators.swa.SWAAllocator",
     "specpipe.allocators.swa.SWAAllocator is allocator=swa's class, so choose it with the config group: "
     "allocator=swa"),
    ("model._target_=specpipe.allocators.paged.PagedAllocator",
     "specpipe.allocators.paged.PagedAllocator is allocator=paged's class, not a model"),
    ("draft._target_=specpipe.drafters.ngram.NgramProposer", "so choose it with the config group: draft=ngram"),
    ("device._target_=specpipe.devices.cuda.CudaDevice", "so choose it with the config group: device=cuda"),
]


@pytest.mark.parametrize("override,fragment", REFUSED, ids=[o for o, _ in REFUSED])
def test_a_target_the_schema_does_not_name_is_a_config_error(override, fragment):
    key, value = override.split("=", 1)
    cfg = compose("model=random_tiny", override)
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    msg = str(e.value)
    assert f"{key}={value!r} is refused: a config builds only the class (or function) that its" in msg, msg
    assert fragment in msg, msg
    group = key.split(".")[0]
    assert f"{group}={{" in msg and "Traceback" not in msg and "ImportError" not in msg


def test_the_message_names_the_chosen_option_and_every_option_of_the_group():
    msg = check_target(compose("allocator=paged", "allocator._target_=specpipe.run.os.system").allocator, "allocator")
    assert "(the chosen allocator=paged builds specpipe.allocators.paged.PagedAllocator)" in msg
    assert f"Choose the class with the config group ({ALLOCATORS}) and leave allocator._target_ alone" in msg


@pytest.mark.parametrize("group", ["device", "allocator", "model", "draft"])
def test_every_option_builds_what_its_schema_names(group):
    for option, target in group_targets(group).items():
        cfg = compose(f"{group}={option}")
        assert cfg[group]._target_ == target and check_target(cfg[group], group) is None


def test_the_check_imports_nothing():
    """Names are compared as strings: a refused one is never imported (a module could run code on import), and
    config/ stays torch-free."""
    name = "specpipe_never_imported_46"
    cfg = compose("model=random_tiny", f"allocator._target_={name}.Foo")
    assert check_target(cfg.allocator, "allocator") is not None
    assert name not in sys.modules


def test_build_refuses_before_hydra_imports_anything():
    """build() is the last gate: a node changed after validate() (a program editing SpecPipe.cfg) is refused
    there, with the same message, not run."""
    cfg = compose("model=random_tiny")
    OmegaConf.update(cfg, "allocator._target_", "specpipe.run.json.dumps")
    with pytest.raises(ConfigError, match=r"allocator._target_='specpipe.run.json.dumps' is refused"):
        build(cfg.allocator, "allocator", num_slots=8)
    with pytest.raises(ConfigError, match=r"device._target_='builtins.print' is refused"):
        build(OmegaConf.create({"_target_": "builtins.print"}), "device")


def test_a_nested_target_is_refused_hydra_would_build_it_too():
    node = OmegaConf.create({"_target_": "specpipe.allocators.paged.PagedAllocator",
                             "inner": {"_target_": "os.system", "command": "true"}})
    problems = target_problems(node, "allocator")
    assert len(problems) == 1 and "allocator.inner._target_='os.system' is refused: only a config group's node" \
        in problems[0]
    with pytest.raises(ConfigError, match="allocator.inner._target_='os.system'"):
        build(node, "allocator")


def test_a_node_of_no_schema_may_name_a_class_of_its_group_only():
    """A user's YAML option without a base_* default has no schema of its own: any class its group's schemas name
    is built, nothing else."""
    untyped = OmegaConf.create
    assert check_target(untyped({"_target_": "specpipe.allocators.paged.PagedAllocator"}), "allocator") is None
    msg = check_target(untyped({"_target_": "specpipe.models.random_tiny.build_random_tiny"}), "allocator")
    assert "specpipe.models.random_tiny.build_random_tiny is model=random_tiny's class, not an allocator" in msg


def test_a_huge_target_is_quoted_short():
    msg = check_target(compose("model=random_tiny", "allocator._target_=" + "x" * 5000).allocator, "allocator")
    assert "'" + "x" * 120 + "...'" in msg and len(msg) < 800
