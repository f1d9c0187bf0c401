"""The sandbox a model folder's chat template renders in: jinja2's immutable sandbox, with caps on size and time.

jinja2's `ImmutableSandboxedEnvironment` keeps a template from Python's internals and caps `range()` at
100000 items, but not what its operators build: `{{ 'x' * 1000000000 }}` in a downloaded
`chat_template.jinja` took 42 s and 4.4 GB, and wrote its 1 GB output into completions.jsonl. Here a render
fails, as that request's error naming the cap, once it would build a value (a string, a list, a number)
or an output of more than MAX_RENDER_CHARS, or run longer than MAX_RENDER_SECONDS:

- the operators `*`, `+`, `**` and `%` are checked before they run (`'x' * n`, `[s] * n`, `2 ** n`,
  `'%99999999s' % x`), as are the calls and filters whose result can outgrow their input (`center`, `ljust`,
  `indent`, `wordwrap`, `replace`, `join`, `format`, `translate`, `lipsum`, any width or count past the cap);
  every other call's, filter's and `~`'s result is measured after it;
- a list counts as its text would: `[s] * 1000` of a 1 MB `s` is 1 GB once printed or joined;
- time is checked at each of those steps, at each loop's items and at each chunk of output, so a loop
  nest that would run for hours stops at the budget.
"""
from __future__ import annotations

import re
import threading
import time
from typing import Any, Optional

from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

MAX_RENDER_CHARS = 16 * 2 ** 20  # a rendered prompt, and any one value a template builds (16M tokens' worth or more)
MAX_RENDER_SECONDS = 5.0  # one render; a real chat template takes well under 10 ms
MAX_INT_BITS = 2 ** 16  # a number a template computes (~20000 digits; Python prints at most 4300)
TICK_ITEMS = 256  # loop items between clock checks

# calls whose int arguments are not widths or counts (a dict's values, a default, a position); "|name" is a filter
INT_ARGS_FINE = frozenset({"namespace", "dict", "get", "index", "count", "find", "rfind", "startswith", "endswith",
                           "raise_exception", "safe_range", "|default", "|d", "|round", "|int", "|float"})
_DIGITS = re.compile(r"\d+")
_ESTIMATED = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs", "replace", "|replace", "join", "|join",
                        "|indent", "|wordwrap", "format", "format_map", "|format", "translate", "|batch", "|slice",
                        "|tojson", "|pprint", "generate_lorem_ipsum"})


class TemplateLimitError(Exception):
    """A render that went over MAX_RENDER_CHARS, MAX_INT_BITS or MAX_RENDER_SECONDS."""


def measure(x: Any, limit: int = MAX_RENDER_CHARS) -> tuple[int, int]:
    """(size, depth) of a value as its text would be: a string's length; a list's, tuple's or dict's elements
    summed (each place a shared element appears counts); other values 1 (an int: its digits). Counting stops
    just past `limit`. A container reached again is measured once (its size remembered by id)."""
    if isinstance(x, (str, bytes)):
        return len(x), 0
    if isinstance(x, range):
        return len(x) * (len(str(max(abs(x.start), abs(x.stop)))) + 2), 1
    if isinstance(x, int) and not isinstance(x, bool):
        return x.bit_length() // 3 + 1, 0
    if not isinstance(x, (list, tuple, dict, set, frozenset)):
        return 1, 0
    known: dict[int, tuple[int, int]] = {}

    def walk(v, depth: int) -> tuple[int, int]:
        if isinstance(v, (str, bytes)):
            return len(v), 0
        if not isinstance(v, (list, tuple, dict, set, frozenset)):
            return measure(v, limit) if isinstance(v, (int, range)) else (1, 0)
        if id(v) in known:
            return known[id(v)]
        if depth > 1000:
            raise TemplateLimitError("a value nested more than 1000 deep")
        size, deepest = len(v), 0
        for e in (v.items() if isinstance(v, dict) else v):
            s, d = walk(e, depth + 1)
            size, deepest = size + s, max(deepest, d)
            if size > limit:
                break
        known[id(v)] = (size, deepest + 1)
        return size, deepest + 1

    return walk(x, 0)


def size_of(x: Any) -> int:
    return measure(x)[0]


def _num(v: int) -> str:
    """An int for a message (printing one of more than 4300 digits raises ValueError)."""
    return str(v) if v.bit_length() <= 64 else f"a number of {v.bit_length()} bits"


def _too_big(size: int, what: str) -> None:
    if size > MAX_RENDER_CHARS:
        raise TemplateLimitError(f"{what} of more than {MAX_RENDER_CHARS} characters ({MAX_RENDER_CHARS // 2 ** 20} "
                                 f"Mi, the cap on any value a chat template builds and on the prompt it renders)")


