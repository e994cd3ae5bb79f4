"""``--resume`` inside a line: what the unfinished lines have generated, kept beside the output.

`LineJournal` appends, at most every ``--resume-every-tokens`` generated tokens of any completion or
``--resume-every-seconds`` (whichever comes first), each unfinished line's new tokens, per completion,
with their logprob entries where the line asks for them: one ``write`` of the records, then
``fsync``, to ``<output>.resume.lines`` (each record one line, ``<crc32> <json>``; a torn or
corrupted record is skipped when read, so a kill mid-write costs that write alone). Nothing else is
needed to go on: a completion's random stream is one number per sampled token (re-drawn from its
seed), and its text, stop strings and grammar state are rebuilt by replaying the tokens
(`Scheduler` appends them as if sampled). The finished lines' records and the input's fingerprint
stay in the output and ``<output>.resume``: this file is never written over them.

Each engine step also overwrites ``<output>.resume.reached`` (no ``fsync``: a kill keeps it, a power
cut may not) with how many tokens each completion holds, so that a resumed run can say how many
tokens it generates again. When the journal holds much more than the unfinished lines' records
(finished lines' records stay until then), it is rewritten with those alone: a new temporary file,
made durable, renamed over it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import stat
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from pagedinfer import envs
from pagedinfer.cli.jsonl_output import OutputWriteError, _renamed_over, _sync_directory
from pagedinfer.core.sequence import KeptCompletion, KeptLine, Request, request_identity
from pagedinfer.outputs import Logprob

LINES_SUFFIX = ".lines"  # after the resume file's name: <output>.resume.lines
REACHED_SUFFIX = ".reached"
_COMPACT_MIN_BYTES = 1 << 20  # below this the journal is never rewritten


@dataclass
class Resumed:
    """What a resumed run found of the lines an earlier one left mid-generation."""

    lines: dict[str, KeptLine] = field(default_factory=dict)  # by line key
    recomputed: int = 0  # tokens the earlier run had generated past what it kept
    most_recomputed: int = 0  # the most of them in one completion

    @property
    def tokens(self) -> int:
        return sum(len(k.token_ids) for line in self.lines.values() for k in line.completions.values())


class LineJournal:
    """The journal of one run's unfinished lines (``path``: ``<output>.resume.lines``)."""

    def __init__(self, path: Path, every_tokens: int, every_seconds: float, mode: int = 0o644) -> None:
        self.path = path
        self.reached_path = path.with_name(path.name.removesuffix(LINES_SUFFIX) + REACHED_SUFFIX)
        self.every_tokens = every_tokens
        self.every_seconds = every_seconds
        self.mode = mode
        self.writes = 0  # journal writes this run (the test hook counts them)
        self._fd: int | None = None
        self._reached_fd: int | None = None
        self._reached_size = 0
        self._size = 0
        self._last = time.monotonic()
        self._recorded: dict[str, dict[int, int]] = {}  # line key -> completion -> tokens on disk
        self._identity: dict[str, str] = {}  # line key -> `request_identity` of its records
        self._bytes: dict[str, int] = {}  # line key -> bytes of its records in the journal
        self._finished: set[str] = set()

    # -- the run's start ----------------------------------------------------------------------------
    def load(self, done: set[str]) -> Resumed:
        """What the journal keeps of the lines not in ``done`` (those with a record), and what the
        earlier run had reached beyond it."""
        found = Resumed()
        for key, identity, index, at, tokens, logprobs in _records(_read(self.path)):
            if key in done:
                continue
            line = found.lines.get(key)
            if line is None or line.identity != identity:
                if at:
                    continue  # the continuation of records lost: unusable
                line = found.lines[key] = KeptLine(identity, {})
            kept = line.completions.get(index)
            have = 0 if kept is None else len(kept.token_ids)
            if at != have or (kept is not None and (kept.logprobs is None) != (logprobs is None)):
                continue  # not the continuation of what is kept
            if kept is None:
                kept = line.completions[index] = KeptCompletion([], None if logprobs is None else [])
            kept.token_ids += tokens
            if logprobs is not None:
                kept.logprobs += logprobs
        reached = _reached(_read(self.reached_path))
        for key, counts in reached.items():
            if key in done:
                continue
            line = found.lines.get(key)
            for index, count in enumerate(counts):
                kept = None if line is None else line.completions.get(index)
                lost = max(0, count - (0 if kept is None else len(kept.token_ids)))
                found.recomputed += lost
                found.most_recomputed = max(found.most_recomputed, lost)
        return found

    def start(self, kept: Resumed | None) -> None:
        """Begin this run's journal: the records ``kept`` (a resumed run's, rewritten alone), or none."""
        kept = kept or Resumed()
        chunks = []
        for key, line in kept.lines.items():
            self._identity[key] = line.identity
            self._recorded[key] = {index: len(k.token_ids) for index, k in line.completions.items()}
            for index, k in line.completions.items():
                chunks.append(self._encode(key, index, 0, k.token_ids, k.logprobs, line.identity))
        self._replace(chunks)
        self._write_reached({})

    # -- during the run -----------------------------------------------------------------------------
    def step(self, lines: list[tuple[str, Request]], force: bool = False) -> None:
        """Before an engine step: append the new tokens of ``lines`` (those that hold generated tokens,
        by key) when a completion is ``every_tokens`` past what is kept, ``every_seconds`` passed, or
        ``force``; then note how far every completion has got."""
        behind = 0
        for key, req in lines:
            recorded = self._recorded.get(key, {})
            for seq in req.completions:
                behind = max(behind, seq.num_output_tokens - recorded.get(seq.index, 0))
        now = time.monotonic()
        if behind and (force or behind >= self.every_tokens or now - self._last >= self.every_seconds):
            self._append(lines)
            self._last = now
        self._write_reached({key: [s.num_output_tokens for s in req.completions] for key, req in lines})

    def finished(self, key: str) -> None:
        """Line ``key`` has its record in the output: its journal records are dead weight."""
        self._recorded.pop(key, None)
        self._finished.add(key)

    def kept_tokens(self, keys: set[str]) -> int:
        """Tokens the journal keeps of the lines ``keys``."""
        return sum(sum(self._recorded.get(key, {}).values()) for key in keys)

    def remove(self) -> None:
        """The run is complete: nothing is left to resume inside a line."""
        self.close()
        for path in (self.path, self.reached_path):
            with contextlib.suppress(OSError):
                os.unlink(path)

    def close(self) -> None:
        for fd in (self._fd, self._reached_fd):
            if fd is not None:
                os.close(fd)
        self._fd = self._reached_fd = None

    # -- writing ------------------------------------------------------------------------------------
    def _append(self, lines: list[tuple[str, Request]]) -> None:
        chunks, recorded = [], {}
        for key, req in lines:
            identity = request_identity(req.seed, req.prompt_token_ids, req.params.n)
            before = self._recorded.get(key, {}) if self._identity.get(key) == identity else {}
            self._identity[key] = identity
            recorded[key] = dict(before)
            for seq in req.completions:
                at = before.get(seq.index, 0)
                if seq.num_output_tokens <= at:
                    continue
                logprobs = None if seq.logprobs is None else seq.logprobs[at:]
                chunk = self._encode(key, seq.index, at, seq.output_ids[at:], logprobs, identity)
                chunks.append(chunk)
                recorded[key][seq.index] = seq.num_output_tokens
        data = b"".join(chunks)
        self.writes += 1
        try:
            if self.writes == envs.kill_in_resume_write():  # tests: a kill in the middle of this write
                os.write(self._fd, data[: len(data) // 2])
                os.kill(os.getpid(), signal.SIGKILL)
            done = os.write(self._fd, data)
            while done < len(data):
                done += os.write(self._fd, data[done:])
            os.fsync(self._fd)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._size)  # no torn record left behind
            raise OutputWriteError(f"cannot write {self.path}: {e.strerror or e}") from None
        self._size += len(data)
        self._recorded.update(recorded)
        if self._size > max(_COMPACT_MIN_BYTES, 2 * self._live_bytes()):
            self._compact()

    def _encode(
        self,
        key: str,
        index: int,
        at: int,
        tokens: list[int],
        logprobs: list[dict[int, Logprob]] | None,
        identity: str,
    ) -> bytes:
        doc: dict = {"key": key, "id": identity, "i": index, "at": at, "t": tokens}
        if logprobs is not None:
            doc["lp"] = [[[t, e.logprob, e.rank] for t, e in top.items()] for top in logprobs]
        body = json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        self._bytes[key] = self._bytes.get(key, 0) + len(body) + 10
        return b"%08x " % zlib.crc32(body) + body + b"\n"

    def _live_bytes(self) -> int:
        return sum(n for key, n in self._bytes.items() if key not in self._finished)

    def _compact(self) -> None:
        """The journal again with the unfinished lines' records alone."""
        keep = []
        for raw in _read(self.path).splitlines(keepends=True):
            doc = _decode(raw)
            if doc is not None and doc["key"] not in self._finished:
                keep.append(raw)
        self._bytes = {k: n for k, n in self._bytes.items() if k not in self._finished}
        self._finished.clear()
        self._replace(keep)

    def _replace(self, chunks: list[bytes]) -> None:
        try:
            fd = _renamed_over(self.path, chunks, self.mode, lock=False)
        except OSError as e:
            raise OutputWriteError(f"cannot write {self.path}: {e.strerror or e}") from None
        if self._fd is not None:
            os.close(self._fd)
        self._fd = fd
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)  # after a cut-back too
        self._size = os.fstat(fd).st_size
        _sync_directory(self.path.parent)

    def _write_reached(self, counts: dict[str, list[int]]) -> None:
        data = json.dumps(counts, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n"
        padded = data.ljust(self._reached_size)  # one write covers the longer note before it
        try:
            if self._reached_fd is None:
                flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW
                self._reached_fd = os.open(self.reached_path, flags, self.mode)
            os.pwrite(self._reached_fd, padded, 0)
        except OSError as e:
            raise OutputWriteError(f"cannot write {self.reached_path}: {e.strerror or e}") from None
        self._reached_size = len(padded)


def _read(path: Path) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return b""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return b""
        with open(fd, "rb", closefd=False) as f:
            return f.read()
    except OSError:
        return b""
    finally:
        os.close(fd)


def _decode(raw: bytes) -> dict | None:
    """One journal record, or None for a torn, corrupted or unreadable one."""
    if not raw.endswith(b"\n") or len(raw) < 10 or raw[8:9] != b" ":
        return None
    body = raw[9:-1]
    try:
        if int(raw[:8], 16) != zlib.crc32(body):
            return None
        doc = json.loads(body.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("key"), str) else None


def _records(data: bytes):
    """(key, identity, index, at, tokens, logprob entries or None) of each readable record."""
    for raw in data.splitlines(keepends=True):
        doc = _decode(raw)
        if doc is None:
            continue
        try:
            tokens = [int(t) for t in doc["t"]]
            logprobs = None
            if "lp" in doc:
                logprobs = [
                    {int(t): Logprob(float(lp), int(rank)) for t, lp, rank in top} for top in doc["lp"]
                ]
                if len(logprobs) != len(tokens):
                    continue
            yield doc["key"], str(doc["id"]), int(doc["i"]), int(doc["at"]), tokens, logprobs
        except (KeyError, TypeError, ValueError):
            continue


def _reached(data: bytes) -> dict[str, list[int]]:
    try:
        doc = json.loads(data.split(b"\n", 1)[0].decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError):
        return {}
    if not isinstance(doc, dict):
        return {}
    return {k: v for k, v in doc.items() if isinstance(v, list) and all(isinstance(c, int) for c in v)}
