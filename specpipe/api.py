"""Python API: the pipeline `python -m specpipe` runs, built from the same overrides, called with prompts.

    from specpipe import SpecPipe
    sp = SpecPipe("model=hf", "model.path=/models/Qwen3-8B", "draft.path=/models/Qwen3-8B_eagle3")
    out = sp.generate(["def fib(n):", {"messages": [{"role": "user", "content": "Hi"}]}], max_new_tokens=64)
    out[0].text, sp.metrics["accept_length_mean"]
    for ev in sp.stream(["def fib(n):"]):   # StreamEvents as tokens are committed
        print(ev.text, end="", flush=True)

Weights load once, in the constructor; every `generate` call reuses them (and compiled artefacts). A
prompt is a string, a list of token ids, or a dict as one line of a prompts file ("prompt", "prompt_ids"
or chat "messages", optionally "seed", "max_new_tokens", "stop"). A bad prompt fails only its own
completion (`finish_reason` "error", `error` says why); a bad override raises `SpecpipeError` with the
CLI's one-paragraph message.
"""
from __future__ import annotations

import atexit
import numbers
import queue
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from specpipe.errors import SpecpipeError
from specpipe.workload.prompt_values import huge_int, nesting_problem
from specpipe.workload.tokenizer import complete_end, decode_after, output_text, own_start, prompt_context


@dataclass
class StreamEvent:
    """New output of one request: token ids committed since its last event, their text, and the finish
    reason on its last event (None before)."""
    index: int
    token_ids: list
    text: str
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    logprobs: Optional[list] = None  # logprobs=True: the raw target log-probabilities of token_ids


class _Deltas:
    """Turns requests' growing outputs into StreamEvents with text decoded incrementally: each event decodes
    only a window from the last emitted character boundary (vLLM/TGI's prefix/read offsets), so streaming a
    long output costs O(new tokens) per event, not O(output). Text is held back while the window ends in a
    partial UTF-8 character or byte-fallback token (decoded as U+FFFD), so every event's text is final; the
    last event reconciles with a full decode so the deltas add up to the completion's text (except where a
    byte-fallback decoder turns already sent bytes into U+FFFD because later bytes make them invalid UTF-8:
    text already sent is never sent again)."""

    def __init__(self, decode, sink):
        self.decode, self.sink = decode, sink
        # index -> [output ids sent, prefix offset, read offset, characters sent, prompt context]; the offsets
        # index context + output, so the first tokens decode as they read after the prompt (`decode_after`)
        self.state: dict[int, list] = {}
        self.closed: set[int] = set()

    def __call__(self, reqs) -> None:
        for r in reqs:
            if r.index in self.closed:
                continue
            st = self.state.get(r.index)
            if st is None:
                context = prompt_context(self.decode, getattr(r, "prompt_ids", None) or [])
                st = self.state[r.index] = [0, 0, complete_end(self.decode, context), 0, context]
            ids, n = r.output_ids, st[0]
            if len(ids) == n and not r.finished:
                continue
            if r.finished:
                self.closed.add(r.index)
                self.state.pop(r.index)
                # a byte-fallback decoder can rewrite bytes already sent (later bytes made them invalid
                # UTF-8): then only what extends past the sent length goes out, never the text again
                delta = decode_after(self.decode, st[4], ids)[st[3]:]
            else:
                delta = self._advance(st, ids)
            st[0] = len(ids)
            own = getattr(r, "logprobs", None)
            lps = None if own is None else list(own[n:len(ids)])
            self.sink(StreamEvent(r.index, list(ids[n:]), delta, r.finish_reason, r.error, lps))

    def _advance(self, st: list, ids) -> str:
        prefix, read, context = st[1], st[2], st[4]
        c = len(context)

        def part(a: int, b: int) -> list:  # (context + ids)[a:b], without copying the whole output
            return context[a:b] + list(ids[max(a - c, 0):max(b - c, 0)])

        end = c + len(ids)
        before = self.decode(part(prefix, read)) if read > prefix else ""
        after = self.decode(part(prefix, end))
        # the first text: a character the prompt leaves unfinished stays the prompt's unless completed
        start = own_start(before, self.decode(part(prefix, c)), after) if read <= c else len(before)
        if len(after) <= start or after.endswith("\ufffd"):
            return ""
        st[1], st[2] = read, end
        delta = after[start:]
        st[3] += len(delta)
        return delta