def _format_size(fmt: str, values: list, marker: str) -> int:
    """An upper bound of a format's output: its text, each field as wide as all the values together, and the
    widest width its spec names (a 9-digit width is past the cap)."""
    widths = [len(d) > 9 or int(d) for d in _DIGITS.findall(fmt)]
    widest = MAX_RENDER_CHARS + 1 if True in widths else max([0, *widths])
    return len(fmt) + fmt.count(marker) * (sum(map(size_of, values)) + widest)


def _estimate(name: str, subject: Any, args: tuple, kwargs: dict) -> Optional[int]:
    """An upper bound of the size a call that can outgrow its input would return, before it runs; None for
    the others (measured after). `subject` is a method's object or a filter's value."""
    if name not in _ESTIMATED:
        return None
    arg = (list(args) + [None] * 4)
    if name in ("center", "ljust", "rjust", "zfill") and isinstance(arg[0], int):
        return max(size_of(subject), arg[0])
    if name == "expandtabs":
        tab = arg[0] if isinstance(arg[0], int) else kwargs.get("tabsize", 8)
        return size_of(subject) * max(1, tab if isinstance(tab, int) else 8)
    if name in ("replace", "|replace") and isinstance(subject, str):
        old, new = arg[0], arg[1]
        if not isinstance(old, str) or not isinstance(new, str):
            return None
        return len(subject) + (subject.count(old) if old else len(subject) + 1) * len(new)
    if name == "join" and isinstance(subject, str):  # str.join: the subject is the separator
        items = arg[0]
        return size_of(items) + len(subject) * (len(items) if hasattr(items, "__len__") else MAX_RENDER_CHARS)
    if name == "|join":
        sep = arg[0] if arg[0] is not None else kwargs.get("d", "")
        n = len(subject) if hasattr(subject, "__len__") else MAX_RENDER_CHARS
        return size_of(subject) + n * len(str(sep))
    if name == "|indent":
        width = arg[0] if arg[0] is not None else kwargs.get("width", 4)
        per_line = width if isinstance(width, int) else len(str(width))
        return len(str(subject)) + (str(subject).count("\n") + 1) * per_line
    if name == "|wordwrap":
        wrap = arg[2] if arg[2] is not None else kwargs.get("wrapstring") or "\n"
        return len(str(subject)) * (1 + len(str(wrap)))
    if name in ("format", "format_map", "|format") and isinstance(subject, str):
        return _format_size(subject, [*args, *kwargs.values()], "%" if name == "|format" else "{")
    if name == "translate" and isinstance(subject, str) and isinstance(arg[0], dict):
        return len(subject) * max([1, *map(size_of, arg[0].values())])
    if name in ("|batch", "|slice") and isinstance(arg[0], int):
        return size_of(subject) + arg[0] * size_of(arg[1] if arg[1] is not None else kwargs.get("fill_with"))
    if name in ("|tojson", "|pprint"):
        size, depth = measure(subject)
        indent = kwargs.get("indent", arg[1] if name == "|tojson" else None)
        width = indent if isinstance(indent, int) else len(indent) if isinstance(indent, str) else 1
        return 6 * size * (1 + width * (depth + 1))
    if name == "generate_lorem_ipsum":
        n = arg[0] if isinstance(arg[0], int) else kwargs.get("n", 5)
        most = arg[3] if isinstance(arg[3], int) else kwargs.get("max", 100)
        return 16 * max(0, n) * max(0, most) if isinstance(n, int) and isinstance(most, int) else None
    return None


def _check_call(name: str, subject: Any, args: tuple, kwargs: dict) -> None:
    if name not in INT_ARGS_FINE and (args or kwargs):
        for v in (*args, *kwargs.values()):
            if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_RENDER_CHARS:
                _too_big(abs(v), f"{name}() was given {_num(v)}, a width or count")
    est = _estimate(name, subject, args, kwargs)
    if est is not None:
        _too_big(est, f"{name}() would build a value")


