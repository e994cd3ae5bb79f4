"""The process that compiles and renders chat templates (``python -m pagedinfer.chat_worker``, started
and spoken to by `chat_render`).

A chat template is code from a model's files or from the user. Jinja's sandbox keeps it from Python's
internals, not from allocating: ``{{ 'a' * 10**10 }}`` is one C-level allocation (folded at compile
time, so on every line) that no signal interrupts, and a pipeline of small steps (``range(10000) |
map('string') | map('center', 65536) | list``) builds 650 MB in 4.5 s with no single large value, so
bounding each value's size would not bound the total. Here each compile and render runs under a
limit on the process's address space (RLIMIT_AS: the request's ``memory`` beyond what the request
itself holds) and on its CPU time (RLIMIT_CPU, should the parent be gone), and its output is cut
past the request's ``max_chars``; the parent keeps the time budget (it kills this process) and stays
responsive to signals meanwhile.

The environment is transformers' (``_compile_jinja_template``: an ImmutableSandboxedEnvironment with
trim_blocks and lstrip_blocks, loopcontrols, the ``{% generation %}`` block, ``tojson`` with its
options, ``raise_exception``, ``strftime_now``, and its guarded ``dict`` and ``namespace``), so the
text is byte-identical to ``apply_chat_template``'s (tests/test_chat_render.py compares them).

Frames both ways: an 8-byte little-endian length, then the body. A request is a pickle from the
parent (trusted here); a reply is one kind byte (`TEXT`, `REJECTED`, `UNCOMPILABLE`, `MEMORY`,
`TOO_LONG`) and UTF-8 text, all the parent reads from this process (it trusts nothing from here).
"""

from __future__ import annotations

import json
import math
import os
import pickle
import resource
import signal
import struct
import sys
from datetime import datetime
from functools import lru_cache
from typing import BinaryIO

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

FRAME = struct.Struct("<Q")
TEXT, REJECTED, UNCOMPILABLE, MEMORY, TOO_LONG, READY = b"T", b"E", b"C", b"M", b"L", b"R"
REASON_CHARS = 500  # of an error's first line (a template's raise_exception can pass any text)


class Generation(jinja2.ext.Extension):
    """transformers' ``{% generation %}...{% endgeneration %}`` (it marks the assistant's tokens when
    asked for a mask, never here): a call block whose body renders in place, as there."""

    tags = {"generation"}

    def parse(self, parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_generation_support"), [], [], body).set_lineno(lineno)

    @jinja2.pass_eval_context
    def _generation_support(self, context, caller) -> str:
        return caller()


class TemplateDict:
    """transformers' ``dict`` global: a callable without the attributes a template could misuse."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class TemplateNamespace(jinja2.utils.Namespace):
    """transformers' ``namespace`` global: no underscore-prefixed attribute can be stored."""

    def __init__(*args, **kwargs):  # Jinja's own signature trick, so that namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                "Please rename the attribute."
            )


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


def environment() -> ImmutableSandboxedEnvironment:
    """The environment transformers compiles chat templates in."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env


@lru_cache(maxsize=8)
def _compiled(text: str) -> jinja2.Template | str:
    """The template, or why it does not compile ("line 3: unexpected '}'"): both kept, so a template
    that cannot compile costs one compile however many lines use it."""
    try:
        return environment().from_string(text)
    except jinja2.TemplateSyntaxError as e:  # TemplateAssertionError too: an unknown filter or test
        return f"line {e.lineno}: {e.message}"[:REASON_CHARS]


_GIVEN = {  # the limits this process started with: each compile and render is bounded within them
    which: resource.getrlimit(which) for which in (resource.RLIMIT_AS, resource.RLIMIT_CPU)
}


def _limit(budget_s: float, memory: int) -> None:
    """Bound what the next compile and render may take: ``memory`` more bytes of address space than the
    process holds now (with the request read), and CPU time past the budget (the parent kills this
    process at the budget; this holds should the parent be gone). Limits set on this process before
    (``ulimit``) still hold where lower."""
    with open("/proc/self/statm", encoding="ascii") as f:
        size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    used = resource.getrusage(resource.RUSAGE_SELF)
    cpu = math.ceil(used.ru_utime + used.ru_stime + budget_s) + 2
    for which, value in ((resource.RLIMIT_AS, size + memory), (resource.RLIMIT_CPU, cpu)):
        soft, hard = _GIVEN[which]
        resource.setrlimit(which, (value if soft == resource.RLIM_INFINITY else min(value, soft), hard))


def _unlimit() -> None:
    for which, given in _GIVEN.items():
        resource.setrlimit(which, given)


def serve(request: tuple) -> bytes:
    """One reply. ``("compile", text, budget_s, memory)`` -> `TEXT` when it compiles; ``("render",
    text, budget_s, memory, messages, variables, max_chars)`` -> `TEXT` and the rendered chat
    (generation prompt added), or `TOO_LONG` once it passes ``max_chars`` characters."""
    op, text, budget_s, memory, *rest = request
    _limit(budget_s, memory)
    try:
        template = _compiled(text)
        if isinstance(template, str):
            return UNCOMPILABLE + template.encode("utf-8", "surrogatepass")
        if op == "compile":
            return TEXT
        messages, variables, max_chars = rest
        pieces, chars = [], 0
        for piece in template.generate(
            messages=messages, tools=None, documents=None, add_generation_prompt=True, **variables
        ):
            chars += len(piece)
            if chars > max_chars:
                return TOO_LONG
            pieces.append(piece)
        return TEXT + "".join(pieces).encode("utf-8", "surrogatepass")
    except MemoryError:
        return MEMORY
    except Exception as e:  # noqa: BLE001 - whatever the template raises is the messages' rejection
        lines = str(e).strip().splitlines()
        reason = (lines[0] if lines else "") or repr(e)
        return REJECTED + reason[:REASON_CHARS].encode("utf-8", "surrogatepass")
    finally:
        _unlimit()


def read_frame(stream: BinaryIO) -> bytes | None:
    """The next frame's body, or None at the end of the stream."""
    header = stream.read(FRAME.size)
    if len(header) < FRAME.size:
        return None
    return stream.read(FRAME.unpack(header)[0])


def write_frame(stream: BinaryIO, body: bytes) -> None:
    stream.write(FRAME.pack(len(body)) + body)
    stream.flush()


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C at the terminal is the parent's to answer
    requests, replies = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing printed by accident can enter the protocol
    write_frame(replies, READY)
    while (request := read_frame(requests)) is not None:
        try:
            reply = serve(pickle.loads(request))
        except MemoryError:  # the reply itself (the text is within max_chars, the limit is lifted)
            reply = MEMORY
        write_frame(replies, reply)


if __name__ == "__main__":
    main()
