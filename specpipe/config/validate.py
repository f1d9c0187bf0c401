"""validate(cfg): every cross-field rule, checked before any model is built; all problems reported at once."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from specpipe.config.build import target_problems
from specpipe.config.compile_policy import PolicyError, device_problem, parse_policy
from specpipe.config.grammar import GrammarConf
from specpipe.errors import ConfigError
from specpipe.config.schema import (DRAFT_HEAD, DRAFT_MODEL, PROMPT_SET_HELP, PROMPT_SET_NAMES, SAMPLING_RULES,
                                    draft_schema, draft_schemas, speculation_schema)
from specpipe.config.schema import WEIGHT_LAYOUTS as LAYOUTS
from specpipe.config.stop_strings import check_stop, unescape

MAX_SEED = 2 ** 63 - 1  # torch's generator seeds are 64-bit
MAX_WEIGHT_SCALE = 10.0  # model.init_std / model.residual_scale (random_tiny): larger ones overflow fp16/fp32 logits
# model.seed (random_tiny's weights) goes to torch.Generator.manual_seed, which takes negatives
MIN_MODEL_SEED = -(2 ** 63)
# allocator.host_to_device_ratio: the host pool is the device pool (>= batch_size hot buffers) x it
MAX_HOST_RATIO = 1024
MAX_THREADS = 1024  # device.num_threads: more than any machine's cores; 100000 crashed torch's thread pool (SIGSEGV)
DEVICE_MODES = {  # device target -> its entry in compile_policy.DEVICE_SUPPORT (what it can run); imports no backend
    "specpipe.devices.cpu.CpuDevice": "cpu",
    "specpipe.devices.cuda.CudaDevice": "cuda",
    "specpipe.devices.npu.NpuDevice": "npu",
}
DTYPES = ("float32", "float64", "bfloat16", "float16")


def _targets(cfg: DictConfig, errors: list) -> None:
    """Every `_target_` names exactly the class its node's schema names (`config/build.py` says why)."""
    errors += target_problems(cfg, "")


def _draft(d, errors: list) -> None:
    """The drafter the config group chose, untouched (its label and class), then its schema's ranges."""
    schema = draft_schema(d)
    shipped = draft_schemas()
    options = ", ".join(shipped)
    if d.method != schema.method:  # e.g. draft.method=ngram on the eagle group: ngram's settings would be missing
        methods = list(dict.fromkeys(s.method for s in shipped.values()))
        if d.method not in methods:
            errors.append(f"draft.method={d.method!r} is unknown (valid: {', '.join(methods)}; choose a drafter "
                          f"with its config group instead: draft={{{options.replace(', ', ',')}}})")
        else:
            errors.append(f"draft.method={d.method!r} does not match the chosen drafter ({schema.method}): choose a "
                          f"drafter with its config group, draft={d.method} (valid: {options}), and leave draft.method "
                          f"alone")
        return
    if d._target_ != schema._target_:  # the group names the class: a config builds no other (_targets says so)
        return
    schema.check(d, errors)


def _compile(cfg, errors: list) -> None:
    """Parse every branch policy and check it against the device; one error per distinct problem."""
    target = cfg.device.get("_target_", "")
    device = DEVICE_MODES.get(target, target.rsplit(".", 1)[-1])
    problems: dict[str, list[str]] = {}  # problem -> the branch keys that have it
    for stage, branches in cfg.compile.items():
        for br, text in branches.items():
            if isinstance(text, bool):  # switches such as draft_topk.fused
                continue
            try:
                pol = parse_policy(text)
            except PolicyError as e:
                errors.append(f"compile.{stage}.{br}={text!r}: {e}")
                continue
            problem = device_problem(pol, device)
            if problem:
                problems.setdefault(problem, []).append(f"compile.{stage}.{br}")
    for problem, keys in problems.items():
        errors.append(f"{problem}; set by {', '.join(keys)}")
    forward = cfg.compile.get("verify", {}).get("target_forward", "eager")
    why = getattr(OmegaConf.get_type(cfg.allocator), "eager_target_forward", None)  # (its schema's data)
    if why and str(forward).strip() != "eager":
        errors.append(f"compile.verify.target_forward={forward!r} {why}")


