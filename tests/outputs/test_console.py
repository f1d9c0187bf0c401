"""The end-of-run summary names the drafter that ran (it used to say "eagle" for every drafter)."""
import pytest

from specpipe.outputs.console import print_summary


def metrics(draft: dict) -> dict:
    return {"config": {"draft": draft, "allocator": {"_target_": "specpipe.allocators.paged.PagedAllocator"}},
            "accept_length_mean": 2.5, "num_requests": 2, "num_errors": 0, "generated_tokens": 10, "wall_s": 1.0,
            "tokens_per_s": 10.0, "acceptance_rate_per_position": [0.5], "num_verify_steps": 4, "recompiles": 0,
            "kv_leaked_slots": 0, "stage_ms": {"verify": 1.0}, "stage_model_ms": {"verify": 0.5}}


@pytest.mark.parametrize("draft,title", [
    ({"method": "ngram", "topk": 4, "num_steps": 8, "num_draft_tokens": 12, "cache_tokens": 0}, "draft=ngram topk=4"),
    ({"method": "ngram", "topk": 4, "num_steps": 15, "num_draft_tokens": 16, "cache_tokens": 8192}, "draft=suffix"),
    ({"method": "eagle", "topk": 2, "num_steps": 3, "num_draft_tokens": 6}, "draft=eagle topk=2 steps=3 tokens=6"),
    ({"method": "standalone", "topk": 1, "num_steps": 4, "num_draft_tokens": 5}, "draft=standalone"),
    ({"method": "none", "topk": 1, "num_steps": 1, "num_draft_tokens": 2}, "draft=none"),
])
def test_title_names_the_drafter(capsys, draft, title):
    print_summary(metrics(draft), None)
    out = capsys.readouterr().out
    assert title in out and "PagedAllocator" in out


def test_stage_times_without_model_timing_have_no_model_column(capsys):
    m = metrics({"method": "none", "topk": 1, "num_steps": 1, "num_draft_tokens": 2})
    print_summary(m, None)
    assert "ms per round (model)" in capsys.readouterr().out
    print_summary({**m, "stage_model_ms": None}, None)
    out = capsys.readouterr().out
    assert "ms per round" in out and "(model)" not in out and "verify 1.00" in out


def test_a_run_in_which_no_stage_ran_prints_no_empty_stage_row(capsys):
    m = metrics({"method": "none", "topk": 1, "num_steps": 1, "num_draft_tokens": 2})
    print_summary({**m, "num_verify_steps": 0, "stage_ms": {}, "stage_model_ms": {}}, None)
    assert "ms in all" not in capsys.readouterr().out


def test_a_chunked_swa_prefill_is_noted_under_the_table(capsys):
    m = metrics({"method": "none", "topk": 1, "num_steps": 1, "num_draft_tokens": 2})
    print_summary({**m, "swa_chunked_prefills": 0, "swa_prefill_chunk_forwards": 0}, None)
    assert "ran in chunks" not in capsys.readouterr().out
    print_summary({**m, "swa_chunked_prefills": 2, "swa_prefill_chunk_forwards": 600,
                   "swa_prefill_chunk_min_tokens": 3}, None)
    out = " ".join(capsys.readouterr().out.split())
    assert "2 request prefill(s) ran in chunks (600 target forwards, as few as 3 tokens each)" in out
    assert "allocator.swa_num_slots" in out


def test_a_recompile_limit_hit_is_shown_beside_recompiles(capsys):
    m = metrics({"method": "none", "topk": 1, "num_steps": 1, "num_draft_tokens": 2})
    print_summary({**m, "recompile_limit_hits": 0}, None)
    assert "recompile limit" not in capsys.readouterr().out
    print_summary({**m, "recompile_limit_hits": 2}, None)
    out = capsys.readouterr().out
    assert "recompile limit hit 2x" in out and "eager)" in out


def test_requests_a_resumed_run_took_from_the_stopped_one_are_counted_apart(capsys):
    m = metrics({"method": "none", "topk": 1, "num_steps": 1, "num_draft_tokens": 2})
    print_summary(m, None)
    assert "before resume" not in capsys.readouterr().out
    print_summary({**m, "resumed_requests": 7}, None)
    assert any("finished before resume" in line and "7" in line for line in capsys.readouterr().out.splitlines())
