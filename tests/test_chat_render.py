"""Chat templates rendered in their own process (pagedinfer/chat_render.py): byte-identical to the
tokenizer's apply_chat_template for real templates, and bounded in memory, time and output for
hostile ones, with the worker recovering from every failure."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
from cli_helpers import CHAT_TEMPLATE, tiny_model

from pagedinfer import chat_render

DEMO = Path(__file__).resolve().parent.parent / "pagedinfer" / "demo_model"

# ChatML as Qwen3 writes it: a default system turn, namespace bookkeeping over the reversed messages,
# the reasoning of the turns after the last user query, tojson, loop controls
QWEN_STYLE = """{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- if messages[0].role != 'system' %}
<|im_start|>system
You are a helpful assistant.<|im_end|>
{% endif %}
{%- for message in messages %}
    {%- if message.role == "system" or message.role == "user" %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and reasoning_content %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' }}
        {%- endif %}
        {% generation %}{{ message.content }}{% endgeneration %}<|im_end|>
    {%- endif %}
    {%- if message.meta is defined %}{{ message.meta | tojson(indent=2, sort_keys=True) }}{% endif %}
    {%- if loop.index > 20 %}{% break %}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Llama 3.1's shape: bos, a dated system header, roles checked with raise_exception, trimmed turns
LLAMA3_STYLE = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message.role not in ['user', 'assistant'] %}
        {{- raise_exception('Conversation roles must be user or assistant, not ' + message.role) }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# a template written without the dash controls: trim_blocks and lstrip_blocks decide its whitespace
PLAIN_BLOCKS = """{% for m in messages %}
    {% if m.content is string %}
[{{ m.role }}] {{ m.content }}
    {% else %}
        {% for part in m.content %}
[{{ m.role }}:{{ loop.index }}] {{ part.text }}
        {% endfor %}
    {% endif %}
{% endfor %}
{% set d = dict(a=1, b=[2, 3]) %}{{ d | tojson }} {{ d | tojson(separators=(',', ':')) }}
{% if add_generation_prompt %}[assistant] {% endif %}"""

CHAT = [
    {"role": "system", "content": "  Be brief.  "},
    {"role": "user", "content": "Who art thou? é ✓ 😀"},
    {"role": "assistant", "content": "A ghost.", "reasoning": "\nThink of Hamlet.\n", "name": None},
    {"role": "user", "content": "And then?", "meta": {"z": [1, 2.5, None], "a": "<tag>"}},
]
PARTS = [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model())


def _render(tok, template: str, messages: list, max_chars: int = 10**6) -> str:
    return chat_render.render(template, messages, tok.special_tokens_map, max_chars)


@pytest.mark.parametrize(
    ("template", "messages"),
    [
        (CHAT_TEMPLATE, CHAT[1:]),
        ((DEMO / "chat_template.jinja").read_text(encoding="utf-8"), CHAT),
        (QWEN_STYLE, CHAT),
        (QWEN_STYLE, CHAT[1:]),
        (LLAMA3_STYLE, CHAT),
        (PLAIN_BLOCKS, CHAT + PARTS),
    ],
    ids=["tiny", "demo", "qwen-system", "qwen-default-system", "llama3", "plain-blocks"],
)
def test_the_text_is_byte_identical_to_apply_chat_template(tokenizer, template, messages):
    expected = tokenizer.apply_chat_template(
        messages, chat_template=template, add_generation_prompt=True, tokenize=False
    )
    assert _render(tokenizer, template, messages) == expected
    assert len(expected) > 40  # each renders the conversation, not an empty string


def test_the_environment_is_transformers_own():
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from transformers.utils.chat_template_utils import _compile_jinja_template

    from pagedinfer.chat_worker import environment

    theirs, ours = _compile_jinja_template("{{ x }}").environment, environment()
    assert type(theirs) is type(ours) is ImmutableSandboxedEnvironment
    assert set(ours.globals) == set(theirs.globals)
    assert set(ours.filters) == set(theirs.filters) and set(ours.tests) == set(theirs.tests)
    assert {e.tags and frozenset(e.tags) for e in ours.extensions.values()} == {
        e.tags and frozenset(e.tags) for e in theirs.extensions.values()
    }
    for option in ("trim_blocks", "lstrip_blocks", "autoescape", "keep_trailing_newline", "newline_sequence"):
        assert getattr(ours, option) == getattr(theirs, option), option


def test_a_template_error_is_transformers_message(tokenizer):
    with pytest.raises(Exception) as theirs:
        tokenizer.apply_chat_template(
            [{"role": "tool", "content": "x"}],
            chat_template=LLAMA3_STYLE,
            add_generation_prompt=True,
            tokenize=False,
        )
    with pytest.raises(chat_render.ChatRenderError) as ours:
        _render(tokenizer, LLAMA3_STYLE, [{"role": "tool", "content": "x"}])
    assert str(theirs.value) == "Conversation roles must be user or assistant, not tool"
    assert str(ours.value) == f"the chat template rejected the messages: {theirs.value}"


HOSTILE = {
    # one allocation of 10 GB, folded at compile time by Jinja (transformers' environment folds it)
    "constant": "{{ 'a' * 10000000000 }}",
    "set-then-repeat": "{% set x = 'a' * 100000 %}{{ x * 100000 }}",
    "filter-width": "{{ 'a' | center(10000000000) }}",
    "format-width": "{{ '%10000000000d' | format(1) }}",
    "method-width": "{{ 'a'.ljust(10000000000) }}",
    "to-bytes": "{{ (1).to_bytes(10000000000, 'big') | length }}",
    "tojson-indent": "{{ [[[1]]] | tojson(indent=10000000000) }}",
    # many steps of 1 MiB each, none large alone
    "many-small": "{% set x = range(100000) | map('string') | map('center', 1048576) | list %}{{ x | length }}",
    # doubling with ~, which no binary-operator hook sees
    "doubling": "{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    # a block that captures a loop's output, then joins it at once
    "captured": "{% set big = 'a' * 1000000 %}{% set x %}{% for i in range(100000) %}{{ big }}{% endfor %}{% endset %}",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_no_expression_can_allocate_past_the_memory_limit(tokenizer, monkeypatch, name):
    monkeypatch.setattr(chat_render, "MEMORY_LIMIT", 64 << 20)
    monkeypatch.setattr(chat_render, "TEMPLATE_BUDGET_S", 60)  # the memory limit ends each, not the clock
    start = time.monotonic()
    with pytest.raises(chat_render.ChatRenderError) as e:
        _render(tokenizer, HOSTILE[name] + CHAT_TEMPLATE, CHAT[1:])
    assert str(e.value) == "the chat template needs more than 64 MiB of memory for these messages"
    assert time.monotonic() - start < 30
    assert _render(tokenizer, CHAT_TEMPLATE, CHAT[1:]).startswith("<|bos|><|user|>")  # the worker serves on


def test_a_template_that_compiles_to_a_huge_constant_is_not_refused_before_its_lines():
    """Jinja folds ``'a' * 10**10`` while compiling: in the worker the allocation fails, the fold is
    dropped, and each line fails alone (a template compiled in this process would have allocated)."""
    assert chat_render.compile_error(HOSTILE["constant"]) is None
    assert chat_render.compile_error("{{ x | nosuch }}") == "line 1: No filter named 'nosuch'."
    assert chat_render.compile_error("{% for m in messages %}") == (
        "line 1: Unexpected end of template. Jinja was looking for the following tags: 'endfor' or "
        "'else'. The innermost block that needs to be closed is 'for'."
    )


def test_the_output_is_cut_past_max_chars(tokenizer):
    template = "{% for i in range(100000) %}{% for j in range(100000) %}{{ messages[0].content }}{% endfor %}{% endfor %}"
    start = time.monotonic()
    with pytest.raises(
        chat_render.RenderedTooLong, match=r"^the rendered chat has more than 1,000 characters$"
    ):
        _render(tokenizer, template, CHAT[1:], max_chars=1000)
    assert time.monotonic() - start < 2
    exact = _render(tokenizer, CHAT_TEMPLATE, CHAT[1:])
    assert _render(tokenizer, CHAT_TEMPLATE, CHAT[1:], max_chars=len(exact)) == exact


LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def test_one_long_c_call_ends_at_the_budget(tokenizer, monkeypatch):
    """A power of 10**10 digits is one C call that would run for hours: the worker is killed."""
    monkeypatch.setattr(chat_render, "TEMPLATE_BUDGET_S", 1)
    start = time.monotonic()
    with pytest.raises(
        chat_render.ChatRenderError, match=r"^the chat template ran longer than 1 s for these messages$"
    ):
        _render(tokenizer, "{{ 10 ** 10000000000 }}", CHAT[1:])
    assert time.monotonic() - start < 5


def test_a_render_past_the_budget_fails_from_any_thread(tokenizer, monkeypatch):
    monkeypatch.setattr(chat_render, "TEMPLATE_BUDGET_S", 0.5)
    caught: list[BaseException] = []

    def worker() -> None:
        try:
            _render(tokenizer, LOOP, CHAT[1:])
        except chat_render.ChatRenderError as e:
            caught.append(e)

    start = time.monotonic()
    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive() and time.monotonic() - start < 10
    assert [str(e) for e in caught] == ["the chat template ran longer than 0.5 s for these messages"]
    assert _render(tokenizer, CHAT_TEMPLATE, CHAT[1:]).startswith("<|bos|>")


def test_an_interrupt_ends_a_render_at_once_and_the_next_one_runs(tokenizer, monkeypatch):
    monkeypatch.setattr(chat_render, "TEMPLATE_BUDGET_S", 60)
    _render(tokenizer, CHAT_TEMPLATE, CHAT[1:])  # the worker is up
    deadline = time.monotonic() + 0.5

    class Stop(BaseException):
        pass

    def interrupt() -> None:
        if time.monotonic() > deadline:
            raise Stop

    start = time.monotonic()
    with pytest.raises(Stop):
        chat_render.render(LOOP, CHAT[1:], tokenizer.special_tokens_map, 10**6, interrupt)
    assert time.monotonic() - start < 2
    assert _render(tokenizer, CHAT_TEMPLATE, CHAT[1:]).startswith("<|bos|>")


def test_a_worker_that_dies_fails_its_render_and_is_started_again(tokenizer):
    _render(tokenizer, CHAT_TEMPLATE, CHAT[1:])
    pid = chat_render._worker().proc.pid
    threading.Timer(0.3, os.kill, (pid, signal.SIGKILL)).start()
    with pytest.raises(chat_render.ChatRenderError, match=r"^the chat template's process ended by signal 9"):
        _render(tokenizer, LOOP, CHAT[1:])
    assert _render(tokenizer, CHAT_TEMPLATE, CHAT[1:]).startswith("<|bos|>")
    assert chat_render._worker().proc.pid != pid
