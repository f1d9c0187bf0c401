"""SamplingState's repetition penalty: each tree node is penalized for its own context, as HF's
RepetitionPenaltyLogitsProcessor would penalize that sequence."""
import pytest
import torch

from helpers import ancestors
from specpipe.decode.sampling import SamplingState


def hf_penalty(logits: torch.Tensor, context: list[int], penalty: float) -> torch.Tensor:
    """transformers' rule on one row: gather the context's logits, < 0 times penalty, else divided, scatter."""
    ids = torch.tensor(sorted(set(context)), dtype=torch.int64)
    out = logits.clone()
    score = out[ids]
    out[ids] = torch.where(score < 0, score * penalty, score / penalty)
    return out


def test_tree_nodes_are_penalized_for_the_prompt_the_output_and_their_own_path():
    g = torch.Generator().manual_seed(0)
    B, N, V = 3, 9, 6  # a tiny vocabulary: tokens repeat across branches and along paths
    parent = torch.tensor([[-1, 0, 0, 1, 1, 2, 3, 6, 5], [-1, 0, 1, 2, 3, 4, 5, 6, 7], [-1, 0, 0, 0, 0, 1, 2, 3, 4]])
    mask = ancestors(parent)
    tokens = torch.randint(0, V, (B, N), generator=g)
    contexts = [[0, 1], [4], [5, 5, 2]]
    state = SamplingState(0.0, 1.0, 0, "cpu", max_context=8, penalized=True)
    state.join([1, 2, 3], [None, (0.0, 1.0, 0, 1.7), (0.0, 1.0, 0, 0.6)], contexts)
    state.penalty[0] = 2.5
    logits = torch.randn(B, N, V, generator=g, dtype=torch.float64)
    got = state.penalize_tree(logits.clone(), tokens, mask)
    for b, pen in enumerate((2.5, 1.7, 0.6)):
        for j in range(N):
            path = [int(tokens[b, k]) for k in range(N) if mask[b, j, k]]
            assert torch.equal(got[b, j], hf_penalty(logits[b, j], contexts[b] + path, pen)), (b, j)

    # committed tokens join the context: the first count+1 of each row
    state.note(torch.tensor([[3, 4, 0], [1, 2, 3], [4, 4, 4]]), torch.tensor([0, 2, 1]))
    flat = torch.randn(B, V, generator=g, dtype=torch.float64)
    got = state._penalized_at(flat.clone(), state.context, state.penalty)
    for b, (ctx, pen) in enumerate(zip(([0, 1, 3], [4, 1, 2, 3], [5, 5, 2, 4, 4]), (2.5, 1.7, 0.6))):
        assert torch.equal(got[b], hf_penalty(flat[b], ctx, pen)), b
    state.keep(torch.tensor([2, 0]))
    assert state.penalty.tolist() == [0.6, 2.5] and state.context_len.tolist() == [5, 3]
    state.note(torch.tensor([[1]]), rows=torch.tensor([1]))
    assert state.context[1, :4].tolist() == [0, 1, 3, 1] and state.context_len.tolist() == [5, 4]


def test_a_state_without_a_penalty_keeps_no_context():
    state = SamplingState(0.0, 1.0, 0, "cpu")
    state.join([1], [(0.0, 1.0, 0)])
    logits = torch.randn(1, 4, 10)
    assert not state.penalized and state.penalize_tree(logits, torch.zeros(1, 4, dtype=torch.long), None) is logits


def test_extreme_penalties_saturate_instead_of_making_inf_or_nan():
    """Any finite penalty > 0 is valid: one that overflows float32 (1e39) or underflows it (1e-300) must still
    leave finite logits (a non-finite logit fails the request as if the target had produced it)."""
    logits = torch.tensor([[[2.0, -3.0, 0.0, 1.0]]])
    state = SamplingState(0.0, 1.0, 0, "cpu", max_context=4, penalized=True)
    state.join([1, 2], [(0.0, 1.0, 0, 1e39), (0.0, 1.0, 0, 1e-300)], [[0, 1, 2], [0, 1, 2]])
    out = state.penalize_tree(logits.expand(2, 1, 4).clone(), torch.tensor([[3], [3]]),
                              torch.ones(2, 1, 1, dtype=torch.bool))
    assert torch.isfinite(out).all()
    big, tiny = out[0, 0], out[1, 0]
    assert big[0] < 1e-30 and big[1] < -1e38 and big[2] == 0  # 2/1e39, -3*1e39, 0 untouched in sign
    assert tiny[0] > 1e38 and -1e-30 < tiny[1] <= 0  # the reverse: the repeated token is all but forced
    assert 0 < big[3] < 1e-30  # the node's own token (3, on its path) is penalized too


def test_a_temperature_just_below_the_greedy_cutoff_is_greedy_in_float32_too():
    from specpipe.stages.verify_sampling import GREEDY_TEMPERATURE, process_logits

    t = 9.9999999e-6  # < 1e-5, but float32 rounds it to 1e-5
    assert t < GREEDY_TEMPERATURE and torch.tensor(t, dtype=torch.float32) == GREEDY_TEMPERATURE
    state = SamplingState(0.7, 1.0, 0, "cpu")
    state.join([1, 2], [(t, 1.0, 0), None])
    assert state.temperature.tolist() == [0.0, torch.tensor(0.7).item()]
    probs = process_logits(torch.tensor([[[0.0, 1e-5, -3.0]]]), state.temperature[:1], state.top_p[:1],
                           state.top_k[:1])
    assert probs[0, 0].tolist() == [0.0, 1.0, 0.0]