class _Cancelled(Exception):
    pass


_REENTRY = ("specpipe: generate() was called while this thread is already decoding (from an on_event callback); "
            "collect what the callback needs and call generate() after the running call returns")


def _is_bool(v) -> bool:
    """True/False, numpy's bool scalars included (not 0/1)."""
    return isinstance(v, bool) or (type(v).__module__ == "numpy" and type(v).__name__ in ("bool_", "bool"))


class _Decoding:
    """One decode at a time per process: the loaded weights and their KV pools are shared (`load_pair`
    caches them), so concurrent calls from several threads (or SpecPipe objects) take turns."""

    def __init__(self):
        self.lock = threading.RLock()  # re-entry is refused below; an RLock knows its owner, so a Ctrl-C that
        self.owner: Optional[int] = None  # lands right after acquire() can hand it back (a Lock would stay held)

    def __enter__(self):
        if self.owner == threading.get_ident():
            raise SpecpipeError(_REENTRY)
        try:
            self.lock.acquire()
            self.owner = threading.get_ident()
        except BaseException:  # `with` never calls __exit__ when __enter__ raises
            self.owner = None if self.owner == threading.get_ident() else self.owner
            try:
                self.lock.release()
            except RuntimeError:  # the interrupt came while waiting: this thread does not hold it
                pass
            raise

    def __exit__(self, *exc):
        self.owner = None
        self.lock.release()


_DECODING = _Decoding()
_LIVE_STREAMS: "weakref.WeakSet" = weakref.WeakSet()
_WORKERS: set = set()  # (thread, cancel event) of every stream worker still running, closed streams' included


@atexit.register
def _close_streams() -> None:
    """Stop every stream worker before the interpreter tears torch down under it: a stream left open, and one
    closed without waiting (a `for` loop left by `break` drops it) whose worker is still inside a step (the
    process then aborted: "terminate called without an active exception")."""
    for st in list(_LIVE_STREAMS):
        st.close(wait=False)
    for worker, cancel in list(_WORKERS):
        cancel.set()
    for worker, cancel in list(_WORKERS):
        if worker is not threading.current_thread() and _DECODING.owner != threading.get_ident():
            worker.join()


class Stream:
    """StreamEvents of a `SpecPipe.stream` call, decoded by a worker thread. Iterate it; `close()` (or a
    `with` block, or dropping it) stops decoding at the next step."""

    def __init__(self, generate: Callable[[Callable, Callable[[], bool]], Any]):
        # the worker sees these, never `self`: a running thread that held the Stream would keep a dropped one
        # alive, decoding to the end and holding the decode lock, instead of letting __del__ stop it
        self._events = events = queue.Queue()
        self._cancel = cancel = threading.Event()
        self._done = done = object()
        self._closed = False

        def sink(ev: StreamEvent) -> None:
            if cancel.is_set():
                raise _Cancelled()
            events.put(ev)

        def work() -> None:
            try:
                generate(sink, cancel.is_set)  # asked again once it has its turn: dropped while it waited?
            except _Cancelled:
                pass
            except BaseException as e:  # re-raised in the caller's thread
                events.put(e)
            finally:
                _WORKERS.discard(entry)
            events.put(done)

        self._worker = threading.Thread(target=work, name="specpipe-stream", daemon=True)
        entry = (self._worker, cancel)
        _WORKERS.add(entry)
        _LIVE_STREAMS.add(self)
        self._worker.start()

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> StreamEvent:
        if self._closed:
            raise StopIteration
        if _DECODING.owner == threading.get_ident() and self._events.empty():  # its worker waits for this thread
            raise SpecpipeError("specpipe: a stream was read inside an on_event callback, while this thread is "
                                "decoding: it decodes only after the running call returns, so reading it here would "
                                "wait forever; keep the stream and read it after the call returns")
        ev = self._events.get()
        if ev is self._done:
            self.close()
            raise StopIteration
        if isinstance(ev, BaseException):
            self.close()
            raise ev
        return ev

    def close(self, wait: bool = True) -> None:
        """Stop decoding at the next step; `wait`: until the worker has (never from the thread that holds the
        decode lock, for which that worker may be waiting)."""
        if self._closed:
            return
        self._closed = True
        self._cancel.set()
        if wait and self._worker is not threading.current_thread() and _DECODING.owner != threading.get_ident():
            self._worker.join()
        _LIVE_STREAMS.discard(self)

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:  # the garbage collector may run this in any thread, the decoding one included: never wait here
            self.close(wait=False)
        except Exception:
            pass


