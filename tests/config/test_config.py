"""Every option of every config group composes and validates; bad overrides give one clear paragraph."""

import pytest
from omegaconf import OmegaConf

from helpers import compose
from specpipe.cli.precheck import precheck
from specpipe.config.compose import CONF_DIR
from specpipe.errors import ConfigError
from specpipe.config.validate import validate

GROUPS = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir() and not p.name.startswith(("hydra", "sweep")))
EXTRA = {"model=hf": ["model.path=/nonexistent"]}  # required fields of an option


def options():
    for g in GROUPS:
        for f in sorted((CONF_DIR / g).glob("*.yaml")):
            yield f"{g}={f.stem}"


@pytest.mark.parametrize("choice", list(options()))
def test_every_option_composes_and_validates(choice):
    extra = EXTRA.get(choice, [])
    if choice.startswith("compile=graph"):
        extra = extra + ["device=cuda"]  # graph capture is for accelerators; cpu rejects it (tested below)
    cfg = compose(choice, *extra)
    validate(cfg)
    group, opt = choice.split("=")
    assert cfg[group] is not None
    assert OmegaConf.to_container(cfg, resolve=True)
    target = cfg[group].get("_target_")
    if target is not None:
        assert target.startswith("specpipe.")


BAD = [
    (["allocator=foo"], "has no option 'foo'"),
    (["draft.topk=abc"], "draft.topk"),
    (["draft.bogus=1"], "'draft.bogus' is not a configuration key"),
    (["draft.topk=2", "draft.num_steps=2", "draft.num_draft_tokens=20"], "num_draft_tokens=20 is too large"),
    (["draft.topk=1", "draft.num_steps=3", "draft.num_draft_tokens=6"], "must be <= num_steps+1"),
    (["allocator._target_=os.system"], "allocator._target_='os.system' is refused: a config builds only the class"),
    (["compile.draft_topk.later=jit"], "unknown mode 'jit'"),
    (["allocator=paged", "allocator.page_size=3"], "page_size=3 must be a power of two"),
    (["allocator.num_slots=10"], "smaller than one request needs"),
    (["workload.batch_size=0"], "workload.batch_size=0 must be >= 1"),
    (["workload.prompts_file=/does/not/exist.jsonl"], "is not a readable file"),
    (["model=hf"], "model.path is required"),
    (["device.dtype=float8"], "device.dtype='float8' is unknown"),
    (["seed=-1"], "seed=-1 must be between 0 and 2**63-1"),
]


@pytest.mark.parametrize("overrides,fragment", BAD)
def test_bad_override_is_one_paragraph_naming_the_value(overrides, fragment):
    msg = precheck(overrides)
    assert msg is not None and fragment in msg, msg
    assert msg.startswith("specpipe:")
    assert "Traceback" not in msg


def test_all_violations_reported_at_once():
    cfg = compose("draft.topk=0", "workload.max_new_tokens=0", "workload.batch_size=0")
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert len(e.value.errors) == 3
    assert "3 problems" in str(e.value)


def test_bad_multirun_point_is_caught_before_any_job():
    msg = precheck(["-m", "draft.topk=1,banana"])
    assert msg is not None and "draft.topk" in msg


def test_valid_overrides_pass():
    assert precheck(["draft.topk=2", "allocator=paged", 'compile.draft_topk.later="compile(dynamic=false)"']) is None
    assert precheck(["draft.topk=1"]) is None  # the tree size follows the shape unless set


def test_unquoted_policy_options_get_a_quoting_hint():
    msg = precheck(["compile.draft_topk.later=compile(dynamic=false)"])
    assert "quote a policy expression" in msg
    assert precheck(["-m", "draft.topk=1,2", "allocator=token,paged"]) is None


@pytest.mark.parametrize("shape, want", [([], (4, 8, 12)), (["draft.topk=1", "draft.num_steps=4"], (1, 4, 5)),
                                         (["draft.topk=2", "draft.num_steps=3"], (2, 3, 7))])
def test_ngram_tree_size_follows_the_shape_unless_set(shape, want):
    """The n-gram trie default (12 nodes) shrinks to what topk chains of num_steps can hold, so
    overriding the shape alone never yields an invalid num_draft_tokens."""
    d = compose("draft=ngram", *shape).draft
    assert (d.topk, d.num_steps, d.num_draft_tokens) == want
    assert compose("draft=ngram", *shape, "draft.num_draft_tokens=3").draft.num_draft_tokens == 3


def test_suffix_tree_size_follows_its_shape():
    """draft=suffix sizes its trie like draft=ngram (1 + topk*num_steps, here at most 16): changing num_steps
    alone gives a valid config (a fixed 16 broke at num_steps=3)."""
    assert compose("draft=suffix").draft.num_draft_tokens == 16
    cfg = compose("draft=suffix", "draft.num_steps=3")
    assert cfg.draft.num_draft_tokens == 13
    validate(cfg)


@pytest.mark.parametrize("draft, topk, steps, ntok", [("ngram", 1024, 128, 1024), ("suffix", 256, 128, 1024),
                                                      ("ngram", 64, 128, 1024)])
def test_ngram_trie_too_large_to_compare_is_a_config_error(draft, topk, steps, ntok):
    """The trie compares its 4*topk best matches pairwise at every depth: topk=1024, num_steps=128 would
    allocate tens of GiB mid-run (a traceback); it is refused up front with a topk that fits."""
    cfg = compose(f"draft={draft}", f"draft.topk={topk}", f"draft.num_steps={steps}", f"draft.num_draft_tokens={ntok}")
    with pytest.raises(ConfigError, match=r"compares its \d+ \(4\*topk\) best matches") as e:
        validate(cfg)
    assert f"draft.topk<=45 at num_steps={steps}" in str(e.value)
    validate(compose(f"draft={draft}", "draft.topk=45", f"draft.num_steps={steps}", f"draft.num_draft_tokens={ntok}"))


def test_ngram_chain_of_any_valid_depth_stays_valid():
    validate(compose("draft=ngram", "draft.topk=1", "draft.num_steps=128", "draft.num_draft_tokens=129"))


@pytest.mark.parametrize("group", ["token", "paged", "swa", "hisparse"])
def test_allocator_rules_are_the_allocator_schemas_data(group):
    """The page-size and compiled-forward rules come from the allocator's schema, not from its name: the token
    allocator refuses pages, hisparse a compiled target forward, and the others accept both."""
    errors = []
    try:
        validate(compose(f"allocator={group}", "allocator.page_size=4", "compile.verify.target_forward=compile"))
    except ConfigError as e:
        errors = str(e)
    assert ("the token allocator has page size 1" in errors) == (group == "token")
    assert ("cannot run with allocator=hisparse" in errors) == (group == "hisparse")


@pytest.mark.parametrize("key,value", [("init_std", "nan"), ("init_std", "0"), ("init_std", "1e300"),
                                       ("residual_scale", "-1"), ("residual_scale", "inf")])
def test_the_random_models_weight_scales_are_checked(key, value):
    """issue #46's fuzz found model.init_std=nan accepted: every request then failed at prefill (exit 1)."""
    with pytest.raises(ConfigError, match=rf"model\.{key}=\S+ must be [>=]+ 0 and <= 10"):
        validate(compose("model=random_tiny", f"model.{key}={value}"))
    validate(compose("model=random_tiny", f"model.{key}=0.5"))
