"""How good the head is, on data it never trained on.

- Top-1 agreement: at every held-out position, whether the head's first draft token is the target's greedy token
  (the teacher-forced rate EAGLE papers quote), and per draft step.
- Simulated acceptance: a greedy chain decode walked over the target's greedy continuations of held-out
  prompts, round by round: a round's drafts are accepted up to the first that differs from the target's
  greedy token, then the next round drafts from there. The multi-step forward (ttt.py) drafts every chain
  exactly as specpipe would, so the acceptance length per chain depth (the bonus token counted) and the
  per-position rates (metrics.json's definitions) are those of a greedy chain decode of these continuations.
- Decoded: held-out prompts (the built-in chat set for a chat model, else the heldout code set) run through
  specpipe.run.run with the saved folder loaded by the same loader `draft.path` uses, as a chain and as the
  default tree, every round verifying its whole draft (`speculation=static`: under the default `cost` a head
  that does not pay is paused, and the acceptance measured would be the policy's, near 1); their
  `accept_length_mean` and per-position rates are metrics.json's.
"""
from __future__ import annotations

from pathlib import Path

import torch

from specpipe.train.ttt import draft_logits, picked, step_targets, ttt_forward


@torch.no_grad()
def chain_hits(head, shard, steps: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(hit [steps, B, L]: draft step j at p is the target's greedy token, labelled [steps, B, L])."""
    outs = ttt_forward(head, shard.ids.to(device), shard.feats.to(device).float(), steps)
    hits, labs = [], []
    for j, out in enumerate(outs):
        mask, _, top, _ = step_targets(shard, j, device, False)
        hit = torch.zeros_like(mask)
        if mask.any():
            hit[mask] = picked(head, draft_logits(head, out[mask])) == top[mask][:, 0].long()
        hits.append(hit)
        labs.append(mask)
    return torch.stack(hits), torch.stack(labs)


def walk(hit, lab, k: int) -> list[int]:
    """Accepted drafts per round of a greedy chain decode of k drafts over one continuation (hit, lab: [S, L] of
    its row): the first round drafts from the prompt's last position, each round accepts its drafts up to the
    first miss and commits them and the target's bonus token, and the next round drafts from there."""
    has = lab[0].nonzero()
    if not has.numel():
        return []
    p, end, rounds = int(has[0]) + 1, int(has[-1]), []
    while p <= end:
        a = 0
        while a < k and bool(lab[a, p]) and bool(hit[a, p]):
            a += 1
        rounds.append(a)
        p += a + 1
    return rounds


def heldout_metrics(head, corpus: list, greedy: list, steps: int, device) -> dict:
    """Top-1 agreement (all held-out shards) and a simulated greedy chain decode (greedy continuations)."""
    agree, count = torch.zeros(steps), torch.zeros(steps)
    rounds: dict = {k: [] for k in range(1, steps + 1)}
    for kind, shards in (("corpus", corpus), ("greedy", greedy)):
        for s in shards:
            hit, lab = chain_hits(head, s, steps, device)
            agree += (hit & lab).flatten(1).sum(1).float().cpu()
            count += lab.flatten(1).sum(1).float().cpu()
            for b in range(hit.shape[1] if kind == "greedy" else 0):
                for k in rounds:
                    rounds[k] += walk(hit[:, b].cpu(), lab[:, b].cpu(), k)
    top1 = (agree / count.clamp_min(1)).tolist()
    out = {"top1_agreement": round(top1[0], 4), "top1_agreement_per_step": [round(x, 4) for x in top1],
           "labelled_positions": int(count[0])}
    deepest = rounds[steps]
    if deepest:  # metrics.json's definitions, over the rounds of the deepest chain
        reached = [len(deepest)] + [sum(a > d for a in deepest) for d in range(steps)]  # [d+1]: draft d+1 accepted
        out["simulated"] = {
            "rounds": len(deepest),
            "acceptance_rate_per_position": [round(reached[d + 1] / len(deepest), 4) for d in range(steps)],
            "acceptance_rate_by_depth": [round(reached[d + 1] / reached[d], 4) if reached[d] else None
                                         for d in range(steps)],
            "chain_acceptance_length": {str(k): round(1 + sum(r) / len(r), 3) for k, r in rounds.items() if r}}
    return out


def decode_metrics(cfg, pair, folder: Path, dtype: str, device) -> dict:
    """Held-out prompts decoded by specpipe with the saved head (loaded through `draft.path`'s loader), as a greedy
    chain of eval.steps drafts and as draft=eagle's default tree."""
    from specpipe.models.hf.load import load_draft
    from specpipe.models.pair import ModelPair
    from specpipe.run import run
    from specpipe.train.data import decode_config
    from specpipe.workload.prompts import load_prompts

    e = cfg.eval
    chat = getattr(pair.tokenizer, "chat_template", None) is not None
    prompt_set = e.prompt_set if e.prompt_set != "auto" else ("chat" if chat else "heldout")
    items = load_prompts(None, prompt_set, e.decode_prompts)
    head = load_draft(folder, pair.target, dtype, device)
    with_head = ModelPair(pair.target, head, pair.tokenizer, name=pair.name)
    out = {"prompt_set": prompt_set, "prompts": len(items), "max_new_tokens": e.max_new_tokens}
    shapes = {"chain": ["draft.topk=1", f"draft.num_steps={e.steps}", f"draft.num_draft_tokens={e.steps + 1}"],
              "tree": []}
    for name, shape in shapes.items():
        main = decode_config(cfg, ["draft=eagle", "speculation=static", f"workload.max_new_tokens={e.max_new_tokens}",
                                   "workload.batch_size=1", *shape], {"draft.path": str(folder)})
        m = run(main, quiet=True, pair=with_head, items=items)["metrics"]
        out[name] = {"topk": main.draft.topk, "num_steps": main.draft.num_steps,
                     "num_draft_tokens": main.draft.num_draft_tokens,
                     "accept_length_mean": round(m["accept_length_mean"] or 0.0, 3),
                     "acceptance_rate_per_position": [None if r is None else round(r, 4)
                                                      for r in m["acceptance_rate_per_position"]],
                     "tokens_per_s": round(m["tokens_per_s"], 1)}
    pair.target.kv = None
    return out
