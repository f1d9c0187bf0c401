"""Shared test helpers (importable as `helpers`: pytest puts tests/ on sys.path)."""
from __future__ import annotations

import json
import math

import torch


def compose(*overrides: str):
    from specpipe.config.compose import compose_config

    return compose_config(list(overrides))


def letter_model_run(pair, path, t_new: int, temperature: float, top_p: float, *overrides: str) -> dict:
    """`run` of the prompts file `path` on the 6-letter float64 random_tiny model `pair` (the sampling law tests),
    t_new tokens per request, 512 at once."""
    from specpipe.run import run

    cfg = compose("model=random_tiny", "model.vocab_size=6", "model.init_std=1.0", "model.seed=0",
                  "device.dtype=float64", f"workload.prompts_file={path}",
                  f"workload.max_new_tokens={t_new}", "workload.batch_size=512", "allocator.num_slots=20000",
                  f"sampling.temperature={temperature}", f"sampling.top_p={top_p}", *overrides)
    return run(cfg, quiet=True, pair=pair)


def random_prompts(seed: int, lengths) -> list[str]:
    """Code-like random prompts of the given lengths (characters), reproducible from the seed."""
    import random

    rng = random.Random(seed)
    alphabet = "abcdefghij klmnop=():\n_"
    return ["".join(rng.choice(alphabet) for _ in range(n)) for n in lengths]


def write_prompts(path, prompts) -> str:
    path.write_text("".join(json.dumps({"prompt": x}) + "\n" for x in prompts))
    return str(path)


def chi2_sf(x: float, k: int) -> float:
    """Upper tail of the chi-square law with k degrees of freedom: regularized Q(k/2, x/2)."""
    a, x = k / 2.0, x / 2.0
    if x <= 0:
        return 1.0
    front = math.exp(-x + a * math.log(x) - math.lgamma(a))
    if x < a + 1:  # series for the lower tail P(a, x)
        term = total = 1.0 / a
        n = 1
        while term > total * 1e-15:
            term *= x / (a + n)
            total += term
            n += 1
        return max(0.0, 1.0 - front * total)
    tiny = 1e-300  # Lentz continued fraction for Q(a, x)
    b = x + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 10000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return front * h


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Observed counts vs cell probabilities; zero-probability cells must stay empty; cells with
    expected count < 5 are pooled into one bin."""
    n = counts.sum().item()
    assert counts[probs == 0].sum() == 0, "a token the target can never produce was committed"
    exp = probs.double() * n
    big = exp >= 5
    obs = torch.cat([counts[big].double(), counts[~big & (probs > 0)].sum().double()[None]])
    ex = torch.cat([exp[big], exp[~big & (probs > 0)].sum()[None]])
    keep = ex > 0
    stat = (((obs - ex) ** 2)[keep] / ex[keep]).sum().item()
    return chi2_sf(stat, int(keep.sum()) - 1)


def ancestors(parent: torch.Tensor) -> torch.Tensor:
    """[B, N, N] node j sees itself and its ancestors (a plain walk up the parents)."""
    B, N = parent.shape
    mask = torch.zeros(B, N, N, dtype=torch.bool)
    for b in range(B):
        for j in range(N):
            v = j
            while v >= 0:
                mask[b, j, v] = True
                v = int(parent[b, v])
    return mask


def default_sigint() -> None:
    """preexec_fn for a child that the test interrupts: a runner that started the tests in the background (a
    non-interactive shell's `&`) leaves SIGINT ignored, and Python then never raises KeyboardInterrupt."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def random_eagle3_pair(pair_seed: int = 4, head_seed: int = 0, num_layers: int = 4, **head_kwargs):
    """A float64 random_tiny target of `num_layers` with an EAGLE-3 head (aux layers 0, 1, 3; 200 draft ids that
    are target ids) of random weights, norms left at one."""
    from specpipe.models.eagle3 import Eagle3Head
    from specpipe.models.random_tiny import build_random_tiny

    pair = build_random_tiny(seed=pair_seed, dtype="float64", num_layers=num_layers)
    kwargs = {"draft_vocab_size": 200, "aux_layers": [0, 1, 3], **head_kwargs}
    pair.draft = randomize_eagle3(Eagle3Head(pair.target.config, pair.target, **kwargs), head_seed)
    return pair


def randomize_eagle3(head, seed: int):
    """Random weights (norms left at one); draft ids are target ids (d2t zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3 / max(1, p.shape[-1]) ** 0.5)
        head.d2t.zero_()
    return head.to(torch.float64)