@dataclass
class Completion:
    index: int
    prompt: str  # the prompt text (a chat: as its template rendered it)
    output_ids: list
    text: str
    finish_reason: str  # stop | length | error
    error: Optional[str] = None
    logprobs: Optional[list] = None  # generate(logprobs=True): each output token's raw target log-probability
    # its telemetry as completions.jsonl writes it: num_draft_tokens, num_accepted_tokens, acceptance_histogram, and
    # for a constrained request its constraint, grammar_forced_tokens, grammar_pruned_tokens, ... (docs/outputs.md)
    stats: dict = field(default_factory=dict)


def scalar(v: Any) -> Any:
    """A 0-d numpy array or torch tensor as its Python number (`tolist`); anything else as it is."""
    return v.tolist() if getattr(v, "ndim", None) == 0 and hasattr(v, "tolist") else v


def prompt_item(p: Any, n: int) -> dict:
    """One request's item from an API prompt (the prompts-file rules, errors naming `prompt n`)."""
    from specpipe.workload.prompts import not_unicode, parse_prompt_line

    if isinstance(p, str):
        why = not_unicode(p)
        return {"prompt": p, "where": f"prompt {n}"} if why is None else {"error": f"prompt {n}: {why}", "prompt": ""}
    if hasattr(p, "tolist") and getattr(p, "ndim", None) == 1:  # a numpy array or torch tensor of ids
        p = p.tolist()
    if isinstance(p, (list, tuple)):  # 0-d numpy / torch ids read as their numbers
        p = {"prompt_ids": [scalar(x) for x in p]}
    if isinstance(p, dict):  # numpy / torch values (arrays of ids, scalars) and tuples read as their lists
        p = {k: v.tolist() if hasattr(v, "tolist") and not isinstance(v, (str, bytes)) else
             list(v) if isinstance(v, tuple) else v for k, v in p.items()}
    why = nesting_problem(p, f"prompt {n}")  # (a cycle made every walk below loop forever)
    if why:
        return {"error": why, "prompt": ""}
    where = huge_int(p, f"prompt {n}")
    if where:
        return {"error": f"{where}, beyond any valid value (token ids, seeds and counts fit in 64 bits)",
                "prompt": ""}
    if not isinstance(p, dict):
        hint = " (token ids go in a list of their own: [[1, 2, 3]])" if isinstance(p, numbers.Integral) else ""
        return {"error": f"prompt {n}: is {type(p).__name__} {str(p)[:40]!r}; a prompt is a string, a list of "
                         f"token ids, or a dict with \"prompt\", \"prompt_ids\" or \"messages\"{hint}", "prompt": ""}
    return parse_prompt_line(p, f"prompt {n}")