def _unknown_keys(cfg: DictConfig, errors: list) -> None:
    """Keys the schemas do not have (`+draft.topkk=2`, `+foo=1`): Hydra keeps them, nothing would read them."""
    import dataclasses

    def check(node, where: str) -> None:
        schema = OmegaConf.get_type(node)
        if not dataclasses.is_dataclass(schema):
            return
        fields = {f.name: f for f in dataclasses.fields(schema)}
        for k in node.keys():
            if k not in fields:
                name = f"{where}.{k}" if where else str(k)
                valid = ", ".join(f for f in fields if not f.startswith("_") and f != "hydra")
                errors.append(f"{name} is not a setting{' of ' + where if where else ''}, so it would be ignored "
                              f"(valid: {valid})")
            elif isinstance(node.get(k), DictConfig):
                check(node.get(k), f"{where}.{k}" if where else str(k))

    check(cfg, "")


PATH_KEYS = ("model.path", "draft.path", "workload.prompts_file")


def expand_user_paths(cfg: DictConfig) -> None:
    """A path setting that starts with "~" means the home folder, as in a shell (which cannot expand it in
    `model.path=~/m`: the word does not start with "~"); a relative one means the folder the command was
    typed in, also when Hydra has moved the job into its output folder (hydra.job.chdir=true)."""
    import os

    from hydra.core.hydra_config import HydraConfig

    typed_in = HydraConfig.get().runtime.cwd if HydraConfig.initialized() else None
    for key in PATH_KEYS:
        value = OmegaConf.select(cfg, key, default=None)
        if not isinstance(value, str) or value in ("~", "", "-"):
            continue
        path = os.path.expanduser(value)
        if typed_in and not os.path.isabs(path) and os.path.realpath(os.getcwd()) != os.path.realpath(typed_in):
            path = os.path.join(typed_in, path)
        if path != value:
            OmegaConf.update(cfg, key, path, merge=False)


def validate(cfg: DictConfig) -> None:
    """Every rule a config must keep before anything is built; ConfigError with all the problems found (those of
    `_required` first, alone: the other checks read what they name)."""
    errors: list[str] = []
    expand_user_paths(cfg)
    _required(cfg, errors)
    if errors:
        raise ConfigError(errors)
    _targets(cfg, errors)
    _device(cfg, errors)
    _draft(cfg.draft, errors)
    speculation_schema(cfg.speculation).check(cfg.speculation, errors)
    if cfg.get("grammar") is not None:
        GrammarConf.check(cfg.grammar, errors)
    _compile(cfg, errors)
    _workload(cfg, errors)
    _allocator(cfg, errors)
    _values(cfg, errors)
    _host_ratio(cfg, errors)
    if errors:
        raise ConfigError(errors)


def _required(cfg: DictConfig, errors: list) -> None:
    """Keys no schema has, required ones not set, and paths that are empty or that no file system can hold."""
    _unknown_keys(cfg, errors)
    for key in sorted(OmegaConf.missing_keys(cfg)):
        if not key.startswith("hydra"):
            errors.append(f"{key} is required but not set (add {key}=VALUE to the command line)")
    for key in ("model.path", "draft.path"):
        if isinstance(OmegaConf.select(cfg, key, default=None), str) and not OmegaConf.select(cfg, key).strip():
            errors.append(f"{key} is empty; give a model folder (config.json + weights), e.g. {key}=/models/NAME"
                          + (", or leave it out (null) for no separate draft model" if key == "draft.path" else ""))
    for key in PATH_KEYS:  # a name the file system refuses (too long, ...) would raise from a later is_file()
        value = OmegaConf.select(cfg, key, default=None)
        try:
            if isinstance(value, str) and value != "-":
                os.stat(value)
        except (FileNotFoundError, NotADirectoryError):
            pass  # named later, with what to give instead
        except OSError as e:
            errors.append(f"{key}={value[:60]!r}{'...' if len(value) > 60 else ''} cannot be a path here "
                          f"({e.strerror})")


