"""What a `model=` option builds: the target, its draft head (if any) and the tokenizer."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from torch import nn

from specpipe.models.llama import LlamaForCausalLM


@dataclass
class ModelPair:
    target: LlamaForCausalLM
    draft: Optional[nn.Module]  # EagleHead (or None when the model ships no head)
    tokenizer: Any  # encode(str) -> list[int], decode(ids) -> str, eos_token_id, vocab_size
    name: str = ""
    standalone: Optional[nn.Module] = None  # a small causal LM for draft=standalone
