"""A drafter is its file, its schema and its YAML: the run builds it from the schema's `_target_`, and nothing else
names it. One added here (a module standing in for specpipe/drafters/repeat.py, a schema dataclass and a YAML in a
user's config folder) decodes with no other file changed; every shipped option names a class in its own file."""
import sys
import types
from dataclasses import dataclass

import pytest
import torch
from hydra.core.config_store import ConfigStore
from hydra.utils import get_class

from helpers import compose
from specpipe.config.compose import CONF_DIR, compose_config
from specpipe.config.schema import DraftConf, draft_schema, draft_schemas
from specpipe.drafters.base import Proposer
from specpipe.stages.tree_layout import tree_from_parents


class RepeatProposer(Proposer):
    """Drafts a chain that repeats the last committed token: right wherever the target repeats itself, and never
    able to change what is committed (the verify keeps the target's own tokens)."""

    calls = 0

    @classmethod
    def build(cls, cfg, pair, setup):
        return cls(cfg.draft.num_steps, cfg.draft.num_draft_tokens)

    def __init__(self, num_steps: int, num_draft_tokens: int):
        self.S, self.N = num_steps, num_draft_tokens

    def propose(self, pipe, rows_t, L, L_t):
        RepeatProposer.calls += 1
        root = pipe.last_token  # [B]
        B = root.shape[0]
        tokens = root[:, None].expand(B, self.N).contiguous()  # [B, N]: the root, then N-1 copies of it
        parent = (torch.arange(self.N, device=root.device) - 1).expand(B, self.N).contiguous()  # [B, N] a chain
        return tree_from_parents(tokens, parent, L_t, self.S), None


@dataclass
class RepeatDraftConf(DraftConf):  # (config.drafts holds the shipped ones; a test's stays out of their list)
    _target_: str = "specpipe.drafters.repeat.RepeatProposer"
    method: str = "repeat"
    topk: int = 1
    num_steps: int = 3
    num_draft_tokens: int = 4


YAML = """# Repeat the last token as the draft. Run: python -m specpipe draft=repeat
defaults:
  - base_repeat
  - _self_
num_steps: 3
num_draft_tokens: 4
"""


@pytest.fixture
def repeat_drafter(monkeypatch, tmp_path):
    """The three pieces of a new drafter: its module, its schema (registered as conf/draft YAMLs expect) and its
    YAML (in a config folder of the user's, `-cd`); returns that folder."""
    import specpipe.drafters

    module = types.ModuleType("specpipe.drafters.repeat")
    module.RepeatProposer = RepeatProposer
    monkeypatch.setitem(sys.modules, "specpipe.drafters.repeat", module)
    monkeypatch.setattr(specpipe.drafters, "repeat", module, raising=False)
    compose("draft=none")  # (registers the shipped schemas first, as every compose does)
    ConfigStore.instance().store(group="draft", name="base_repeat", node=RepeatDraftConf)
    (tmp_path / "draft").mkdir()
    (tmp_path / "draft" / "repeat.yaml").write_text(YAML)
    yield tmp_path
    ConfigStore.instance().repo["draft"].pop("base_repeat.yaml", None)


def test_a_drafter_added_in_its_own_file_decodes_as_plain_greedy_decoding(repeat_drafter):
    from specpipe.run import run

    over = ["model=random_tiny", "device.dtype=float64", "workload.num_prompts=3", "workload.max_new_tokens=12",
            "workload.batch_size=2", "speculation=static"]  # (the drafter is asked every step)
    cfg = compose_config([*over, "draft=repeat"], config_dir=str(repeat_drafter))
    assert draft_schema(cfg.draft) is RepeatDraftConf and draft_schema(cfg.draft).label(cfg.draft) == "repeat"
    RepeatProposer.calls = 0
    out = run(cfg, quiet=True)
    plain = run(compose(*over, "draft=none"), quiet=True)
    assert [r.output_ids for r in out["requests"]] == [r.output_ids for r in plain["requests"]]
    assert all(len(r.output_ids) == 12 for r in out["requests"])
    m = out["metrics"]
    assert RepeatProposer.calls == m["num_verify_steps"] > 0 and m["kv_leaked_slots"] == 0
    assert m["config"]["draft"]["_target_"] == "specpipe.drafters.repeat.RepeatProposer"
    assert "repeat" not in draft_schemas()  # the shipped list (messages, register_schemas) is left alone


def draft_options() -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / "draft").glob("*.yaml"))


@pytest.mark.parametrize("option", draft_options())
def test_every_draft_option_builds_a_class_of_its_own_file(option):
    cfg = compose(f"draft={option}")
    schema = draft_schema(cfg.draft)
    assert draft_schemas()[option] is schema and cfg.draft._target_ == schema._target_
    drafter = get_class(cfg.draft._target_)
    assert drafter.__module__ == f"specpipe.drafters.{option}" and issubclass(drafter, Proposer)
    assert callable(drafter.build)


def test_every_shipped_draft_schema_has_its_yaml():
    assert sorted(draft_schemas()) == draft_options()