def _device(cfg: DictConfig, errors: list) -> None:
    if cfg.device.dtype not in DTYPES:
        errors.append(f"device.dtype={cfg.device.dtype!r} is unknown (valid: {', '.join(DTYPES)})")
    if cfg.model.get("dtype") is not None and cfg.model.dtype not in (*DTYPES, "auto"):
        errors.append(f"model.dtype={cfg.model.dtype!r} is unknown (valid: {', '.join(DTYPES)}, auto for the "
                      "checkpoint's own, or null for device.dtype)")
    layout = cfg.device.get("weight_layout", "auto")
    if layout not in LAYOUTS:
        errors.append(f"device.weight_layout={layout!r} is not valid: use one of {', '.join(LAYOUTS)} (auto times "
                      "row-major, column-major and oneDNN-packed storage per weight shape on CPU and keeps the "
                      "fastest; packed runs as row on other devices)")
    for key in ("graph_batch_sizes", "graph_context_buckets"):
        sizes = list(cfg.device.get(key) or [])
        if any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in sizes) or sizes != sorted(set(sizes)):
            errors.append(f"device.{key}={sizes} must list sizes >= 1 in ascending order, each once (or [] to "
                          f"capture every exact shape)")
    if cfg.device.get("num_threads") is not None and cfg.device.num_threads < 1:
        errors.append(f"device.num_threads={cfg.device.num_threads} must be >= 1 (or null for torch's default)")
    elif cfg.device.get("num_threads") is not None and cfg.device.num_threads > MAX_THREADS:
        errors.append(f"device.num_threads={cfg.device.num_threads} must be between 1 and {MAX_THREADS} (or null for "
                      f"torch's default; more threads than cores only wait on one another)")


def _workload(cfg: DictConfig, errors: list) -> None:
    w = cfg.workload
    if w.max_new_tokens < 1:
        errors.append(f"workload.max_new_tokens={w.max_new_tokens} must be >= 1")
    if w.batch_size < 1:
        errors.append(f"workload.batch_size={w.batch_size} must be >= 1")
    if w.get("stop") == "":
        errors.append("workload.stop='' is empty: give a stop string (workload.stop='\\n\\n') or a list of them, "
                      "or workload.stop=[] for none")
    elif w.get("stop") is not None and check_stop(run_stop_strings(cfg)):  # (0 and false too: not "no stop")
        errors.append(f"workload.{check_stop(run_stop_strings(cfg))}")
    if w.num_prompts is not None and w.num_prompts < 1:
        errors.append(f"workload.num_prompts={w.num_prompts} must be >= 1 or null (all prompts)")
    if w.prompts_file is None and w.prompt_set not in PROMPT_SET_NAMES:
        errors.append(f"workload.prompt_set={w.prompt_set!r} is unknown (valid: "
                      f"{'; '.join(f'{k}: {v}' for k, v in PROMPT_SET_HELP.items())})")
    if w.prompts_file == "-":  # standard input, read when the run starts
        pass
    elif w.prompts_file is not None and (not Path(w.prompts_file).exists() or Path(w.prompts_file).is_dir()):
        errors.append(f"workload.prompts_file={w.prompts_file!r} is not a readable file (give a JSON-lines "
                      f'file with one {{"prompt": "..."}} per line)')
    elif w.prompts_file is not None and Path(w.prompts_file).is_file() and Path(w.prompts_file).stat().st_size == 0:
        errors.append(f"workload.prompts_file={w.prompts_file!r} is empty (give one "
                      f'{{"prompt": "..."}} object per line)')


