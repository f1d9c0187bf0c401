"""Optuna search-space hooks (conf/sweep/optuna_tree.yaml: hydra.sweeper.custom_search_space)."""
from __future__ import annotations

from omegaconf import DictConfig

MAX_TREE_TOKENS = 16  # num_draft_tokens ceiling for searches: verify cost grows with it on every device


def tree_search_space(cfg: DictConfig, trial) -> None:
    """Optuna hook (hydra.sweeper.custom_search_space): num_draft_tokens within the sampled shape.

    A tree of topk branches and num_steps levels holds at most 1 + topk + (num_steps-1)*topk^2 nodes
    (num_steps + 1 for a chain): more would only fail. Fewer than num_steps + 1 cannot hold one
    full-depth path, so the last draft steps would be computed and never verified.
    """
    k, s = int(trial.params["draft.topk"]), int(trial.params["draft.num_steps"])
    most = min(s + 1 if k == 1 else 1 + k + (s - 1) * k * k, MAX_TREE_TOKENS)
    trial.suggest_int("draft.num_draft_tokens", min(s + 1, most), most)
