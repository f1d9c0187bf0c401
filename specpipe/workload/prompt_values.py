"""Walks of a prompt's nested values (an API dict, a prompts file's parsed line) that always end.

A prompt from the Python API is a live Python object: a dict that holds itself (`d["metadata"] = d`) made every
later walk of it loop forever, and one whose lists share their elements (`x = [x, x]` forty times) unfolds into
more values than memory holds once written as JSON. `nesting_problem` is the first walk: it names a cycle, a
nesting past MAX_PROMPT_DEPTH or more than MAX_PROMPT_VALUES values (shared ones counted each time they are
reached), so that every walk after it (huge ints, Unicode checks, the chat template, JSON for completions.jsonl)
meets a finite tree of bounded depth.
"""
from __future__ import annotations

import numbers
from typing import Any, Optional

MAX_PROMPT_DEPTH = 100  # nested dicts / lists; a chat with content parts is 5 deep, a tool's JSON schema ~20
MAX_PROMPT_VALUES = 16 * 2 ** 20  # values in one prompt, shared ones counted at each place: a 16 MiB line holds fewer
HUGE_INT = 10 ** 30  # beyond every valid id, seed, count or limit; such values are not printed (4300-digit limit)

_CONTAINERS = (dict, list, tuple)


def _items(x):
    return x.items() if isinstance(x, dict) else enumerate(x)


def _path(where: str, keys: list) -> str:
    """`where` and the keys down to a value, as huge_int says them: prompt 3: field 'a'['b'][2] (a long path
    shortened to its first and last keys)."""
    if not keys:
        return where
    head, rest = keys[0], keys[1:]
    out = f"{where}: field {head!r}" if isinstance(head, str) else f"{where}[{head}]"
    inner = "".join(f"[{k!r}]" if isinstance(k, str) else f"[{k}]" for k in rest[-2:])
    return out + ("[...]" if len(rest) > 2 else "") + inner


def nesting_problem(value: Any, where: str) -> Optional[str]:
    """Why `value` cannot be walked to its end (a cycle, nested past MAX_PROMPT_DEPTH, or more than
    MAX_PROMPT_VALUES values once shared elements are counted where they appear), said from `where` ("prompt 3",
    "line 7", "stop"); None when every walk of it ends. Iterative: a nesting that deep never reaches Python's
    recursion limit here. A container reached again (shared, not a cycle) is not walked again: its height and
    size are remembered, so `x = [x, x]` forty times costs forty steps, not 2**40."""
    if not isinstance(value, _CONTAINERS):
        return None
    known: dict[int, tuple[int, int]] = {}  # id -> (height, values) of a container walked whole
    on_path = {id(value)}
    # [container, its (key, child) iterator, height so far, values so far, its key in its parent]
    stack: list[list] = [[value, iter(_items(value)), 1, 1, None]]

    def at(key) -> str:
        return _path(where, [e[4] for e in stack[1:]] + [key])

    while stack:
        top = stack[-1]
        for key, child in top[1]:
            if not isinstance(child, _CONTAINERS):
                top[3] += 1
                continue
            if id(child) in on_path:
                return (f"{at(key)} holds a value that contains it (a cycle), so it has no end to read; a prompt's "
                        f"values must be plain data (strings, numbers, lists and dicts without cycles)")
            height, size = known.get(id(child), (0, 0))
            if len(stack) + max(height, 1) > MAX_PROMPT_DEPTH:
                return (f"{at(key)} is nested too deeply to read (more than {MAX_PROMPT_DEPTH} levels deep, the cap "
                        f"on a prompt's nesting); flatten it")
            if height:  # shared with an earlier place: counted again, not walked again
                top[2], top[3] = max(top[2], height + 1), top[3] + size
                if top[3] > MAX_PROMPT_VALUES:
                    break
                continue
            on_path.add(id(child))
            stack.append([child, iter(_items(child)), 1, 1, key])
            break
        else:
            stack.pop()
            on_path.discard(id(top[0]))
            known[id(top[0])] = (top[2], top[3])
            if stack:
                stack[-1][2], stack[-1][3] = max(stack[-1][2], top[2] + 1), stack[-1][3] + top[3]
                top = stack[-1]
        if top[3] > MAX_PROMPT_VALUES:
            return (f"{where} holds more than {MAX_PROMPT_VALUES} values (the cap on one prompt; lists that share "
                    f"elements count them at each place, as JSON would write them)")
    return None


def huge_int(v: Any, where: str) -> Optional[str]:
    """The first place in `v` (a value, or lists / dicts of them) holding an integer beyond HUGE_INT, said with its
    size (printing it raises ValueError past 4300 digits), or None. `v` has passed `nesting_problem`."""
    todo = [(v, where)]
    while todo:
        x, at = todo.pop()
        if isinstance(x, numbers.Integral) and not isinstance(x, bool) and abs(int(x)) > HUGE_INT:
            return f"{at} is an integer of about {int(abs(int(x)).bit_length() * 0.30103) + 1} digits"
        if isinstance(x, dict):
            todo.extend((val, f"{at}: field {k!r}" if at.startswith("prompt ") and ":" not in at else f"{at}[{k!r}]")
                        for k, val in reversed(list(x.items())))
        elif isinstance(x, (list, tuple)):
            todo.extend((val, f"{at}[{i}]") for i, val in reversed(list(enumerate(x))))
    return None
