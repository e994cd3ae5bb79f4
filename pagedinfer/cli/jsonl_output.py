"""The output file: locked for the run, one line per finished request at once, input order at the end.

`OutputFile` holds an exclusive advisory lock (``flock``) on the output for the whole run, so a
second run on the same file fails at once instead of truncating the first one's work. Every record
is one ``write`` of one full line, issued as soon as its request finishes, whatever the lines
before it; `sync` (once per engine step, before the next one runs) makes the step's lines durable
with ``fsync``. A crash or ``kill -9`` therefore loses only the lines still being generated (a
power cut, also those written since the last step). A failed write (disk full, EIO) is cut back
to the last full line and raised as `OutputWriteError`. When the run completes, `reorder` puts the
file in input order (atomically: a temporary file renamed over it). ``--resume`` (`load_done`)
accepts the lines in any order, cuts a torn last line, and drops unreadable lines so they run again.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import json
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from pagedinfer.cli.jsonl_input import line_key

_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


class OutputError(Exception):
    """The output path is unusable or taken; the message is one line."""


class OutputWriteError(Exception):
    """Writing the output failed mid-run (disk full, I/O error); the message is one line."""


def default_output_path(input_path: Path) -> Path:
    """``prompts.jsonl`` -> ``prompts.out.jsonl`` next to the input."""
    name = input_path.name
    stem = name[: -len(".jsonl")] if name.endswith(".jsonl") else name
    return input_path.with_name(f"{stem}.out.jsonl")


def record_key(record: object) -> str | None:
    """The key (`jsonl_input.line_key`) of the input line this output record answers."""
    if not isinstance(record, dict):
        return None
    if record.get("custom_id") is not None:
        return line_key(record["custom_id"], None, None)
    if "id" in record:
        return line_key(None, record["id"], record.get("line"))
    return None


def _key_of(line: bytes) -> str | None:
    if not line.strip():
        return None
    try:
        return record_key(json.loads(line.decode("utf-8")))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None


class OutputFile:
    """The output of one run, opened and locked (nothing is truncated until `start`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.written = 0  # records written by this run (each a full line in the file)
        self._unsynced = False
        try:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise OutputError(f"cannot write output file {path}: {e.strerror or e}") from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._fd)
            raise OutputError(
                f"output file {path} is locked by another pagedinfer run; wait for it to finish or use another -o"
            ) from None
        self._size = os.fstat(self._fd).st_size

    def load_done(self) -> tuple[set[str], int]:
        """For --resume: the keys already answered, and how many unreadable lines were dropped.

        Records may be in any order. A torn or unreadable line (a crash mid-write, a corrupted
        block) is removed from the file, atomically, so that its input line runs again.
        """
        keys: set[str] = set()
        dropped, rewrite = 0, False
        with open(self._fd, "rb", closefd=False) as f:
            f.seek(0)
            for raw in f:
                key = _key_of(raw)
                if key is None:
                    dropped += raw.strip() != b""
                    rewrite = True
                    continue
                keys.add(key)
                rewrite |= not raw.endswith(b"\n")  # a complete last record without its newline
        if rewrite:
            self._rewrite(lambda raw: _key_of(raw) is not None)
        return keys, dropped

    def start(self, truncate: bool) -> None:
        """Begin writing: truncated for a fresh run, appended to for --resume."""
        if truncate:
            os.ftruncate(self._fd, 0)
            self._size = 0

    def write(self, record: dict, position: int | None = None) -> None:
        """One record as one full line, written now (durable at the next `sync`); any ``position``."""
        data = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        with _signals_held():  # `written` always counts exactly the lines in the file
            try:
                done = os.write(self._fd, data)  # O_APPEND: the whole line goes to the end
                while done < len(data):  # only on a full disk or an interrupted write
                    done += os.write(self._fd, data[done:])
            except OSError as e:
                with contextlib.suppress(OSError):
                    os.ftruncate(self._fd, self._size)  # no torn line left behind
                raise OutputWriteError(f"cannot write output file {self.path}: {e.strerror or e}") from None
            self._size += len(data)
            self.written += 1
            self._unsynced = True

    def sync(self) -> None:
        if self._unsynced:
            try:
                os.fsync(self._fd)
            except OSError as e:
                raise OutputWriteError(f"cannot write output file {self.path}: {e.strerror or e}") from None
            self._unsynced = False

    def reorder(self, rank: Callable[[str | None], int | None]) -> bool:
        """Rewrite the file in input order (``rank`` of each record's key), if it is not already.

        Keeps only line offsets in memory. Records with no rank keep their order at the end.
        Raises OutputWriteError (the file is then left as it was: every line still there).
        """
        offsets, ranks = array.array("q"), array.array("q")
        ordered, last = True, -1
        with open(self._fd, "rb", closefd=False) as f:
            f.seek(0)
            pos = 0
            for raw in f:
                r = rank(_key_of(raw))
                r = (1 << 62) + len(ranks) if r is None else r
                offsets.append(pos)
                ranks.append(r)
                ordered &= r >= last
                last = r
                pos += len(raw)
        if ordered:
            return False
        order = sorted(range(len(ranks)), key=ranks.__getitem__)
        with open(self._fd, "rb", closefd=False) as src:

            def lines():
                for i in order:
                    src.seek(offsets[i])
                    yield src.readline()

            self._replace(lines())
        return True

    def _rewrite(self, keep: Callable[[bytes], bool]) -> None:
        with open(self._fd, "rb", closefd=False) as src:
            src.seek(0)
            self._replace(raw if raw.endswith(b"\n") else raw + b"\n" for raw in src if keep(raw))

    def _replace(self, lines) -> None:
        """Write ``lines`` to a temporary file and rename it over the output; keep the lock on it."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            with open(tmp, "wb") as f:
                for raw in lines:
                    f.write(raw)
                f.flush()
                os.fsync(f.fileno())
            fd = os.open(tmp, os.O_RDWR | os.O_APPEND | os.O_CLOEXEC)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # new inode: no other run can hold it yet
            os.replace(tmp, self.path)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise OutputWriteError(f"cannot rewrite output file {self.path}: {e.strerror or e}") from None
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        os.close(self._fd)
        self._fd = fd
        self._size = os.fstat(fd).st_size
        with contextlib.suppress(OSError):  # make the rename itself durable where the OS allows
            dir_fd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                self.sync()
            os.close(self._fd)
            self._fd = None


class StdoutOutput:
    """``-o -``: records in input order on stdout; one that finishes early waits for the lines before it."""

    written = 0

    def __init__(self) -> None:
        self.next = 0  # the first position without a written record
        self.held: dict[int, dict] = {}

    def write(self, record: dict, position: int) -> None:
        self.held[position] = record
        while self.next in self.held:
            self._emit(self.held.pop(self.next))
            self.next += 1

    def sync(self) -> None:
        """Nothing to do: each record is flushed as it is printed."""

    def flush_held(self) -> None:
        """After an interruption: print the records still waiting on an earlier line (out of order)."""
        for position in sorted(self.held):
            self._emit(self.held.pop(position))

    def _emit(self, record: dict) -> None:
        sys.stdout.write(json.dumps(record, ensure_ascii=False) + "\n")
        sys.stdout.flush()
        self.written += 1


@contextlib.contextmanager
def _signals_held():
    """Delay SIGINT/SIGTERM/SIGHUP across a write (main thread only), so a stop never splits it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
