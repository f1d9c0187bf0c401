"""Self-distillation: sampled continuations are sampled, and a chat target writes some of its own requests."""
from __future__ import annotations

from types import SimpleNamespace

import specpipe.run
from specpipe.models.hf.load import load_tiny
from specpipe.train.__main__ import compose_train
from specpipe.train.data import builtin_requests, generate, query_prefix, self_asked
from specpipe.workload.prompts import chat_set
from tests.workload.test_prompt_sets import chatml_tokenizer


def test_every_other_continuation_is_sampled_at_the_distillation_temperature(tmp_path):
    """The odd requests sample (they once ran greedy: the sampling was passed where no request reads it)."""
    pair = load_tiny(draft_path=None)
    cfg = compose_train(["model=tiny", f"out={tmp_path}", "device.num_threads=1"])
    text = "def parse(line):\n    fields = line.split(',')\n"
    seqs = generate(cfg, pair, [(text, "code", False)] * 4, False, 24, 4, 1.0, seed=11)
    assert [s.origin for s in seqs] == ["greedy", "sampled", "greedy", "sampled"]
    greedy, sampled = seqs[0].ids, [s.ids for s in seqs[1::2]]
    assert seqs[2].ids == greedy and all(s != greedy for s in sampled) and sampled[0] != sampled[1]


def test_a_chat_target_writes_requests_from_its_user_turn_opener(tmp_path, monkeypatch):
    tok = chatml_tokenizer(tmp_path / "tok")
    prefix = query_prefix(tok)
    assert tok.decode(prefix) == "system\nYou are a helpful AI assistant.\nuser\n"  # (specials decode to nothing)
    builtin = chat_set("chat")[0]["messages"][0]["content"]
    outputs = [("How do I keep basil alive on a windowsill?", "stop"), ("  " + builtin.upper() + " ", "stop"),
               ("Tell me", "stop"), ("Write a long essay about", "length"), ("What is a prime number?", "stop")]
    seen = {}

    def fake_run(cfg, quiet, pair, items):
        seen["items"] = items
        return {"requests": [SimpleNamespace(error=None, finish_reason=why, output_ids=tok.encode(text))
                             for text, why in outputs]}

    monkeypatch.setattr(specpipe.run, "run", fake_run)
    pair = SimpleNamespace(tokenizer=tok, target=SimpleNamespace(kv=None))
    cfg = compose_train(["model=tiny", f"out={tmp_path}"])
    asked = self_asked(cfg, pair, 5, 100, builtin_requests())
    assert [a[0] for a in asked] == ["How do I keep basil alive on a windowsill?", "What is a prime number?"]
    assert all(a[1:] == ("chat", False) for a in asked)  # (trained on, never held out)
    items = seen["items"]
    assert all(it["prompt_ids"] == prefix and it["sampling"]["temperature"] == 1.0 for it in items)
    assert len({it["seed"] for it in items}) == 5


def test_no_requests_of_its_own_without_a_template_that_renders_a_user_turn(tmp_path):
    assert query_prefix(load_tiny(draft_path=None).tokenizer) is None  # no chat template
    tok = chatml_tokenizer(tmp_path / "tok")

    class Refuses:
        def render(self, messages, add_generation_prompt=True):
            raise ValueError("Conversation roles must alternate user/assistant/user/assistant/...")
    tok.chat_template = Refuses()
    assert query_prefix(tok) is None


def test_the_distillation_decodes_packed_and_leaves_the_weights_dense_for_the_features(tmp_path, monkeypatch):
    """The decodes run oneDNN-packed weights (faster at distillation's batch sizes); prepare_data lays them out
    row-major again, because the features' forward and the new head's lm_head rows read them densely."""
    import torch

    from specpipe.devices.weight_layout import PackedLinear, packing_available
    from specpipe.train.data import prepare_data

    from specpipe.train.features import target_features

    pair = load_tiny(draft_path=None)
    probe = torch.randint(0, 258, (2, 16), generator=torch.Generator().manual_seed(0))

    def feats():
        return target_features(pair.target, probe, [0, 1], 4, False, torch.device("cpu"))
    before = feats()
    layouts, real_run = [], specpipe.run.run

    def spy(cfg, **kw):
        layouts.append(cfg.device.weight_layout)
        out = real_run(cfg, **kw)
        layouts.append(any(isinstance(m, PackedLinear) for m in pair.target.modules()))
        return out

    monkeypatch.setattr(specpipe.run, "run", spy)
    cfg = compose_train(["model=tiny", f"out={tmp_path}", "device.num_threads=1", "data.sources=[stdlib]",
                         "data.max_chars=20000", "data.distill_batch=4", "data.distill_new_tokens=8",
                         "eval.heldout_prompts=2"])
    data = prepare_data(cfg, pair, seconds=3.0)
    assert data.heldout_greedy and layouts[0] == "packed"
    assert layouts[1] == packing_available()  # packed while it decoded, where oneDNN can pack
    assert not any(isinstance(m, PackedLinear) for m in pair.target.modules())
    assert all(p.layout == torch.strided and p.is_contiguous() for p in pair.target.parameters())
    after = feats()
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(before, after))  # the same values, read densely