@pytest.mark.parametrize("drafter", [["draft.topk=2", "draft.num_steps=3"], ["draft=none"]], ids=["eagle", "none"])
def test_the_penalized_width_covers_every_context(tmp_path, drafter, monkeypatch):
    """The pipeline limits the penalty to the batch's longest context (`limit`), never below a context: every
    penalized row's whole context is read, prompts of very different lengths and retractions included."""
    import json

    from helpers import compose, random_prompts
    from specpipe.run import run

    seen = []
    tree, nxt = SamplingState.penalize_tree, SamplingState.sample_next

    def check(state, rows=None):
        lens = state.context_len if rows is None else state.context_len[rows]
        seen.append((state.width, int(lens.max())))

    def spy_tree(self, *a, **k):
        check(self)
        return tree(self, *a, **k)

    def spy_next(self, logits, position, rows=None):
        check(self, rows)
        return nxt(self, logits, position, rows)

    monkeypatch.setattr(SamplingState, "penalize_tree", spy_tree)
    monkeypatch.setattr(SamplingState, "sample_next", spy_next)
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in random_prompts(5, [3, 90, 7, 40, 12, 60])))
    out = run(compose("model=random_tiny", "device.dtype=float64", f"workload.prompts_file={path}",
                      "workload.max_new_tokens=24", "workload.batch_size=4", "sampling.repetition_penalty=1.3",
                      "allocator.num_slots=170", "speculation=static", *drafter), quiet=True)  # (whole trees)
    assert out["metrics"]["num_errors"] == 0 and out["metrics"]["retractions"] > 0
    assert seen and all(w is not None and w >= n for w, n in seen)
    assert min(w for w, _ in seen) < max(w for w, _ in seen)  # the width follows the batch


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_logits_are_penalized_in_float32_as_hf_generate_does(dtype):
    """HF generate casts a step's logits to float32 before its processors. A bf16 token 5.0 penalized by 1.3 is
    3.846 in float32 but rounds to 3.859375 in bf16, a tie with the next token: the argmax would flip."""
    state = SamplingState(0.0, 1.0, 0, "cpu", max_context=4, penalized=True)
    state.join([1], [(0.0, 1.0, 0, 1.3)], [[0]])
    logits = torch.tensor([[5.0, 3.859375, -2.0, 0.5]], dtype=dtype)
    want = hf_penalty(logits[0].float(), [0], torch.tensor(1.3, dtype=torch.float32).item())
    got = state._penalized_at(logits.clone(), state.context, state.penalty)
    assert got.dtype == torch.float32 and torch.equal(got[0], want)
    assert state.sample_next(logits.clone(), torch.tensor([1])).tolist() == [1]  # 3.846 < 3.859375
    tree = state.penalize_tree(logits[:, None].clone(), torch.tensor([[2]]), torch.ones(1, 1, 1, dtype=torch.bool))
    assert tree.dtype == torch.float32 and tree[0, 0].argmax().item() == 1


def test_a_minus_inf_logit_stays_minus_inf_when_penalized():
    """HF's rule keeps -inf (-inf * penalty); the saturation for extreme penalties made it -3.4e38, a token with
    a finite logit that a row of otherwise -inf logits would then draw."""
    state = SamplingState(0.0, 1.0, 0, "cpu", max_context=4, penalized=True)
    state.join([1], [(0.0, 1.0, 0, 1.3)], [[0, 1]])
    logits = torch.tensor([[float("-inf"), 2.0, 1.0]])
    got = state._penalized_at(logits.clone(), state.context, state.penalty)
    assert torch.equal(got[0], hf_penalty(logits[0], [0, 1], torch.tensor(1.3).item()))
    assert got[0, 0] == float("-inf")


def test_filters_follow_the_requests_that_joined():
    """The pipeline learns on the host which filters some request uses, so process_logits skips the rest
    without reading the per-request tensors back."""
    state = SamplingState(0.8, 1.0, 0, "cpu", greedy=False)
    state.join([1])
    f = state.filters
    assert (f.k_max, f.top_p, f.min_p, f.greedy) == (0, False, False, False)
    state.join([2, 3], [(0.7, 0.9, 0), (1.0, 1.0, 40, 1.0, 0.1)])
    f = state.filters
    assert (f.k_max, f.top_p, f.min_p, f.greedy) == (40, True, True, False)
    assert f.p_without_k  # request 2's nucleus is searched in the whole vocabulary
    state.join([4], [(0.0, 0.5, 100)])  # a greedy request's filters are never applied
    f = state.filters
    assert (f.k_max, f.top_p, f.min_p, f.greedy) == (40, True, True, True)
    with_k = SamplingState(0.8, 1.0, 0, "cpu", greedy=False)
    with_k.join([1, 2], [(0.6, 0.95, 20), (0.0, 0.5, 0)])  # Qwen3's defaults; the greedy one does not count
    assert with_k.filters.top_p and not with_k.filters.p_without_k
