"""Chat templates compiled and rendered in a child process (`chat_worker`), within a time budget, a
memory limit and a bound on the output, while this process stays responsive to signals.

Why a process and not the sandbox alone: a template's single expression can allocate gigabytes in
one C call (no signal handler runs until it returns: the time budget and SIGTERM would wait), and
bounding each operation's result (Jinja's ``intercepted_binops``, wrapped filters and methods) would
still leave the total unbounded, since many small steps add up (chat_worker's docstring has the
figures). A memory limit on the rendering process bounds everything at once, and killing it ends
any render at once; what it costs per line is a pipe round trip (tens of microseconds), and one
process start (a fraction of a second, jinja2 alone) per process that renders.

One worker serves the process (threads take turns); it starts at the first compile or render and
again after a render it had to kill (past the budget, or a stop) or that killed it (a crash).
"""

from __future__ import annotations

import atexit
import os
import pickle
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from pagedinfer.chat_messages import plain_template_data, template_chat
from pagedinfer.chat_worker import (
    FRAME,
    MEMORY,
    READY,
    REASON_CHARS,
    TEXT,
    TOO_LONG,
    UNCOMPILABLE,
)

TEMPLATE_BUDGET_S = 5.0  # a compile or render that runs longer fails (its line)
MEMORY_LIMIT = 1 << 30  # bytes a compile or render may allocate beyond the request's own
START_S = 60.0  # for the worker to start (Python and jinja2), apart from the budget
POLL_S = 0.05  # how often `interrupt` is called while a render runs


class ChatRenderError(ValueError):
    """The template cannot render these messages (or cannot compile); the message is one line."""


class RenderedTooLong(ChatRenderError):
    """The rendered chat passes the characters it was allowed."""


class _Timeout(Exception):
    pass


def compile_error(template: str) -> str | None:
    """Why ``template`` does not compile as a chat template ("line 3: unexpected '}'"), or None."""
    request = ("compile", template, TEMPLATE_BUDGET_S, MEMORY_LIMIT)
    kind, text = _worker().ask(request, TEMPLATE_BUDGET_S, None)
    if kind == UNCOMPILABLE:
        return text
    if kind == MEMORY:
        return f"needs more than {MEMORY_LIMIT >> 20:,} MiB of memory to compile"
    if kind is None:
        return f"takes longer than {TEMPLATE_BUDGET_S:g} s to compile"
    return None


def render(
    template: str,
    messages: list,
    special_tokens: dict[str, str],
    max_chars: int,
    interrupt: Callable[[], None] | None = None,
) -> str:
    """``messages`` rendered with ``template``, the generation prompt added, exactly as the tokenizer's
    ``apply_chat_template(messages, add_generation_prompt=True, tokenize=False)`` renders them (its
    messages normalized as transformers' own helpers do, by `chat_messages`; its variables the
    tokenizer's special tokens).

    Raises `ChatRenderError` (one line) for a template that rejects the messages, does not compile,
    runs past `TEMPLATE_BUDGET_S` or needs more than `MEMORY_LIMIT`, and `RenderedTooLong` past
    ``max_chars`` characters. ``interrupt`` is called every `POLL_S` while the render runs: what it
    raises ends the render (the worker is killed) and propagates."""
    if isinstance(messages, (list, tuple)) and not messages:
        raise ChatRenderError(  # transformers' words
            "the chat template rejected the messages: Cannot apply chat template to an empty conversation. "
            "Provide at least one message."
        )
    try:  # what apply_chat_template and render_jinja_template do to the messages before rendering
        chat = template_chat(messages)
    except (TypeError, ValueError) as e:
        raise ChatRenderError(f"the chat template rejected the messages: {e}") from None
    variables = plain_template_data(dict(special_tokens))
    budget = TEMPLATE_BUDGET_S
    request = ("render", template, budget, MEMORY_LIMIT, chat, variables, max_chars)
    kind, text = _worker().ask(request, budget, interrupt, 4 * max_chars)
    if kind == TEXT:
        return text
    if kind is None:
        raise ChatRenderError(f"the chat template ran longer than {budget:g} s for these messages")
    if kind == TOO_LONG:
        raise RenderedTooLong(f"the rendered chat has more than {max_chars:,} characters")
    if kind == MEMORY:
        raise ChatRenderError(
            f"the chat template needs more than {MEMORY_LIMIT >> 20:,} MiB of memory for these messages"
        )
    if kind == UNCOMPILABLE:
        raise ChatRenderError(f"the chat template does not compile: {text}")
    raise ChatRenderError(f"the chat template rejected the messages: {text}")  # REJECTED


