"""Crash-safe, input-ordered JSONL output, and what ``--resume`` reads back.

Every record is written as one full line with a single ``write`` followed by flush + fsync, so a
crash can at worst leave the *last* line torn; ``--resume`` truncates such a line and never
touches the lines before it. `OrderedWriter` writes a record as soon as every earlier line has its
record, so finished work reaches the disk during the run, in input order.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path


class OutputError(Exception):
    """The output path is unusable; the message is one line."""


def default_output_path(input_path: Path) -> Path:
    """``prompts.jsonl`` -> ``prompts.out.jsonl`` next to the input."""
    name = input_path.name
    stem = name[: -len(".jsonl")] if name.endswith(".jsonl") else name
    return input_path.with_name(f"{stem}.out.jsonl")


def record_key(record: dict) -> str | None:
    """The identity `jsonl_input.line_key` gives the input line this record answers."""
    if not isinstance(record, dict):
        return None
    if record.get("custom_id") is not None:
        return f"custom_id:{record['custom_id']}"
    if "id" in record:
        return f"id:{record['id']}"
    return None


def read_done(path: Path) -> list[str]:
    """Keys of the records already in ``path`` (for --resume), in file order.

    A torn last line (a crash mid-write: no newline and not JSON) is truncated away; a complete last
    record that only lacks its newline gets it. Unreadable earlier lines are ignored (their input
    lines run again).
    """
    if not path.exists():
        return []
    data = path.read_bytes()
    lines = data.split(b"\n")
    tail = lines.pop()  # what follows the last newline: b"" when the file ends cleanly
    keys = [key for line in lines if (key := _key_of(line)) is not None]
    if tail.strip():
        key = _key_of(tail)
        with open(path, "r+b") as f:
            if key is None:
                f.truncate(len(data) - len(tail))
            else:
                f.seek(0, os.SEEK_END)
                f.write(b"\n")
                keys.append(key)
            f.flush()
            os.fsync(f.fileno())
    return keys


def _key_of(line: bytes) -> str | None:
    if not line.strip():
        return None
    try:
        return record_key(json.loads(line.decode("utf-8")))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None


class JsonlSink:
    """Appends records to a file (one write + flush + fsync per line), or writes them to stdout."""

    def __init__(self, path: Path | None, truncate: bool) -> None:
        self.path = path
        self._fd: int | None = None
        if path is not None:
            flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if truncate else 0)
            try:
                self._fd = os.open(path, flags, 0o644)
            except OSError as e:
                raise OutputError(f"cannot write output file {path}: {e.strerror or e}") from None

    def write(self, record: dict) -> None:
        line = json.dumps(record, ensure_ascii=False) + "\n"
        if self._fd is None:
            sys.stdout.write(line)
            sys.stdout.flush()
            return
        data = line.encode("utf-8")
        written = os.write(self._fd, data)  # O_APPEND: one write puts the whole line at the end
        while written < len(data):  # only on a full disk or a signal; finish the line
            written += os.write(self._fd, data[written:])
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class OrderedWriter:
    """Writes record ``i`` once records ``0..i-1`` are written; holds the ones that finish early."""

    def __init__(self, sink: JsonlSink, count: int) -> None:
        self.sink = sink
        self.count = count
        self.next = 0  # the first position without a written record
        self.held: dict[int, dict] = {}
        self.written: set[int] = set()

    def put(self, position: int, record: dict) -> None:
        self.held[position] = record
        while self.next in self.held:
            record = self.held.pop(self.next)  # popped first: a second Ctrl-C never writes a line twice
            self.written.add(self.next)
            self.next += 1
            self.sink.write(record)

    def flush_held(self) -> int:
        """Write the records still waiting on an earlier line (after Ctrl-C: keep finished work)."""
        count = 0
        for position in sorted(self.held):
            record = self.held.pop(position)
            self.written.add(position)
            self.sink.write(record)
            count += 1
        return count

    @property
    def done(self) -> bool:
        return len(self.written) == self.count


def reorder(path: Path, order: dict[str, int]) -> bool:
    """Rewrite ``path`` with its records in input order (keys by ``order``), atomically.

    Used at the end of a completed --resume run when the interrupted run had written some lines
    ahead of their turn. Records of unknown keys keep their place at the end. Returns True if rewritten.
    """
    lines = [ln for ln in path.read_bytes().split(b"\n") if ln.strip()]
    ranked = []
    for i, line in enumerate(lines):
        try:
            key = record_key(json.loads(line))
        except (UnicodeDecodeError, json.JSONDecodeError):
            key = None
        ranked.append((order.get(key, len(order) + i) if key is not None else len(order) + i, i, line))
    if [r[1] for r in sorted(ranked)] == list(range(len(lines))):
        return False
    tmp = path.with_name(path.name + ".reorder.tmp")
    with open(tmp, "wb") as f:
        f.write(b"".join(line + b"\n" for _, _, line in sorted(ranked)))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    with contextlib.suppress(OSError):  # make the rename itself durable where the OS allows
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return True
