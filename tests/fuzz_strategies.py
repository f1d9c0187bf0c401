"""Hypothesis strategies and settings for the fuzz suite over specpipe's three front doors: the command line's
overrides (tests/cli/test_fuzz_overrides.py), prompts-file lines (tests/workload/test_fuzz_prompts.py) and
SpecPipe.generate()'s arguments (tests/test_fuzz_api.py).

The property everywhere: a hostile input gets a one-paragraph SpecpipeError (exit 2) or a per-request error,
never another exception, a traceback or a hang. `make test` runs a derandomized few hundred examples (the same
ones every time, so CI is deterministic); `FUZZ_EXAMPLES=20000` runs that many random ones across the suite,
each test taking its share of the total (the cheap ones more).
"""
from __future__ import annotations

import contextlib
import json
import os
import reprlib
import signal
import string
from functools import lru_cache

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

# examples per test in the default (derandomized) run; FUZZ_EXAMPLES=N splits N in these proportions
SHARES = {"overrides_cli": 50, "overrides_api": 30, "cli_subprocess": 8, "prompt_values": 200, "prompt_files": 100,
          "bad_neighbours": 12, "generate": 100, "constructor": 8}
LONG = os.environ.get("FUZZ_EXAMPLES", "").strip()
settings.register_profile(
    "fuzz", deadline=None, derandomize=not LONG, print_blob=True,  # bounded() guards time instead of deadlines
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
                           HealthCheck.large_base_example, HealthCheck.function_scoped_fixture])


def fuzz_settings(test: str, **over) -> settings:
    """The fuzz profile with `test`'s share of the examples (see SHARES)."""
    n = SHARES[test] if not LONG else max(1, round(int(LONG) * SHARES[test] / sum(SHARES.values())))
    return settings(settings.get_profile("fuzz"), max_examples=n, **over)


class Hang(BaseException):
    """One example ran past its bound. A BaseException, so code under test that turns every Exception into a
    message (the override check does) cannot swallow it."""


@contextlib.contextmanager
def bounded(seconds: float, what: str):
    """Fail the example with Hang if its body runs longer than `seconds` (main thread only: SIGALRM)."""
    def on_alarm(signum, frame):
        raise Hang(f"{what} ran past {seconds} s (a hang?)")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# ---- values of every JSON type -------------------------------------------------------------------------------

HUGE_INTS = [2 ** 31, 2 ** 63 - 1, 2 ** 63, 2 ** 64, -2 ** 63 - 1, 10 ** 30, -10 ** 30, 10 ** 300]
ints = st.one_of(st.integers(-3, 12), st.integers(), st.sampled_from(HUGE_INTS))
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                   st.sampled_from([0.0, -0.0, 0.5, 1.0, 1e-320, 1e308, -1e308, float("nan"), float("inf")]))
# text a user might type: spaces, quotes, escapes, Hydra's own syntax characters, non-ASCII
TRICKY = " '\"\\$${}[](),:=~+*?#%\t@!|<>`^&;é中😀\u200b\x00"
texts = st.one_of(st.text(alphabet=string.ascii_letters + string.digits + "._-/" + TRICKY, max_size=12),
                  st.text(max_size=8), st.sampled_from(["", " ", "null", "None", "true", "1", "-", "~", "???"]))
scalars = st.one_of(st.none(), st.booleans(), ints, floats, texts)
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                            st.dictionaries(texts, inner, max_size=3)),
                           max_leaves=6)


# ---- the config's keys and options ---------------------------------------------------------------------------

