"""Walks of a prompt's nested values end: cycles, nesting past the cap and shared elements that unfold into more
values than memory holds are that prompt's error (a self-referencing dict hung SpecPipe.generate())."""
import json
import threading

from specpipe.workload.prompt_values import MAX_PROMPT_DEPTH, MAX_PROMPT_VALUES, nesting_problem
from specpipe.workload.prompts import parse_prompt_line, read_prompts_file


def within(seconds: float, fn):
    """fn()'s result, or a failure if it has not returned after `seconds` (a walk that loops forever)."""
    out = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(seconds)
    assert out, f"did not return within {seconds} s"
    return out[0]


def test_a_cycle_is_named_where_it_closes():
    d = {"prompt": "x"}
    d["metadata"] = d
    why = within(10, lambda: nesting_problem(d, "prompt 0"))
    assert why.startswith("prompt 0: field 'metadata' holds a value that contains it (a cycle)")
    loop = ["a"]
    loop.append([loop])
    assert within(10, lambda: nesting_problem(loop, "stop")).startswith("stop[1][0] holds a value that contains it")
    item = within(10, lambda: parse_prompt_line(d, "prompt 0"))
    assert item["error"].startswith("prompt 0: field 'metadata' holds") and "prompt_ids" not in item


def test_nesting_past_the_cap_is_named_and_a_shared_value_is_no_cycle():
    deep = ["x"]
    for _ in range(MAX_PROMPT_DEPTH):
        deep = [deep]
    why = nesting_problem({"prompt": "a", "meta": deep}, "prompt 2")
    assert why.startswith("prompt 2: field 'meta'[...][0][0] is nested too deeply to read (more than 100 levels deep")
    just = ["x"]
    for _ in range(MAX_PROMPT_DEPTH - 2):
        just = [just]
    assert nesting_problem({"meta": just}, "prompt 2") is None  # the dict, then 99 lists: 100 levels
    shared = [1, 2]
    assert nesting_problem({"prompt": "a", "x": shared, "y": [shared, shared]}, "prompt 0") is None


def test_shared_elements_that_unfold_past_the_cap_are_refused_without_unfolding_them():
    # 2**60 values once written out (each walk after this one would have unfolded them); the check takes 60 steps
    x = [1]
    for _ in range(60):
        x = [x, x]
    why = within(10, lambda: nesting_problem({"prompt": "a", "meta": x}, "prompt 1"))
    assert why.startswith(f"prompt 1 holds more than {MAX_PROMPT_VALUES} values")


def test_a_file_line_nested_past_the_cap_fails_alone(tmp_path):
    path = tmp_path / "p.jsonl"
    meta = "[" * (MAX_PROMPT_DEPTH + 5) + "]" * (MAX_PROMPT_DEPTH + 5)
    path.write_text('{"prompt": "a", "meta": ' + meta + "}\n" + json.dumps({"prompt": "b"}) + "\n")
    items = read_prompts_file(str(path))
    assert "is nested too deeply to read (more than 100 levels deep" in items[0]["error"]
    assert items[0]["error"].startswith("line 1: field 'meta'")
    assert items[0]["prompt"] == "" and items[1] == {"prompt": "b", "where": "line 2"}