def check_out_dir(out_dir) -> str:
    """out_dir with "~" expanded; a SpecpipeError unless it is (or can be made) a writable folder; checked before
    decoding."""
    import os

    if not isinstance(out_dir, (str, os.PathLike)) or not str(out_dir):
        raise SpecpipeError(f"specpipe: out_dir={out_dir!r} must be a folder path (None: write no files)")
    path = Path(out_dir).expanduser()
    if path.exists() and not path.is_dir():
        raise SpecpipeError(f"specpipe: out_dir={str(out_dir)!r} is a file, not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".specpipe-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise SpecpipeError(f"specpipe: out_dir={str(out_dir)!r} cannot be written ({e.strerror or e}); give a "
                            f"writable folder") from None
    return str(path)


class SpecPipe:
    def __init__(self, *overrides: str):
        from specpipe.models.cache import ensure_draft_model as ensure_standalone, load_pair, model_dtype
        from specpipe.run import check_against_model
        from specpipe.config.build import build
        from specpipe.config.check import check_overrides
        from specpipe.config.compose import compose_config
        from specpipe.config.overrides import expand_home, last_value

        bad = [o for o in overrides if not isinstance(o, str) or "=" not in o or o.startswith("-")]
        if bad:
            raise SpecpipeError(f"specpipe: overrides are 'key=value' strings as on the command line "
                                f"(e.g. 'draft.topk=4', 'allocator=paged'); got {bad[0]!r}")
        overrides = tuple(expand_home(list(overrides)))
        err = check_overrides(list(overrides), api=True)
        if err:
            raise SpecpipeError(err)
        self.cfg = compose_config(list(overrides))
        self.device = build(self.cfg.device, "device")
        self.dtype = model_dtype(self.cfg)
        self.pair = load_pair(self.cfg, self.dtype, self.device)
        ensure_standalone(self.cfg, self.pair, self.dtype, self.device)
        # what generate() would refuse, said now; but not the default workload.max_new_tokens (64) against a short
        # context: generate(max_new_tokens=...) may ask for fewer, and a call that does not is refused then
        check_against_model(self.cfg, self.pair,
                            max_new_tokens=last_value(list(overrides), "workload.max_new_tokens") is not None)
        self.metrics: Optional[dict] = None  # the last generate() call's metrics (metrics.json's content)
        self._calls = 0  # generate() calls so far: each draws with its own seed unless given one
        self._count = threading.Lock()
        self._kept: dict = {}  # what run() keeps between calls (draft=suffix: the cache of finished outputs)

    @property
    def tokenizer(self):
        return self.pair.tokenizer

    def generate(self, prompts: Sequence[Any], max_new_tokens: Optional[int] = None,
                 stop: Optional[str | Sequence[str]] = None, out_dir: Optional[str] = None,
                 on_event: Optional[Callable[[StreamEvent], None]] = None, temperature: Optional[float] = None,
                 top_p: Optional[float] = None, top_k: Optional[int] = None,
                 repetition_penalty: Optional[float] = None, min_p: Optional[float] = None,
                 logprobs: Optional[bool] = None, seed: Optional[int] = None) -> list[Completion]:
        """Completions in prompt order. `stop`: stop strings for every prompt (taken as given: no escapes);
        `out_dir` also writes metrics.json and completions.jsonl there; `on_event` gets a StreamEvent
        whenever a request commits tokens and when it finishes (each request's last event has its
        finish_reason, prompts that fail before decoding included). `temperature`, `top_p`, `top_k`,
        `repetition_penalty`, `min_p`: this call's sampling (sampling.* for all its prompts). `seed`: this call's
        sampling seed; without it the first call uses the run's seed (as `python -m specpipe` does) and each
        later call a new one derived from it, so repeated calls draw fresh samples, reproducibly from one
        process to the next (a prompt's own "seed" always wins). `logprobs`: each completion also holds its
        tokens' log-probabilities under the raw target logits (None: the overrides' workload.logprobs)."""
        self.metrics = None  # a call that raises leaves none, one refused before it decodes too (not an earlier call's)
        if on_event is not None and not callable(on_event):
            raise SpecpipeError(f"specpipe: on_event={on_event!r} must be a function taking a StreamEvent (or None)")
        cfg, items, out_dir = self._prepare("generate", prompts, max_new_tokens, stop, out_dir, logprobs, seed, dict(
            temperature=temperature, top_p=top_p, top_k=top_k, repetition_penalty=repetition_penalty, min_p=min_p))
        return self._decode(cfg, items, out_dir, on_event)

    def _prepare(self, method: str, prompts, max_new_tokens, stop, out_dir, logprobs, seed, sampling: dict):
        """The call's config, request items and output folder; every argument checked (SpecpipeError) before
        anything decodes (`method`: generate or stream, the call the errors name)."""
        from omegaconf import OmegaConf

        from specpipe.config.schema import is_int, sampling_problem
        from specpipe.config.stop_strings import check_stop

        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        elif isinstance(prompts, (bytes, bytearray)):
            raise SpecpipeError("specpipe: prompts must be text (str), token id lists or chat dicts, not bytes; "
                                "decode them first (prompt.decode('utf-8'))")
        elif hasattr(prompts, "tolist") and getattr(prompts, "ndim", None) == 2:  # a [N, T] array of ids
            prompts = prompts.tolist()
        elif hasattr(prompts, "tolist") and getattr(prompts, "ndim", None) == 1:  # [T] ids: one prompt; [N] texts
            listed = prompts.tolist()
            # numbers (float ids too: one prompt, refused with its own error, not each id as a text) or texts
            prompts = [listed] if listed and all(isinstance(t, (int, float)) for t in listed) else listed
        elif not isinstance(prompts, (list, tuple)):
            try:
                prompts = list(prompts)  # a generator, a dataset column
            except TypeError:
                raise SpecpipeError(f"specpipe: prompts must be a prompt (a string or a chat dict) or a list of "
                                    f"them, got {type(prompts).__name__} {str(prompts)[:40]!r}") from None
        if not prompts:
            raise SpecpipeError(f"specpipe: {method}() needs at least one prompt, "
                                f"got an empty {type(prompts).__name__}")
        # 0-d numpy / torch values read as their numbers, as they do inside a prompt's dict
        max_new_tokens, seed = scalar(max_new_tokens), scalar(seed)
        sampling = {k: scalar(v) for k, v in sampling.items()}
        for name, v in (("max_new_tokens", max_new_tokens), ("seed", seed), ("stop", stop), *sampling.items()):
            why = nesting_problem(v, name)
            if why:
                raise SpecpipeError(f"specpipe: {why}")
            where = huge_int(v, name)
            if where:
                raise SpecpipeError(f"specpipe: {where}, beyond any valid value (see help(SpecPipe.{method}))")
        cfg = self.cfg
        if max_new_tokens is not None:
            if not is_int(max_new_tokens) or max_new_tokens < 1:
                raise SpecpipeError(f"specpipe: max_new_tokens={max_new_tokens!r} must be an integer >= 1")
            cfg = OmegaConf.merge(cfg, {"workload": {"max_new_tokens": int(max_new_tokens)}})
        if logprobs is not None:
            if not _is_bool(logprobs):
                raise SpecpipeError(f"specpipe: logprobs={logprobs!r} must be True or False (None: the overrides' "
                                    f"workload.logprobs)")
            cfg = OmegaConf.merge(cfg, {"workload": {"logprobs": bool(logprobs)}})
        if seed is not None and (not is_int(seed) or not 0 <= seed <= 2 ** 63 - 1):
            raise SpecpipeError(f"specpipe: seed={seed!r} must be an integer between 0 and 2**63-1 (None: a new seed "
                                f"for each call)")
        sampling = {k: v for k, v in sampling.items() if v is not None}
        for key, v in sampling.items():  # as strictly as a prompt's own values: "0.7" is not a number
            why = sampling_problem(key, v)
            if why:
                raise SpecpipeError(f"specpipe: {key}={v!r} {why}")
        sampling = {k: int(v) if k == "top_k" else float(v) for k, v in sampling.items()}  # numpy scalars too
        if sampling:  # this call's values win over the model's generation_config (from_model) and sampling.*
            from specpipe.models.cache import model_sampling

            cfg, _ = model_sampling(cfg, self.pair)
            try:
                cfg = OmegaConf.merge(cfg, {"sampling": {**sampling, "from_model": False}})
            except Exception as e:  # a type OmegaConf cannot convert: the same words as the CLI's
                raise SpecpipeError(f"specpipe: invalid sampling argument {sampling}: {str(e).splitlines()[0]}") \
                    from None
        if out_dir is not None:
            out_dir = check_out_dir(out_dir)
        items = [prompt_item(p, n) for n, p in enumerate(prompts)]
        if stop is not None:
            if hasattr(stop, "tolist") and not isinstance(stop, str):  # a numpy array of strings
                stop = stop.tolist()
            why = check_stop(stop)
            if why:
                raise SpecpipeError(f"specpipe: {why}")
            extra = [stop] if isinstance(stop, str) else list(stop)
            items = [{**it, "stop": [*it.get("stop", ()), *extra]} for it in items]
        from specpipe.run import check_against_model
        from specpipe.config.validate import validate

        validate(cfg)  # what run() checks first (max_new_tokens against the context): before a stream's worker starts
        check_against_model(cfg, self.pair)  # and before the call takes its number: a refused call takes none
        with self._count:  # calls from several threads each take their own number (a call refused above takes none)
            k, self._calls = self._calls, self._calls + 1
        if seed is None:  # call k > 0: a new base seed, derived from the run's and k (the first call is the CLI's run)
            from specpipe.decode.sampling import request_seed

            run_seed = cfg.sampling.seed if cfg.sampling.get("seed") is not None else cfg.seed
            seed = run_seed if k == 0 else request_seed(run_seed, -k)
        cfg = OmegaConf.merge(cfg, {"sampling": {"seed": int(seed)}})
        return cfg, items, out_dir

    def _decode(self, cfg, items: list, out_dir, on_event, cancelled: Callable[[], bool] = lambda: False):
        from specpipe.run import run

        deltas = _Deltas(self.pair.tokenizer.decode, on_event) if on_event is not None else None
        self.metrics = None  # a call that fails leaves none (not an earlier call's)
        with _DECODING:
            if cancelled():
                raise _Cancelled()  # a stream closed while it waited for its turn: nothing to decode
            out = run(cfg, out_dir=out_dir, quiet=True, pair=self.pair, items=items, on_step=deltas,
                      keep=self._kept)
            if deltas is not None:  # requests that never ran (bad prompts) get their one, final event
                deltas(out["requests"])
        self.metrics = out["metrics"]
        from specpipe.outputs.files import request_stats

        return [Completion(r.index, r.prompt, list(r.output_ids), output_text(self.pair.tokenizer, r.prompt_ids,
                                                                                r.output_ids), r.finish_reason, r.error,
                           None if r.logprobs is None else list(r.logprobs), request_stats(r))
                for r in out["requests"]]

    def stream(self, prompts: Sequence[Any], max_new_tokens: Optional[int] = None,
               stop: Optional[str | Sequence[str]] = None, out_dir: Optional[str] = None,
               logprobs: Optional[bool] = None, seed: Optional[int] = None, **sampling) -> Stream:
        """`generate` as a `Stream` of StreamEvents, in the order tokens are committed (`sampling`: its
        temperature / top_p / top_k / repetition_penalty / min_p). Arguments are checked here, before the
        stream starts (SpecpipeError). Decoding runs in a worker thread; closing the stream (`close()`, a `with`
        block, or the end of a `for` loop over an unnamed stream) stops it at the next step."""
        from specpipe.config.schema import SAMPLING_RULES  # a call's sampling arguments: the settings a prompt may set

        self.metrics = None  # as generate(): a refused call leaves none
        unknown = sorted(set(sampling) - set(SAMPLING_RULES))
        if unknown:
            raise SpecpipeError(f"specpipe: stream() got an unknown argument {unknown[0]!r} (valid: prompts, "
                                f"max_new_tokens, stop, out_dir, logprobs, seed, {', '.join(SAMPLING_RULES)}; events "
                                f"come from iterating the stream, so there is no on_event)")
        cfg, items, out_dir = self._prepare("stream", prompts, max_new_tokens, stop, out_dir, logprobs, seed, sampling)
        return Stream(lambda sink, cancelled: self._decode(cfg, items, out_dir, sink, cancelled))
