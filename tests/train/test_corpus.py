"""The training text never holds the built-in held-out prompts, and chats are built as the chat template expects."""
from __future__ import annotations

import json

from specpipe.train.corpus import (Source, as_chat, everyday_requests, is_heldout, pieces, read_text, sources,
                                   title_of)
from specpipe.workload.prompts import HELDOUT


def test_heldout_prompts_come_only_from_heldout_sources():
    """The `heldout` prompt set (code contexts the shipped pair never saw) is what acceptance is measured on: the
    split here is train_tiny.py's, so every file a prompt was cut from is held out, under the same name."""
    lines = [json.loads(line) for line in HELDOUT.read_text(encoding="utf-8").splitlines() if line]
    names = {s.name: s for s in sources(["stdlib"], [])}
    for it in lines:
        assert is_heldout(it["source"], 64), it["source"]
        if it["source"] in names:  # (a prompt of another Python version's stdlib may name a file not here)
            assert it["prompt"] in read_text(names[it["source"]].path)
    assert sum(it["source"] in names for it in lines) >= len(lines) // 2


def test_a_piece_becomes_a_request_and_its_answer(tmp_path):
    lines = [f"line {i}\n" for i in range(40)]
    text = "".join(lines)
    parts = pieces(text, 100)
    assert "".join(parts) == text and all(len(p) <= 100 for p in parts)
    src = Source("pkg/mod.py", tmp_path / "mod.py", "code")
    for i in range(6):
        user, answer = as_chat(src, title_of(src, '"""Does things."""\n'), "".join(lines[:12]), i)
        assert user["role"] == "user" and answer["role"] == "assistant" and "pkg.mod" in user["content"]
        assert user["content"].endswith("".join(lines[:4]) + "```") or answer["content"] == "".join(lines[:12])
    assert len(set(everyday_requests(50, 0))) == 50 and everyday_requests(5, 0) == everyday_requests(5, 0)
