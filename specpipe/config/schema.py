"""Typed config schemas: the source of truth for every config group.

Each YAML under conf/<group>/ lists `base_<name>` in its defaults and holds values only; the
class it builds (`_target_`) lives here, never in user YAML. Composing a config imports no
device backend: targets are qualnames resolved only when `build()` runs.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from specpipe.config.drafts import (DRAFT_HEAD, DRAFT_MODEL, DraftConf, EagleDraftConf, NgramDraftConf,  # noqa: F401
                                    NoDraftConf, StandaloneDraftConf, SuffixDraftConf, draft_schema, draft_schemas)
from specpipe.config.grammar import GRAMMAR_SCHEMAS
from specpipe.config.speculation import SPECULATION_SCHEMAS, speculation_schema  # noqa: F401


# ---- device -----------------------------------------------------------------------------
@dataclass
class DeviceConf:
    _target_: str = "specpipe.devices.cpu.CpuDevice"
    dtype: str = "float32"  # float32 | float64 | bfloat16 | float16
    index: int = 0  # accelerator index (cuda:N / npu:N)
    num_threads: Optional[int] = None  # torch CPU threads (None: torch's default, one per core)
    # Linear weight storage: auto (CPU: time row- vs column-major and oneDNN-packed per shape, keep the fastest;
    # elsewhere row) | row (HF's layout) | column | packed (CPU: oneDNN's blocked copy) (devices/weight_layout.py)
    weight_layout: str = "auto"


WEIGHT_LAYOUTS = ("auto", "row", "column", "packed")  # DeviceConf.weight_layout values (packed: CPU only, else row)


@dataclass
class CpuDeviceConf(DeviceConf):
    _target_: str = "specpipe.devices.cpu.CpuDevice"


# `graph` branches capture these batch sizes (rows of a branch's inputs: requests, or requests x topk for the draft
# decode) at warm-up and pad a batch up to the next one, as sglang's cuda_graph_bs; a larger batch is captured at its
# own size with a note (devices/graphs.py)
GRAPH_BATCH_SIZES = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64]
# ... and pad an attention batch's key columns up to the next of these (a longer context: its own size, with a note)
GRAPH_CONTEXT_BUCKETS = [256, 512, 1024, 2048, 4096, 8192, 16384, 32768]


@dataclass
class GraphDeviceConf(DeviceConf):
    """A device with graph capture (compile policy `graph`): the sizes it captures ([]: every exact shape)."""
    graph_batch_sizes: list[int] = field(default_factory=lambda: list(GRAPH_BATCH_SIZES))
    graph_context_buckets: list[int] = field(default_factory=lambda: list(GRAPH_CONTEXT_BUCKETS))


@dataclass
class CudaDeviceConf(GraphDeviceConf):
    _target_: str = "specpipe.devices.cuda.CudaDevice"


@dataclass
class NpuDeviceConf(GraphDeviceConf):
    _target_: str = "specpipe.devices.npu.NpuDevice"


# ---- allocator --------------------------------------------------------------------------
@dataclass
class AllocatorConf:
    _target_: str = MISSING
    num_slots: Optional[int] = None  # usable KV slots shared by all running requests (None: sized for the workload)
    page_size: int = 1
    debug: bool = False  # verify caller-passed page counts (slower)

    # what the checks must know of an allocator before any torch import (read through OmegaConf.get_type)
    fixed_page_size: ClassVar[Optional[str]] = None  # why page_size must be 1 (None: any power of two)
    eager_target_forward: ClassVar[Optional[str]] = None  # why compile.verify.target_forward must stay eager


@dataclass
class TokenAllocatorConf(AllocatorConf):
    _target_: str = "specpipe.allocators.token.TokenAllocator"
    fixed_page_size: ClassVar[Optional[str]] = "the token allocator has page size 1 (every slot on its own)"


@dataclass
class PagedAllocatorConf(AllocatorConf):
    _target_: str = "specpipe.allocators.paged.PagedAllocator"
    page_size: int = 16


@dataclass
class SWAAllocatorConf(AllocatorConf):
    _target_: str = "specpipe.allocators.swa.SWAAllocator"
    window: Optional[int] = None  # tokens the window pool keeps per request; null: the model's sliding window
    # window-pool size (None: batch_size rows of a window, a step and a 2048-token prefill chunk, at most num_slots)
    swa_num_slots: Optional[int] = None


@dataclass
class HiSparseAllocatorConf(AllocatorConf):
    _target_: str = "specpipe.allocators.hisparse.HiSparseAllocator"
    host_to_device_ratio: int = 2  # logical (host) id space per device slot
    eager_target_forward: ClassVar[Optional[str]] = (
        "cannot run with allocator=hisparse: its hot buffers are kept on the host from inside the target's forward "
        "(each sparse layer's selection goes through an LRU), which a compiled or captured graph cannot hold; keep "
        "compile.verify.target_forward=eager (the other branches may compile), or use allocator=paged")


# ---- model ------------------------------------------------------------------------------
@dataclass
class ModelConf:
    _target_: str = MISSING
    dtype: Optional[str] = None  # None: the device's dtype; auto: the checkpoint's (config.json's dtype/torch_dtype)


@dataclass
class RandomTinyModelConf(ModelConf):
    _target_: str = "specpipe.models.random_tiny.build_random_tiny"
    vocab_size: int = 258
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    max_position: int = 2048
    tie_word_embeddings: bool = False
    init_std: float = 0.5
    seed: int = 0
    residual_scale: float = 0.1  # small: the target stays close to its embedding, so the draft can agree
    aligned_draft: bool = True  # the head's fc passes the token embedding through (non-trivial acceptance)
    sliding_window: Optional[int] = None  # sliding-window attention (allocator=swa needs it)
    sliding_layers: str = "all"  # all (Mistral) | alternate (even layers slide, odd are full)
    sparse_top_k: Optional[int] = None  # top-k sparse attention in the target (allocator=hisparse)
    sparse_local: int = 16  # sparse attention always keeps the newest sparse_local positions


@dataclass
class HFModelConf(ModelConf):
    _target_: str = "specpipe.models.hf.load.load_hf"
    path: str = MISSING  # folder with config.json + *.safetensors


@dataclass
class TinyModelConf(ModelConf):
    _target_: str = "specpipe.models.hf.load.load_tiny"


# ---- draft ------------------------------------------------------------------------------
# specpipe/config/drafts.py: one dataclass per conf/draft/<option>.yaml, with the drafter's ranges and what the run
# needs to know of it (imported above, so `specpipe.config.schema` still names every schema)


# ---- compile policy ---------------------------------------------------------------------
@dataclass
class DraftTopKPolicy:
    first: str = "eager"  # step 0: flatten top-k, expand hidden states
    later: str = "eager"  # steps >= 1: expand scores, top-k over K*K, gather
    fused: bool = False  # one function with the step branch inside (pre-split baseline), policy = `later`


@dataclass
class BuildTreePolicy:
    build: str = "eager"


@dataclass
class VerifyPolicy:
    target_forward: str = "eager"
    greedy: str = "eager"
    # a greedy round's verify as one function (tree attention batch, target forward, acceptance, commit bookkeeping);
    # not with sampling, a repetition penalty, logprobs, SWA or hisparse (those rounds run the two above, with a note)
    round: str = "eager"


@dataclass
class DraftForwardPolicy:
    decode: str = "eager"  # one draft step over B*K branch tokens
    extend: str = "eager"  # draft over the committed tokens (prefill and after verify)


@dataclass
class PrefillPolicy:
    # the target's forward over fresh prompts, padded form (a packed or chunked prefill stays eager)
    target_forward: str = "eager"


@dataclass
class DraftLoopPolicy:
    # EAGLE: a round's tree steps (draft forwards and top-k) as one function; eager runs them one call each, under
    # draft_forward.decode and draft_topk.*. Any page size, without SWA or hisparse (else step by step, with a note)
    steps: str = "eager"


@dataclass
class StandaloneDraftPolicy:  # draft=standalone's model forwards (its tree steps use draft_topk and build_tree)
    root_logits: str = "eager"  # the root token of each round: B rows of one token
    decode_logits: str = "eager"  # one tree step over B*K branch tokens
    extend: str = "eager"  # draft KV for the prompts and each round's committed tokens


@dataclass
class CompileConf:
    draft_topk: DraftTopKPolicy = field(default_factory=DraftTopKPolicy)
    build_tree: BuildTreePolicy = field(default_factory=BuildTreePolicy)
    verify: VerifyPolicy = field(default_factory=VerifyPolicy)
    draft_forward: DraftForwardPolicy = field(default_factory=DraftForwardPolicy)
    draft_loop: DraftLoopPolicy = field(default_factory=DraftLoopPolicy)
    prefill: PrefillPolicy = field(default_factory=PrefillPolicy)
    standalone_draft: StandaloneDraftPolicy = field(default_factory=StandaloneDraftPolicy)


# ---- workload ---------------------------------------------------------------------------
# workload.prompt_set: the built-in sets (specpipe/workload/prompts.py) and what each is for, which an unknown name's
# error lists: chats need a model with a chat template (the shipped byte-level pair has none)
PROMPT_SET_HELP = {
    "heldout": "code contexts the shipped byte-level pair never saw",
    "chat": "everyday assistant requests, as chats for a model with a chat template",
    "code": "programming requests (most carry code), as chats for a model with a chat template",
    "code_prefixes": "short Python prefixes to continue, for any model",
}
PROMPT_SET_NAMES = tuple(PROMPT_SET_HELP)


@dataclass
class WorkloadConf:
    prompts_file: Optional[str] = None  # JSON lines: "prompt", "prompt_ids" or chat "messages"; None: built-in
    prompt_set: str = "heldout"  # built-in set when no file is given (heldout: code the shipped pair never saw)
    num_prompts: Optional[int] = None  # cap on the number of prompts (None: all)
    max_new_tokens: int = 64
    batch_size: int = 4  # requests decoded together
    # stop strings for every request: one string or a list ("\n" is a newline here); a prompt's own "stop" adds
    stop: Any = field(default_factory=list)
    ignore_eos: bool = False  # benchmarks: every request runs to max_new_tokens (EOS ids and stop strings ignored)
    logprobs: bool = False  # completions also hold each output token's log-probability under the raw target logits


# ---- sampling ---------------------------------------------------------------------------
@dataclass
class SamplingConf:
    temperature: float = 0.0  # 0: greedy (exactly the target's argmax decode)
    top_p: float = 1.0  # nucleus mass kept (1: off)
    top_k: int = 0  # most likely tokens kept (0: off)
    repetition_penalty: float = 1.0  # HF's: logits of tokens already in the prompt or output / by it (1: off)
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely (0: off)
    seed: Optional[int] = None  # run-level sampling seed (None: the top-level seed); a prompt's "seed" wins
    # take temperature / top_p / top_k / min_p / repetition_penalty from the model folder's generation_config.json
    # where it sets them (as vLLM does by default); do_sample=false there means greedy
    from_model: bool = False


GREEDY_TEMPERATURE = 1e-5  # temperatures below are greedy (vLLM's rule): logits / a subnormal overflow to inf

# what a temperature / top_p / top_k / repetition_penalty / min_p may be: (integer only, valid, its words); one rule
# for sampling.*, a prompt's own values and a model's generation_config.json
SAMPLING_RULES = {
    "temperature": (False, lambda v: 0 <= v < float("inf"), ">= 0 and finite (0, or below 1e-5, is greedy)"),
    "top_p": (False, lambda v: 0 < v <= 1, "in (0, 1]"),
    "top_k": (True, lambda v: 0 <= v < 2 ** 31, ">= 0 and below 2**31"),
    "repetition_penalty": (False, lambda v: 0 < v < float("inf"), "> 0 and finite (1 is off)"),
    "min_p": (False, lambda v: 0 <= v <= 1, "in [0, 1] (0 is off)"),
}


def is_int(v) -> bool:
    """A JSON / Python integer, numpy's and torch's scalar integers included (not a bool)."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def is_number(v) -> bool:
    """An int or float, not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def sampling_problem(key: str, v) -> Optional[str]:
    """Why `v` is not a usable `key` ("must be a number >= 0 (0 is greedy)", ...), or None."""
    integer, ok, words = SAMPLING_RULES[key]
    typed = is_int(v) or (not integer and isinstance(v, numbers.Real) and not isinstance(v, bool))
    if typed and ok(v):
        return None
    return f"must be {'an integer' if integer else 'a number'} {words}"


# ---- root -------------------------------------------------------------------------------
@dataclass
class Config:
    device: Any = MISSING
    allocator: Any = MISSING
    model: Any = MISSING
    draft: Any = MISSING
    compile: Any = MISSING
    workload: Any = MISSING
    speculation: Any = MISSING  # how much of each draft tree a step verifies (config/speculation.py)
    grammar: Any = MISSING  # the engine of constrained requests' token masks (config/grammar.py)
    sampling: SamplingConf = field(default_factory=SamplingConf)
    seed: int = 0
    # skip a job whose output dir holds metrics.json from the same config; a stopped one decodes only the requests it
    # had not finished
    resume: bool = False
    latency_limit_ms: Optional[float] = None  # sweep objective: runs whose p90 step latency exceeds it score < 0
    # time model forwards with the device synchronized around each (stage_model_ms / stage_host_ms); false skips
    # those syncs, so on an accelerator the host queues the next stage's work while the device runs (the split is
    # then null in metrics.json); free on CPU, where ops finish before they return
    model_timing: bool = True


SCHEMAS: dict[str, dict[str, type]] = {
    "device": {"cpu": CpuDeviceConf, "cuda": CudaDeviceConf, "npu": NpuDeviceConf},
    "allocator": {"token": TokenAllocatorConf, "paged": PagedAllocatorConf, "swa": SWAAllocatorConf,
                  "hisparse": HiSparseAllocatorConf},
    "model": {"random_tiny": RandomTinyModelConf, "hf": HFModelConf, "tiny": TinyModelConf},
    "compile": {"policy": CompileConf},
    "workload": {"workload": WorkloadConf},
    "speculation": SPECULATION_SCHEMAS,
    "grammar": GRAMMAR_SCHEMAS,
}


def default_draft_tokens(topk: int, num_steps: int, budget: int = 8) -> int:
    """Tree size when the user sets none: the largest tree the shape allows, capped at `budget` nodes."""
    most = num_steps + 1 if topk <= 1 else 1 + topk + (num_steps - 1) * topk * topk
    return max(2, min(budget, most))


def default_trie_tokens(topk: int, num_steps: int, budget: int = 12) -> int:
    """N-gram trie size when the user sets none: topk chains of num_steps tokens share at most the root."""
    return max(2, min(budget, 1 + topk * num_steps))


def register_schemas() -> None:
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("specpipe.draft_tokens"):
        OmegaConf.register_new_resolver("specpipe.draft_tokens", lambda k, s: default_draft_tokens(int(k), int(s)))
    if not OmegaConf.has_resolver("specpipe.trie_tokens"):
        OmegaConf.register_new_resolver("specpipe.trie_tokens",
                                        lambda k, s, b=12: default_trie_tokens(int(k), int(s), int(b)))
    cs = ConfigStore.instance()
    if "base_config.yaml" in cs.repo:  # stored once per process: a store turns each dataclass into a config, and
        return  # that was ~40 ms of every ~170 ms compose (Hydra keeps what was stored; nothing here changes later)
    cs.store(name="base_config", node=Config)
    for group, schemas in {**SCHEMAS, "draft": draft_schemas()}.items():  # conf/<group>/<option>.yaml: base_<option>
        for name, node in schemas.items():
            cs.store(group=group, name=f"base_{name}", node=node)
