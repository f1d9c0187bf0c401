"""The draft= schemas say which settings their drafter never reads: a run names those given (issue #46:
`draft=none draft.topk=1000 draft.num_steps=50` was accepted without a word, as draft.path no longer is)."""
import pytest

from helpers import compose
from specpipe.config.schema import draft_schema, draft_schemas

BASE = ["model=random_tiny", "workload.num_prompts=2", "workload.max_new_tokens=6", "device.dtype=float64"]


def notes(*overrides: str) -> list[str]:
    cfg = compose(*overrides)
    return draft_schema(cfg.draft).unread_notes(cfg.draft)


def test_draft_none_names_the_tree_settings_it_does_not_read():
    assert notes("draft=none", "draft.topk=1000", "draft.num_steps=50") == [
        "specpipe: note: draft.topk=1000 and draft.num_steps=50 are not read: draft=none decodes one token per step, "
        "with no draft tree (draft={eagle,ngram,suffix,standalone} read them)"]
    assert notes("draft=none", "draft.num_draft_tokens=9")[0].startswith(
        "specpipe: note: draft.num_draft_tokens=9 is not read: draft=none")
    assert notes("draft=none", "draft.topk=1") == []  # its own default: nothing given
    assert notes("draft=none") == []


@pytest.mark.parametrize("option", sorted(draft_schemas()))
def test_a_drafter_that_reads_its_tree_settings_has_no_note_for_them(option):
    said = notes(f"draft={option}", "draft.topk=2", "draft.num_steps=2", "draft.num_draft_tokens=3")
    assert bool(said) == (option == "none"), said


def test_draft_path_keeps_its_own_note():
    assert notes("draft=ngram", "draft.path=/x") == [
        "specpipe: note: draft.path=/x is not read: draft=ngram uses no draft model (draft=eagle and draft=standalone "
        "do)"]


def test_out_of_range_values_are_still_refused():
    """An unread key keeps its schema's range: the note is for values that change nothing, not for any value."""
    from specpipe.config.validate import validate
    from specpipe.errors import ConfigError

    with pytest.raises(ConfigError, match="draft.topk=5000 must be between 1 and 1024"):
        validate(compose("draft=none", "draft.topk=5000"))


def test_a_run_notes_them_and_decodes_as_without_them(capsys):
    from specpipe.run import run

    plain = run(compose(*BASE, "draft=none"), quiet=True)
    assert "not read" not in capsys.readouterr().err
    given = run(compose(*BASE, "draft=none", "draft.topk=1000", "draft.num_steps=50"), quiet=True)
    err = capsys.readouterr().err
    assert "specpipe: note: draft.topk=1000 and draft.num_steps=50 are not read: draft=none" in err, err
    assert [r.output_ids for r in given["requests"]] == [r.output_ids for r in plain["requests"]]