class _Worker:
    """The child process and its pipes; `ask` sends one request and reads its reply."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None

    def ask(
        self,
        request: tuple,
        budget_s: float,
        interrupt: Callable[[], None] | None,
        max_text: int = 4 * REASON_CHARS,
    ) -> tuple[bytes | None, str]:
        """The reply's kind and text, or ``(None, "")`` past ``budget_s`` (the worker is killed). A
        worker that ended (a crash) is `ChatRenderError`; whatever ``interrupt`` raises propagates."""
        body = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
        with self.lock:
            proc = self._started(interrupt)
            try:
                proc.stdin.write(FRAME.pack(len(body)) + body)
                proc.stdin.flush()
                reply = self._read(time.monotonic() + budget_s, max_text + 1, interrupt)
            except _Timeout:
                self.stop()
                return None, ""
            except BrokenPipeError:
                reply = None
            except BaseException:
                self.stop()  # a reply may still come: the next request must not read it
                raise
            if reply is None:
                code = self.stop()
                how = f"by signal {-code}" if code is not None and code < 0 else f"with exit code {code}"
                raise ChatRenderError(f"the chat template's process ended {how} while rendering")
            return reply[:1], reply[1:].decode("utf-8", "surrogatepass")

    def _started(self, interrupt: Callable[[], None] | None) -> subprocess.Popen:
        if self.proc is not None and self.proc.poll() is None:
            return self.proc
        self.stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pagedinfer.chat_worker"],
            cwd=Path(__file__).resolve().parent.parent,  # this pagedinfer first on the worker's path
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # the terminal's signals are this process's to answer
        )
        try:
            ready = self._read(time.monotonic() + START_S, len(READY), interrupt)
        except BaseException:
            self.stop()
            raise
        if ready != READY:
            code = self.stop()
            raise ChatRenderError(
                f"the chat template's process ({sys.executable} -m pagedinfer.chat_worker) did not "
                f"start (exit code {code})"
            )
        return self.proc

    def _read(self, deadline: float, most: int, interrupt: Callable[[], None] | None) -> bytes | None:
        """One frame's body (None at the end of the stream, or one longer than ``most`` bytes)."""
        header = self._read_exactly(FRAME.size, deadline, interrupt)
        if header is None or FRAME.unpack(header)[0] > most:
            return None
        return self._read_exactly(FRAME.unpack(header)[0], deadline, interrupt)

    def _read_exactly(self, n: int, deadline: float, interrupt: Callable[[], None] | None) -> bytes | None:
        fd, chunks, got = self.proc.stdout.fileno(), [], 0
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Timeout
            readable, _, _ = select.select([fd], [], [], min(left, POLL_S))
            if interrupt is not None:
                interrupt()
            if not readable:
                continue
            chunk = os.read(fd, min(n - got, 1 << 20))
            if not chunk:
                return None
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def stop(self) -> int | None:
        """Kill the worker (if any) and reap it; its exit code."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.kill()
        for pipe in (proc.stdin, proc.stdout):
            pipe.close()
        return proc.wait()


_workers: dict[int, _Worker] = {}  # by process id: a forked child starts its own
_workers_lock = threading.Lock()


def _worker() -> _Worker:
    with _workers_lock:
        worker = _workers.get(os.getpid())
        if worker is None:
            worker = _workers[os.getpid()] = _Worker()
            atexit.register(worker.stop)
        return worker
