"""A model folder's chat template renders in a sandbox that caps what it builds and how long it runs:
`{{ 'x' * 1000000000 }}` took 42 s and 4.4 GB and wrote its 1 GB output into completions.jsonl. A template over
a cap fails only its request, with a message naming the cap."""
import time

import pytest

from specpipe.decode.requests import make_requests
from specpipe.workload import template_sandbox
from specpipe.workload.chat_template import ChatTemplate, ChatTemplateError
from specpipe.workload.tokenizer import ByteTokenizer

CHAT = [{"role": "user", "content": "hi"}]
CAP = f"more than {template_sandbox.MAX_RENDER_CHARS} characters"


def render(source: str, messages=CHAT) -> str:
    return ChatTemplate(source).render(messages)


@pytest.mark.parametrize("source", [
    "{{ 'x' * 20000000 }}",  # (the 1 GB of the issue in small: past the cap, fast to build on any machine)
    "{{ 'x' * 1000000000 }}",
    "{% set s = 'x' * 1000000 %}{{ [s] * 100 }}",  # 100 MB once printed, though the list itself is small
    "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ 1 }}",
    "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ 1 }}",
    "{{ 'x'|center(100000000) }}",
    "{{ '%100000000s' % 'x' }}",
    "{{ '{:>100000000}'.format('x') }}",
    "{{ ('x' * 1000)|replace('', 'y' * 100000) }}",
    "{{ range(100000)|map('string')|join('y' * 1000) }}",
    "{% for i in range(100000) %}{{ 'x' * 200 }}{% endfor %}",  # each value small, the output 20 MB
], ids=["str", "str-1e9", "shared-list", "concat", "plus", "center", "percent", "format", "replace", "join",
        "output"])
def test_what_a_template_builds_is_capped(source):
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match=CAP) as e:
        render(source)
    assert "went past a limit on these messages" in str(e.value) and time.monotonic() - start < 10


def test_numbers_are_capped_too():
    for source in ("{{ 2 ** 10000000 }}",
                   "{% set ns = namespace(x=3) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}{% endfor %}"):
        with pytest.raises(ChatTemplateError, match=f"more than {template_sandbox.MAX_INT_BITS} bits"):
            render(source)


def test_a_render_past_its_time_budget_stops(monkeypatch):
    monkeypatch.setattr(template_sandbox, "MAX_RENDER_SECONDS", 0.3)
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match=r"it ran longer than 0.3 s \(the cap on one render\)"):
        render("{% for a in range(5000) %}{% for b in range(5000) %}{% endfor %}{% endfor %}")
    assert time.monotonic() - start < 5


def test_what_real_templates_do_still_renders():
    source = ("{% for m in messages %}{{ '<|' + m.role + '|>' + m.content|trim }}{{ '-' * 3 }}{% endfor %}"
              "{{ messages|tojson(indent=2) }}|{{ [1, 2]|join(', ') }}|{{ 'a-b'|replace('-', '+') }}|"
              "{{ ', '.join(['x', 'y']) }}|{{ '%s!' % 'hey' }}|{{ '{}?'.format('ok') }}|{{ ([1] + [2])|length }}|"
              "{{ 2 ** 10 }}|{{ 'ab'|center(6) }}|{{ 1.5 * 100000000000 }}")
    assert render(source) == ('<|user|>hi---[\n  {\n    "role": "user",\n    "content": "hi"\n  }\n]|1, 2|a+b|x, y|'
                              'hey!|ok?|2|1024|  ab  |150000000000.0')


def test_a_template_over_a_cap_fails_only_its_request_and_echoes_nothing_big():
    tok = ByteTokenizer()
    tok.chat_template = ChatTemplate("{% if messages[0].content == 'boom' %}{{ 'x' * 20000000 }}{% endif %}"
                                     "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    items = [{"messages": CHAT}, {"messages": [{"role": "user", "content": "boom"}]}, {"prompt": "plain"}]
    reqs = make_requests(items, tok, 4, 4096, tok.vocab_size)
    assert [r.finish_reason for r in reqs] == [None, "error", None]
    assert CAP in reqs[1].error and reqs[1].prompt == "" and reqs[0].prompt == "user: hi\n"


def test_a_huge_message_from_a_template_is_cut_in_its_error():
    with pytest.raises(ChatTemplateError) as e:
        render("{{ raise_exception('y' * 100000) }}")
    assert len(str(e.value)) < 1000 and str(e.value).endswith("... (100000 characters)")