@lru_cache(maxsize=None)
def schema_keys() -> dict:
    """dotted key -> its default (NODE for a node), for every key of every schema specpipe registers: the base
    config and each group option's dataclass, from Hydra's ConfigStore."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import DictConfig

    from specpipe.config.schema import register_schemas

    register_schemas()
    repo = ConfigStore.instance().repo
    found: dict = {}

    def walk(node, prefix: str) -> None:
        for k in node.keys():
            key, child = f"{prefix}{k}", node._get_node(k)
            if isinstance(child, DictConfig):
                found[key] = NODE
                walk(child, key + ".")
            else:
                found.setdefault(key, child._value())

    walk(repo["base_config.yaml"].node, "")
    for group, entries in repo.items():
        if isinstance(entries, dict) and group != "hydra":
            for name, entry in entries.items():
                if name.startswith("base_"):
                    walk(entry.node, group + ".")
    return dict(sorted(found.items()))


NODE = object()


@lru_cache(maxsize=None)
def group_options() -> dict[str, tuple[str, ...]]:
    """group -> its options: the YAML files of specpipe/conf/<group>/ (hydra/launcher's too), and Hydra's own
    sweeper and launcher names."""
    from specpipe.config.compose import CONF_DIR

    found = {str(d.relative_to(CONF_DIR)): tuple(sorted(p.stem for p in d.glob("*.yaml")))
             for d in CONF_DIR.rglob("*") if d.is_dir() and any(d.glob("*.yaml"))}
    launchers = {*found.get("hydra/launcher", ()), "basic", "joblib", "ray", "submitit_local"}
    found["hydra/launcher"] = tuple(sorted(launchers))
    found["hydra/sweeper"] = ("basic", "optuna")
    return found


@lru_cache(maxsize=None)
def shipped_targets() -> dict[str, frozenset]:
    """group -> the `_target_` of every schema registered for it (the only classes a config may build)."""
    from hydra.core.config_store import ConfigStore

    out = {}
    for group, entries in ConfigStore.instance().repo.items():
        if isinstance(entries, dict) and group != "hydra":
            out[group] = frozenset(e.node.get("_target_") for n, e in entries.items()
                                   if n.startswith("base_") and "_target_" in e.node)
    return out


# keys left out of real runs (python -m specpipe, SpecPipe(...)): slow ones (compiling, big models, many threads,
# long decodes) and Hydra's folders, which it would create outside the test's own
RUN_UNSAFE = ("compile", "hydra", "sweep", "model.hidden_size", "model.num_layers", "model.vocab_size",
              "model.intermediate_size", "model.num_heads", "model.num_kv_heads", "model.max_position",
              "model.sliding", "model.sparse", "device.num_threads", "allocator.num_slots", "allocator.swa_num",
              "allocator.host_to_device", "allocator.window", "workload.batch_size", "workload.max_new_tokens",
              "workload.num_prompts", "draft.cache", "draft.running", "model_timing")
HYDRA_KEYS = ["hydra.run.dir", "hydra.sweep.dir", "hydra.sweep.subdir", "hydra.job.chdir", "hydra.mode",
              "hydra.searchpath", "hydra.verbose", "hydra.job.name", "hydra.output_subdir", "hydra.sweeper.params",
              "hydra.sweeper.params.draft.topk", "hydra.launcher.n_jobs", "hydra.job_logging.root.level"]
# reaching outside code through a module specpipe imports, classes of the wrong group, names that do not exist
TARGETS = ["specpipe.run.torch.load", "specpipe.run.os.system", "specpipe.api.json.dumps", "builtins.print",
           "os.system", "specpipe.allocators.swa.SWAAllocator", "specpipe.nonexistent.Foo", "specpipe.", "",
           "specpipe.devices.cpu.CpuDevice", "specpipe.drafters.suffix.SuffixProposer", "torch.nn.Linear"]


def edits(word: str) -> st.SearchStrategy:
    """`word` with one or two typos: a character dropped, doubled, swapped with the next, or replaced."""
    def one(w: str, draw) -> str:
        if not w:
            return draw(st.sampled_from(string.ascii_lowercase))
        i = draw(st.integers(0, len(w) - 1))
        how = draw(st.sampled_from(["drop", "double", "swap", "replace"]))
        c = draw(st.sampled_from(string.ascii_lowercase + "._"))
        return {"drop": w[:i] + w[i + 1:], "double": w[:i] + w[i] + w[i:], "replace": w[:i] + c + w[i + 1:],
                "swap": w[:i] + w[i + 1:i + 2] + w[i] + w[i + 2:]}[how]

    @st.composite
    def typo(draw):
        w = one(word, draw)
        return one(w, draw) if draw(st.booleans()) else w
    return typo()


def typoed(words) -> st.SearchStrategy:
    return st.sampled_from(sorted(words)).flatmap(edits)


def keys(exclude=()) -> st.SearchStrategy:
    """Override keys: the schemas' (most often), their typos, group names, Hydra's, and junk."""
    real = [k for k in schema_keys() if not k.startswith(tuple(exclude))]
    hydra = [k for k in HYDRA_KEYS if not k.startswith(tuple(exclude))]
    return st.one_of(st.sampled_from(real), st.sampled_from(real), typoed(real),
                     st.sampled_from(real).map(lambda k: k + ".x"), *([st.sampled_from(hydra)] if hydra else []),
                     st.text(alphabet=string.ascii_letters + "._-/+~@", min_size=1, max_size=10))


def plausible(default) -> st.SearchStrategy:
    """Values of the default's type, near the range a user would try (so a list of them gets past the parse and
    reaches the config's own rules)."""
    if isinstance(default, bool):
        return st.sampled_from(["true", "false", "True", "1", "yes"])
    if isinstance(default, int):
        return st.one_of(st.integers(-2, 16).map(str), st.sampled_from(["0", "64", "1024", "2.0", "1e3"]))
    if isinstance(default, float):
        return st.one_of(st.floats(-1, 2).map(repr), st.sampled_from(["0", "1", "0.5", "1e-6", "nan", "inf"]))
    if isinstance(default, str) and default != "???":
        return st.one_of(st.just(default), edits(default), st.sampled_from(["auto", "eager", "compiled", "graph",
                                                                            "float32", "bfloat16", "all"]))
    return st.one_of(st.sampled_from(["null", "1", "0.5", "x", "[1,2]", "'a b'", "[]"]), ints.map(str))


def known_key_values(exclude=()) -> st.SearchStrategy:
    """key=value with a key of the schemas and a value of its type."""
    leaves = {k: d for k, d in schema_keys().items() if d is not NODE and not k.startswith(tuple(exclude))}
    return st.sampled_from(sorted(leaves)).flatmap(lambda k: plausible(leaves[k]).map(lambda v: f"{k}={v}"))


def render(v) -> str:
    """A value in Hydra's override syntax: null, true, 1.5, nan, 'quoted', [a, b], {k: v}."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return "'" + v.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(v, list):
        return "[" + ",".join(render(x) for x in v) + "]"
    return "{" + ",".join(f"{k}:{render(x)}" for k, x in v.items()) + "}"


def interpolations(keys_: st.SearchStrategy) -> st.SearchStrategy:
    refs = st.one_of(keys_, st.sampled_from(["seed", "draft.topk", ".topk", "..seed", "", "hydra:runtime.cwd",
                                             "hydra:job.name", "now:%Y", "oc.env:HOME", "oc.env:SPECPIPE_NOPE",
                                             "oc.env:HOME,x", "oc.select:seed,0", "oc.create:{a:1}",
                                             "oc.decode:'{a: 1}'", "oc.deprecated:seed", "nope:x", "${seed}"]))
    return st.tuples(refs, st.sampled_from(["${%s}", "'${%s}'", "\\${%s}", "${%s", "x${%s}y", "[${%s}]"])).map(
        lambda t: t[1] % t[0])


def values(keys_: st.SearchStrategy) -> st.SearchStrategy:
    """Override values: JSON values (Hydra's syntax, JSON's, or as raw text), interpolations, sweeps, text."""
    return st.one_of(json_values.map(render), json_values.map(json.dumps), scalars.map(str), texts,
                     interpolations(keys_), st.sampled_from(["1" * 5000, "1e309", "-inf", "nan", "0x10", "1_000",
                                                             "1,2", "range(1,3)", "choice(a,b)", "glob(*)", "[", "{",
                                                             "'", "interval(0,1)", "tag(x,1)", "null"]))


def group_overrides(exclude=()) -> st.SearchStrategy:
    """group=option with real options, their typos, the base_* schemas, null and junk."""
    groups = {g: o for g, o in group_options().items() if not g.startswith(tuple(exclude))}

    @st.composite
    def one(draw):
        group = draw(st.sampled_from(sorted(groups)))
        option = draw(st.one_of(st.sampled_from(groups[group]), typoed(groups[group]), st.sampled_from(
            [f"base_{groups[group][0]}", "null", "", "nope", "a,b", "glob(*)"]), texts))
        prefix = draw(st.sampled_from(["", "", "+", "++", "~"]))
        return f"{prefix}{group}={option}" if prefix != "~" or draw(st.booleans()) else f"~{group}"
    return one()


def overrides(exclude=(), max_size: int = 3) -> st.SearchStrategy:
    """Lists of command-line overrides, most of them well formed (the first bad one decides the message, so a
    list of junk would only ever test the parse). `exclude`: key prefixes left out (slow or unsafe to run)."""
    keys_ = keys(exclude)
    target_keys = [g for g in ("model", "allocator", "device", "draft") if not g.startswith(tuple(exclude))]
    key_value = st.tuples(st.sampled_from(["", "", "", "+", "++", "~"]), keys_, values(keys_)).map(
        lambda t: f"{t[0]}{t[1]}={t[2]}")
    removal = st.tuples(st.sampled_from(["~", "+", ""]), keys_).map("".join)
    targets = st.tuples(st.sampled_from(target_keys or ["draft"]), st.sampled_from(TARGETS)).map(
        lambda t: f"{t[0]}._target_={t[1]}")
    known = known_key_values(exclude)
    groups = group_overrides(exclude)
    one = st.one_of(known, known, known, known, known, groups, groups, key_value, key_value, removal, targets,
                    st.text(max_size=10))
    return st.lists(one, max_size=max_size)


def flags() -> st.SearchStrategy:
    """Flags of the command line (mostly none): -m, --cfg, --info, -cn, -cd."""
    return st.one_of(st.just([]), st.just([]), st.just([]), st.sampled_from(
        [["-m"], ["--cfg", "job"], ["--cfg", "nope"], ["--info"], ["-cn", "nope"], ["-cd", "/nonexistent"],
         ["--config-name", "config"], ["-c", "all"]]))


# ---- prompts: objects as a prompts file's line or an API dict, and lines of bytes ----------------------------

PROMPT_FIELDS = ("prompt", "prompt_ids", "messages", "seed", "max_new_tokens", "max_tokens", "max_completion_tokens",
                 "stop", "stop_token_ids", "temperature", "top_p", "top_k", "repetition_penalty", "min_p", "tools",
                 "documents", "chat_template_kwargs", "presence_penalty", "n", "logprobs", "do_sample",
                 "ignore_eos", "stop_sequences", "max_length", "add_generation_prompt")
field_names = st.one_of(st.sampled_from(PROMPT_FIELDS), st.sampled_from(PROMPT_FIELDS).map(str.title),
                        st.sampled_from(["top-p", "MAX_TOKENS", "prompt_idx", "id", "metadata", ""]),
                        typoed(PROMPT_FIELDS), texts)
# a good prompt: text that starts with a letter (an empty one is refused), or ids inside random_tiny's vocab
good_texts = st.tuples(st.sampled_from(string.ascii_letters), st.text(max_size=30)).map("".join)
messages = st.lists(st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "system", "assistant"]),
                                                             json_values)},
                                          optional={"content": st.one_of(texts, json_values, st.just(
                                              [{"type": "text", "text": "hi"}]))}), max_size=3)


@st.composite
def good_prompts(draw) -> dict:
    """A prompt every run decodes, greedily: text or ids, with fields that keep it greedy (a seed, a lower
    limit, stop strings, a column of the dataset's own)."""
    obj = draw(st.one_of(good_texts.map(lambda t: {"prompt": t}),
                         st.lists(st.integers(3, 250), min_size=1, max_size=12).map(lambda i: {"prompt_ids": i})))
    extra = draw(st.fixed_dictionaries({}, optional={
        "seed": st.integers(0, 2 ** 63 - 1), "max_new_tokens": st.integers(1, 3), "temperature": st.just(0),
        "stop": st.one_of(good_texts, st.lists(good_texts, min_size=1, max_size=2)), "id": json_values}))
    return {**obj, **extra}


def field_values(name: str) -> st.SearchStrategy:
    """Values for a prompt's field: its own kind (good or near it) or any JSON value."""
    own = {"prompt": good_texts, "prompt_ids": st.lists(ints, max_size=4), "messages": messages,
           "stop": st.one_of(texts, st.lists(texts, max_size=3)), "seed": ints,
           "stop_token_ids": st.lists(ints, max_size=3)}.get(name, st.one_of(ints, floats))
    return st.one_of(own, json_values)


@st.composite
def prompt_objects(draw):
    """A prompt's object as a line of a prompts file holds it (after json.loads), good or bad: one of the prompt
    fields with any other fields of any type, a dict of junk, or a value that is no object at all."""
    kind = draw(st.sampled_from(["fields", "fields", "fields", "good", "junk", "value"]))
    if kind == "good":
        return draw(good_prompts())
    if kind == "value":
        return draw(json_values)
    if kind == "junk":
        return draw(st.dictionaries(field_names, json_values, max_size=4))
    names = draw(st.lists(st.sampled_from(PROMPT_FIELDS), min_size=1, max_size=4, unique=True))
    return {name: draw(field_values(name)) for name in names}


def dumps(obj) -> bytes:
    return json.dumps(obj).encode()  # (NaN and Infinity as Python writes them: JSON readers take them)


class Long(bytes):
    """A long line whose repr is short: a failing example's report quotes it, not its 300 KB."""

    def __repr__(self) -> str:
        return f"<{len(self)} bytes: {bytes(self[:30])!r}...{bytes(self[-10:])!r}>"


class LongText(str):
    def __repr__(self) -> str:
        return f"<{len(self)} characters: {str(self[:20])!r}...>"


HUGE_LINES = [Long(b'{"prompt": "' + b"x" * 300_000 + b'"}'), Long(dumps({"prompt_ids": [5] * 50_000})),
              Long(dumps({"prompt": "a", "stop": ["s"] * 20_000})),
              Long(b'{"prompt": "a", "seed": ' + b"1" * 5000 + b"}"),
              Long(b"[" * 100_000), Long(b'{"a":' * 20_000), Long(dumps({"prompt": "\U0001F600" * 50_000})),
              b'{"prompt": "a", "temperature": NaN, "top_p": Infinity}', b'{"prompt": "\\ud800"}',
              b'{"prompt": "a\x00b"}', b'{"prompt": "a"}{"prompt": "b"}', b'{"prompt": "a",}']
BLANK_LINES = [b"", b" ", b"\t", b"\r", b"\xef\xbb\xbf", b" \x0b\x0c "]


@st.composite
def bad_lines(draw) -> bytes:
    """A line of a prompts file that is not a good prompt (or is by chance): any prompt object, a good line cut
    short, bytes that are no UTF-8, a huge one, a blank one."""
    kind = draw(st.sampled_from(["object", "object", "object", "truncated", "bytes", "huge", "blank", "bom"]))
    if kind == "object":
        return dumps(draw(prompt_objects()))
    if kind == "truncated":
        line = dumps(draw(prompt_objects()))
        return line[:draw(st.integers(0, max(0, len(line) - 1)))]
    if kind == "bytes":  # (no line ends inside: each generated line stays one line)
        return draw(st.binary(max_size=40)).replace(b"\n", b"").replace(b"\r", b"")
    if kind == "huge":
        return draw(st.sampled_from(HUGE_LINES))
    if kind == "bom":
        return b"\xef\xbb\xbf" + dumps(draw(prompt_objects()))
    return draw(st.sampled_from(BLANK_LINES))


def is_blank(line: bytes) -> bool:
    """Whether the prompts-file reader skips the line (white space, or only a byte-order mark)."""
    return not line.removeprefix(b"\xef\xbb\xbf").strip()


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict, _SHORT.maxtuple, _SHORT.maxstring = 4, 6, 6, 6, 80


def brief(x, n: int = 200) -> str:
    """x's repr for a failure message, cut to n characters without writing it out whole first (a list that shares
    its elements 40 levels deep has 2**40 leaves; repr of a huge int raises past 4300 digits)."""
    try:
        return _SHORT.repr(x)[:n]
    except Exception as e:
        return f"<{type(x).__name__}: repr raised {type(e).__name__}>"