class _Guard(NodeTransformer):
    """Routes each loop's items and each `~` through the environment's checks (`ticking`, `checked`)."""

    def visit_For(self, node: nodes.For) -> nodes.For:
        self.generic_visit(node)
        node.iter = nodes.Call(nodes.EnvironmentAttribute("ticking"), [node.iter], [], None, None,
                               lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Call:
        self.generic_visit(node)
        return nodes.Call(nodes.EnvironmentAttribute("checked"), [node], [], None, None, lineno=node.lineno)


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """ImmutableSandboxedEnvironment whose templates (made by `from_source`) stay within MAX_RENDER_CHARS,
    MAX_INT_BITS and, between `start_clock()` and the end of a render, MAX_RENDER_SECONDS."""

    intercepted_binops = frozenset({"*", "+", "**", "%"})

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self._clock = threading.local()  # this thread's render's deadline (renders of several threads each their own)

    def start_clock(self) -> None:
        self._clock.deadline = time.monotonic() + MAX_RENDER_SECONDS

    def tick(self) -> None:
        if time.monotonic() > getattr(self._clock, "deadline", float("inf")):
            raise TemplateLimitError(f"it ran longer than {MAX_RENDER_SECONDS:g} s (the cap on one render)")

    def from_source(self, source: str):
        """The template of `source`, its loops and `~` guarded, its filters checked."""
        for name, f in list(self.filters.items()):
            if not getattr(f, "_bounded", False):
                self.filters[name] = self._checked_filter(name, f)
        tree = _Guard().visit(self.parse(source))
        tree.set_environment(self)
        return self.from_string(tree)

    def _checked_filter(self, name: str, f):
        import functools

        passes = getattr(f, "jinja_pass_arg", None)  # (a filter that takes the environment or context first)

        @functools.wraps(f)
        def checked(*args, **kwargs):
            self.tick()
            lead = 1 if passes is not None else 0
            subject, rest = (args[lead] if len(args) > lead else None), args[lead + 1:]
            if name == "join" and not hasattr(subject, "__len__"):  # a generator (|map): measured as a list
                subject = list(subject)
                args = (*args[:lead], subject, *rest)
            _check_call("|" + name, subject, rest, kwargs)
            return self.checked(f(*args, **kwargs))

        checked._bounded = True
        return checked

    def checked(self, value: Any) -> Any:
        """`value`, once it is within the caps."""
        if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > MAX_INT_BITS:
            raise TemplateLimitError(f"a number of more than {MAX_INT_BITS} bits (the cap on a template's numbers)")
        _too_big(size_of(value), "a value")
        return value

    def ticking(self, iterable):
        """`iterable`'s items, checking the clock every TICK_ITEMS of them."""
        for i, item in enumerate(iterable):
            if i % TICK_ITEMS == 0:
                self.tick()
            yield item

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        """`left operator right`, checked before it runs (a template's `+` between strings is its commonest
        step, so that one is checked first and inline). No clock check here: one step is bounded by the caps,
        and steps repeat only in loops and calls, which check it."""
        if operator == "+":
            if type(left) is str and type(right) is str:
                if len(left) + len(right) > MAX_RENDER_CHARS:
                    _too_big(len(left) + len(right), "joining two strings would build one")
            elif not isinstance(left, (int, float)) or not isinstance(right, (int, float)):
                _too_big(size_of(left) + size_of(right), "joining two values would build one")
            return left + right
        ints = isinstance(left, int) and isinstance(right, int)
        if operator == "*" and ints:
            if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise TemplateLimitError(f"a number of more than {MAX_INT_BITS} bits (the cap on a template's "
                                         f"numbers)")
        elif operator == "*" and isinstance(left, int) != isinstance(right, int):
            seq, n = (right, left) if isinstance(left, int) else (left, right)
            if isinstance(seq, (str, bytes, list, tuple)):  # (a float times an int is a number)
                _too_big(size_of(seq) * max(0, n), f"repeating a value {_num(n)} times would build one")
        elif operator == "**" and ints and right > 0 and abs(left) > 1:
            if right * (abs(left).bit_length() - 1) > MAX_INT_BITS:
                raise TemplateLimitError(f"{_num(left)} ** {_num(right)} has more than {MAX_INT_BITS} bits (the cap "
                                         f"on a template's numbers)")
            return self.checked(left ** right)  # (the bound above is within 2x for small bases)
        elif operator == "%" and isinstance(left, str):
            values = list(right.values()) if isinstance(right, dict) else list(right) if isinstance(
                right, tuple) else [right]
            _too_big(_format_size(left, values, "%"), "this %-format would build a value")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja2's own names)
        __self.tick()
        target = getattr(__obj, "__wrapped__", __obj)  # (str.format comes wrapped by the sandbox)
        name, subject = getattr(target, "__name__", ""), getattr(target, "__self__", None)
        if name == "join" and isinstance(subject, str) and args and not hasattr(args[0], "__len__"):
            args = (list(args[0]), *args[1:])  # ', '.join(items|map(...)): measured as a list
        if name not in ("ticking", "checked"):
            _check_call(name, subject, args, kwargs)
        return __self.checked(super().call(__context, __obj, *args, **kwargs))


def render_bounded(env: BoundedSandbox, template, context: dict) -> str:
    """The template rendered with `context`, its output measured at every chunk and the clock checked every
    TICK_ITEMS chunks (loops and calls check it too)."""
    env.start_clock()
    parts, size = [], 0
    for chunk in template.generate(**context):
        size += len(chunk)
        if size > MAX_RENDER_CHARS:
            _too_big(size, "an output")
        parts.append(chunk)
        if not len(parts) % TICK_ITEMS:
            env.tick()
    return "".join(parts)