def _allocator(cfg: DictConfig, errors: list) -> None:
    """Pool sizes and page size, and the window of allocator=swa (its minimum, where the model is known here)."""
    a, w = cfg.allocator, cfg.workload
    ps = a.page_size
    ps_ok = ps >= 1 and not ps & (ps - 1)
    if not ps_ok:
        errors.append(f"allocator.page_size={ps} must be a power of two (1, 2, 4, 8, 16, ...)")
    elif ps != 1 and getattr(OmegaConf.get_type(a), "fixed_page_size", None):
        ps_ok = False
        errors.append(f"allocator.page_size={ps}: {OmegaConf.get_type(a).fixed_page_size}; use "
                      f"allocator=paged allocator.page_size={ps} for pages of {ps} slots")
    elif a.num_slots is not None and a.num_slots < 1:
        errors.append(f"allocator.num_slots={a.num_slots} must be positive (or null: sized for the workload)")
    elif a.num_slots is not None:
        need = one_request_slots(cfg)
        # hisparse: its logical pool, num_slots x ratio, holds the tokens
        ratio = max(int(a.get("host_to_device_ratio", 1)), 1)
        if a.num_slots * ratio < need:
            host = f" in the logical pool, num_slots x host_to_device_ratio={ratio}" if ratio > 1 else ""
            errors.append(f"allocator.num_slots={a.num_slots} is smaller than one request needs ({need} slots{host} "
                          f"for max_new_tokens={w.max_new_tokens} plus draft and verify space at page_size={ps}); "
                          f"use allocator.num_slots>={-(-need // ratio)}")
    swa_slots = a.get("swa_num_slots")
    if swa_slots is not None and swa_slots < 1:
        errors.append(f"allocator.swa_num_slots={swa_slots} must be positive (or null: sized for batch_size windows "
                      f"plus a prefill chunk)")
    if "window" in a and a.window is not None and a.window < 1:
        errors.append(f"allocator.window={a.window} must be >= 1 (tokens a sliding-window layer sees; null takes the "
                      f"model's own sliding_window)")
    elif "window" in a and a.window is not None and ps_ok:
        # a request never keeps more than the model's context in the window pool, so the pool's minimum is capped
        # by it: known here for random_tiny; for other models SWAAllocator.check_model checks the pool once loaded
        context = cfg.model.get("max_position")
        errors += window_problems(cfg, a.window, context=context, pool=context is not None)


def _values(cfg: DictConfig, errors: list) -> None:
    """Sampling settings, the latency limit and the seeds, and a draft.path that the model would ignore."""
    for key, hint in (("temperature", ""), ("top_p", " (1 keeps every token)"), ("top_k", " (0 keeps every token)"),
                      ("repetition_penalty", "; 1.05 to 1.3 is typical"), ("min_p", "; 0.05 to 0.1 is typical")):
        v = cfg.sampling[key]
        if v != v:
            errors.append(f"sampling.{key}=nan is not a number (valid: {SAMPLING_RULES[key][2]}{hint})")
        elif not SAMPLING_RULES[key][1](v):  # the schema has typed it already
            errors.append(f"sampling.{key}={v} must be {SAMPLING_RULES[key][2]}{hint}")
    if cfg.get("latency_limit_ms") is not None and not cfg.latency_limit_ms > 0:  # (nan too)
        errors.append(f"latency_limit_ms={cfg.latency_limit_ms} must be > 0 (or null for no limit)")
    if not 0 <= cfg.seed <= MAX_SEED:
        errors.append(f"seed={cfg.seed} must be between 0 and 2**63-1")
    model_seed = cfg.model.get("seed") if "seed" in cfg.model else None
    if model_seed is not None and not MIN_MODEL_SEED <= model_seed <= MAX_SEED:
        errors.append(f"model.seed={model_seed} must be between -2**63 and 2**63-1 (it seeds the random model's "
                      f"weights)")
    for key, zero_ok in (("init_std", False), ("residual_scale", True)):  # random_tiny's weight scales
        v = cfg.model.get(key) if key in cfg.model else None
        if v is not None and not ((v >= 0 if zero_ok else v > 0) and v <= MAX_WEIGHT_SCALE):  # (nan too)
            errors.append(f"model.{key}={v} must be {'>=' if zero_ok else '>'} 0 and <= {MAX_WEIGHT_SCALE:g} (a "
                          f"scale of the random model's weights: past it the logits overflow to inf)")
    if cfg.draft.get("path") is not None and draft_schema(cfg.draft).drafts_with == DRAFT_HEAD \
            and str(cfg.model.get("_target_", "")).endswith(".build_random_tiny"):
        own = " and ".join(f"draft={o}" for o, s in draft_schemas().items() if s.drafts_with == DRAFT_MODEL)
        errors.append(f"draft.path={cfg.draft.path!r} would be ignored: model=random_tiny builds its own EAGLE head "
                      f"(draft.path is read with model=tiny or model=hf, and by {own}); leave draft.path "
                      f"null (draft.path=null) or choose model=hf model.path=DIR")
    if cfg.sampling.seed is not None and not 0 <= cfg.sampling.seed <= MAX_SEED:
        errors.append(f"sampling.seed={cfg.sampling.seed} must be between 0 and 2**63-1 (or null: the top-level seed)")


