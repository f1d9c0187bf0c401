"""A prompt's own temperature / top_p / top_k: greedy and sampled requests share one batch. Greedy ones give
exactly the greedy tokens; sampled ones give what the same settings give run-wide (same seeds)."""
import json

import pytest

from helpers import compose, random_prompts
from specpipe.run import run
from specpipe.models.random_tiny import build_random_tiny

HOT = {"temperature": 0.9, "top_k": 30, "top_p": 0.95}


@pytest.fixture(scope="module")
def pair():
    return build_random_tiny(seed=4, dtype="float64")


def decode(pair, tmp_path, name, lines, *overrides):
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    cfg = compose("model=random_tiny", "device.dtype=float64", f"workload.prompts_file={path}",
                  "workload.max_new_tokens=16", "workload.batch_size=4",
                  "speculation=static", *overrides)  # (a sampled chain's tokens follow the widths: not timings)
    out = run(cfg, quiet=True, pair=pair)
    assert out["metrics"]["num_errors"] == 0
    return [r.output_ids for r in out["requests"]]


@pytest.mark.parametrize("drafter", [["draft.topk=2", "draft.num_steps=3"], ["draft=ngram"],
                                     ["draft=standalone", "draft.topk=1", "draft.num_steps=3"], ["draft=none"]])
def test_greedy_and_sampled_requests_share_a_batch(pair, tmp_path, drafter):
    prompts = random_prompts(9, [4, 9, 16, 25, 7, 12])
    hot = [i % 2 == 1 for i in range(len(prompts))]
    greedy = decode(pair, tmp_path, "g", [{"prompt": p} for p in prompts], "draft=none")
    # the run greedy, odd prompts sampling on their own; then the run sampling, even prompts greedy on their own
    mixed = decode(pair, tmp_path, "a", [{"prompt": p, "seed": i, **(HOT if h else {})}
                                         for i, (p, h) in enumerate(zip(prompts, hot))], *drafter)
    flipped = decode(pair, tmp_path, "b", [{"prompt": p, "seed": i, **({} if h else {"temperature": 0})}
                                           for i, (p, h) in enumerate(zip(prompts, hot))], *drafter,
                     *(f"sampling.{k}={v}" for k, v in HOT.items()))
    assert mixed == flipped  # a request's tokens follow its own settings and seed, whatever the run default
    for out, ref, h in zip(mixed, greedy, hot):
        if not h:
            assert out == ref  # greedy requests: exactly the target's greedy decode
    assert any(out != ref for out, ref, h in zip(mixed, greedy, hot) if h)  # the others really sampled


def test_bad_per_prompt_sampling_fails_the_request(pair, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in [{"prompt": "a", "temperature": -1},
                                                             {"prompt": "b", "top_p": 0}, {"prompt": "c", "top_k": 2.5},
                                                             {"prompt": "d", "temperature": "hot"}, {"prompt": "e"},
                                                             {"prompt": "f", "min_p": 1.5},
                                                             {"prompt": "g", "typical_p": 0.9}]))
    cfg = compose("model=random_tiny", "device.dtype=float64", f"workload.prompts_file={path}",
                  "workload.max_new_tokens=4")
    reqs = run(cfg, quiet=True, pair=pair)["requests"]
    assert '"temperature" must be a number >= 0 and finite (0, or below 1e-5, is greedy), got -1' in reqs[0].error
    assert '"top_p" must be a number in (0, 1], got 0' in reqs[1].error
    assert '"top_k" must be an integer >= 0 and below 2**31, got 2.5' in reqs[2].error
    assert "got 'hot'" in reqs[3].error and reqs[4].error is None
    assert '"min_p" must be a number in [0, 1] (0 is off), got 1.5' in reqs[5].error
    assert '"typical_p"' in reqs[6].error and "typical sampling is not applied" in reqs[6].error


@pytest.mark.parametrize("drafter", [["draft.topk=2", "draft.num_steps=3"], ["draft=none"],
                                     ["draft=standalone", "draft.topk=1", "draft.num_steps=3"]])
def test_min_p_bounds_what_is_sampled(pair, tmp_path, drafter):
    """min_p (run-wide or a prompt's own) keeps only tokens at least min_p times as likely as the most likely:
    every first token drawn lies in that set (without min_p, many do not), and drafting changes no token (sampled
    standalone chains draw with their own coins: the same law, other tokens)."""
    import torch

    from specpipe.stages.verify_sampling import process_logits

    prompt = random_prompts(3, [6])[0]
    with torch.no_grad():
        logits = pair.target.logits(pair.target(torch.tensor([pair.tokenizer.encode(prompt)]))[:, -1:])
    one = torch.ones(1, dtype=torch.float64)
    allowed = set(process_logits(logits, one, one, torch.zeros(1, dtype=torch.long), one * 0.9)[0, 0]
                  .nonzero()[:, 0].tolist())
    lines = [{"prompt": prompt, "seed": i} for i in range(60)]
    free = decode(pair, tmp_path, "free", lines, *drafter, "sampling.temperature=1.0")
    assert sum(o[0] not in allowed for o in free) > 10  # the test can see min_p at all
    got = decode(pair, tmp_path, "minp", lines, *drafter, "sampling.temperature=1.0", "sampling.min_p=0.9")
    assert all(o[0] in allowed for o in got)
    own = decode(pair, tmp_path, "own", [{**x, "min_p": 0.9} for x in lines], *drafter, "sampling.temperature=1.0")
    assert own == got
    if "draft=standalone" not in drafter:
        assert got == decode(pair, tmp_path, "plain", lines, "draft=none", "sampling.temperature=1.0",
                             "sampling.min_p=0.9")


def test_a_top_p_below_float32_resolution_keeps_the_most_likely_token():
    """1e-300 is a valid top_p but rounds to 0 in float32: the nucleus still holds the top token (it was empty,
    and the sampler then picked the last vocabulary id, the EOS, for every request)."""
    import torch

    from specpipe.stages.verify_sampling import process_logits

    logits = torch.randn(3, 2, 50, generator=torch.Generator().manual_seed(0))
    for top_p in (1e-300, 1e-46, 1e-10):
        probs = process_logits(logits, torch.ones(3), torch.full((3,), top_p), torch.zeros(3, dtype=torch.long))
        assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 50).float())