def _host_ratio(cfg: DictConfig, errors: list) -> None:
    a = cfg.allocator
    if "host_to_device_ratio" in a and a.host_to_device_ratio < 1:
        errors.append(f"allocator.host_to_device_ratio={a.host_to_device_ratio} must be >= 1 (host slots per "
                      f"device slot; 1 keeps every token's KV on the device)")
    elif "host_to_device_ratio" in a and a.host_to_device_ratio > MAX_HOST_RATIO:
        errors.append(f"allocator.host_to_device_ratio={a.host_to_device_ratio} must be between 1 and "
                      f"{MAX_HOST_RATIO} (host slots per device slot; the host pool is the device pool times it, "
                      f"at least batch_size hot buffers)")


def run_stop_strings(cfg) -> list:
    """workload.stop as a list of strings, command-line escapes (\\n, \\t) decoded; bad entries pass through
    (for `check_stop` to name)."""
    stop = cfg.workload.get("stop")
    stop = [] if stop is None else stop
    stop = OmegaConf.to_container(stop) if OmegaConf.is_config(stop) else stop
    stop = [stop] if isinstance(stop, str) else stop
    return [unescape(s) if isinstance(s, str) else s for s in stop] if isinstance(stop, list) else stop


def window_problems(cfg, window: int, model_window: bool = False, context: Optional[int] = None,
                    pool: bool = True) -> list[str]:
    """What the window pool of allocator=swa cannot do with a `window` of tokens (allocator.window, or the model's
    sliding window that a null one takes, which the messages then name). `context`: the model's, where known (a
    request never holds more, whatever the window)."""
    a, d, ps = cfg.allocator, cfg.draft, cfg.allocator.page_size
    what = f"the model's sliding window of {window} tokens (which allocator.window=null takes)" if model_window \
        else f"allocator.window={window}"
    last = f"the last {window} tokens, the model's sliding window," if model_window else \
        f"the last allocator.window={window} tokens"
    errors = []
    if draft_schema(d).speculates and window < d.num_steps + 1:
        fewer = f", or draft.num_steps<={window - 1}" if model_window and window > 1 else \
            ", or draft=none" if model_window else ""
        errors.append(f"{what} is shorter than one speculative step needs (num_steps + 1 = {d.num_steps + 1} "
                      f"tokens); use allocator.window>={d.num_steps + 1} (a window pool larger than the model's "
                      f"window is fine){fewer}")
    swa_slots = a.get("swa_num_slots")
    if pool and swa_slots is not None and swa_slots >= 1:
        # the window pool holds a request's newest window tokens plus a step's draft space: what a decode step and
        # a prefill run in chunks (a page at a time at worst) need, whatever the prompt's length
        need = window_row_slots(cfg, window, context)
        if swa_slots < need:
            errors.append(f"allocator.swa_num_slots={swa_slots} is smaller than one request needs in the window "
                          f"pool ({need} slots: {last} plus draft and verify space at page_size={ps}; a prompt "
                          f"of any length is prefilled in chunks within it); use allocator.swa_num_slots>={need}")
    return errors


def window_row_slots(cfg, window: int, context: Optional[int] = None) -> int:
    """Window-pool slots one request holds: its newest `window` tokens (at most the model's `context`, where known),
    page-aligned, plus one step's draft and verify space."""
    ps = cfg.allocator.page_size
    return -(-min(window, context or window) // ps) * ps + one_request_slots(cfg, new_tokens=0)


def scratch_tokens_per_request(page_size: int, topk: int, width: int) -> int:
    """Worst-case draft slots one request borrows per round (W columns per branch, K branches): what
    `stages.draft_scratch` lays out, counted here so that sizing a pool needs no torch."""
    if width <= 0:
        return 0
    if page_size == 1:
        return topk * width
    return topk * (-(-(page_size - 1 + width) // page_size)) * page_size


def one_request_slots(cfg, new_tokens: Optional[int] = None) -> int:
    """KV slots one request needs beyond its prompt: its new tokens (max_new_tokens unless given), one verify
    tree and draft scratch."""
    d, ps = cfg.draft, cfg.allocator.page_size
    schema = draft_schema(d)
    width = schema.scratch_columns(d.num_steps)
    extra = d.num_draft_tokens + scratch_tokens_per_request(ps, d.topk, width) if schema.speculates else 2
    tokens = (cfg.workload.max_new_tokens if new_tokens is None else new_tokens) + extra
    return (-(-tokens // ps) + 2) * ps


def to_container(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg, resolve=True)
