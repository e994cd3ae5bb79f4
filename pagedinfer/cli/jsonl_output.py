"""The output: a locked file written one full line per finished request, in input order at the end.

`OutputFile` holds an exclusive advisory lock (``flock``) on the output for the whole run, so a
second run on the same file fails at once instead of truncating the first one's work. Every record
is one ``write`` of one full line, issued as soon as its request finishes, whatever the lines
before it; `sync` (once per engine step, before the next one runs) makes the step's lines durable
with ``fsync``, after writing the input's fingerprint beside the output (``<output>.resume``: the
part of the input read so far and its SHA-256), which ``--resume`` checks the input against; the
same file keeps, from when the run starts writing, the options its records depend on
(`pagedinfer.cli.resume`), which ``--resume`` checks its own against. A crash
or ``kill -9`` therefore loses only the lines still being generated (a power cut, also those
written since the last step). A failed write (disk full, EIO) is cut back to the last full line and
raised as `OutputWriteError`. When the run completes, `reorder` puts the file in input order
(atomically: a new temporary file, created exclusively, renamed over it). ``--resume`` (`load_done`)
accepts the lines in any order, cuts a torn last line, and drops unreadable lines so they run again.

`StreamOutput` serves ``-o -``, devices and FIFOs: records in input order as lines finish, no
reorder, no resume. `plan_paths` resolves every path a run writes once and refuses any two that
are the same file, or one that is the input.
"""

from __future__ import annotations

import array
import contextlib
import errno
import fcntl
import glob
import itertools
import json
import os
import signal
import stat
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pagedinfer.lines.records import record_key
from pagedinfer.lines.source import Fingerprint

_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
RESUME_SUFFIX = ".resume"  # the input's fingerprint and the run's options beside the output
_RESUME_BYTES = 512  # the fingerprint record is rewritten in place at this fixed size; the options follow
_RESUME_MAX = 1 << 20  # read no more of a resume file than this


class OutputError(Exception):
    """The output path is unusable or taken; the message is one line."""


class OutputWriteError(Exception):
    """Writing the output failed mid-run (disk full, I/O error); the message is one line."""


class OutputClosed(OutputWriteError):
    """The reader of a pipe output went away (``pagedinfer run -o - | head``)."""


def default_output_path(input_path: Path) -> Path:
    """``prompts.jsonl`` -> ``prompts.out.jsonl`` next to the input."""
    name = input_path.name
    stem = name[: -len(".jsonl")] if name.endswith(".jsonl") else name
    return input_path.with_name(f"{stem}.out.jsonl")


@dataclass
class Paths:
    """Where a run writes, each path resolved once (a symlink to its target)."""

    output: Path | None  # None: stdout
    stream: bool  # the output is stdout, a device or a FIFO: streamed, never reordered or resumed
    report_json: Path | None
    trace: Path | None

    @property
    def resume(self) -> Path | None:
        """The fingerprint file beside a regular output."""
        return (
            None
            if self.output is None or self.stream
            else self.output.with_name(self.output.name + RESUME_SUFFIX)
        )

    @property
    def journal(self) -> Path | None:
        """The unfinished lines' tokens beside a regular output (`cli.line_journal`)."""
        return None if self.resume is None else self.resume.with_name(self.resume.name + ".lines")


def plan_paths(output: str | None, input_path: Path, report_json: Path | None, trace: Path | None) -> Paths:
    """Resolve and check every output-side path before anything is opened or the model loads."""
    if output == "-":
        out, stream = None, True
    else:
        given = Path(output) if output else default_output_path(input_path)
        out, stream = _resolve(given, "output file"), _is_stream(given)
        if stream:
            out = given  # a device or FIFO is opened by the name given (/dev/stdout is a link into /proc)
    paths = Paths(
        out, stream, *(_resolve(p, n) for p, n in ((report_json, "--report-json"), (trace, "--trace")))
    )
    named = [
        ("output file", paths.output),
        ("the output's fingerprint file", paths.resume),
        ("the output's unfinished-lines file", paths.journal),
        ("--report-json file", paths.report_json),
        ("--trace file", paths.trace),
    ]
    named = [(what, p) for what, p in named if p is not None]
    for i, (what, path) in enumerate(named):
        if _same(path, input_path):
            raise OutputError(f"{what} {path} is the input file (the same file, through a link or not)")
        for other, other_path in named[:i]:
            if _same(path, other_path):
                raise OutputError(f"{what} {path} is the same file as the {other}")
    return paths


def _resolve(path: Path | None, what: str) -> Path | None:
    """``path`` with its symlinks resolved (writes go through to the target); fails early on a path
    that cannot be written. Creates nothing."""
    if path is None:
        return None
    if _is_stream(path):
        return path
    real = Path(os.path.realpath(path))
    if real.is_dir():
        raise OutputError(f"{what} {path} is a directory")
    parent = real.parent
    if not parent.is_dir():
        raise OutputError(f"cannot write {what} {path}: directory {parent} does not exist")
    if real.exists() and not os.access(real, os.W_OK):
        raise OutputError(f"cannot write {what} {path}: permission denied")
    if not real.exists() and not os.access(parent, os.W_OK):
        raise OutputError(f"cannot write {what} {path}: directory {parent} is not writable")
    return real


def _is_stream(path: Path) -> bool:
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not stat.S_ISREG(mode) and not stat.S_ISDIR(mode)


def _same(a: Path, b: Path) -> bool:
    if a == b:
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


@dataclass
class Done:
    """What ``--resume`` finds in the output."""

    keys: set[str]  # lines already answered
    errors: int  # of them, error records
    dropped: int  # unreadable lines removed (their input lines run again)
    fingerprint: Fingerprint | None  # of the input part the earlier run had read (None: not kept)
    options: dict | None = None  # the options its records were made with (None: not kept)
    system_fingerprint: str | None = None  # what decided its records' bytes (None: not kept)


def _key_of(line: bytes) -> tuple[str | None, bool]:
    """(key, is an error record) of one output line; key None when it is not a readable record."""
    if not line.strip():
        return None, False
    try:
        record = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None, False
    key = record_key(record)
    return key, key is not None and record.get("error") is not None  # both shapes: null when it succeeded


class OutputFile:
    """The output of one run, opened and locked (nothing is truncated until `start`)."""

    def __init__(self, path: Path, resume_path: Path | None = None) -> None:
        self.path = path
        self.resume_path = resume_path
        self.written = 0  # records written by this run (each a full line in the file)
        self.errors_written = 0
        self._unsynced = False
        self._resume_fd: int | None = None
        self._fingerprint: Fingerprint | None = None  # the one on disk
        self.system_fingerprint: str | None = None  # the run's, kept beside the input's fingerprint
        # where each line of the file starts, and the key of the input line it answers (known from
        # `load_done` or `start(truncate=True)` on): `reorder` reads no record back
        self._offsets = array.array("q")
        self._keys: list[str] | None = None
        try:
            self._fd = os.open(
                path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644
            )
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
        self._remove_stale_temporaries()

    def _remove_stale_temporaries(self) -> None:
        """Temporary files a killed reorder left (``.<name>.*.tmp``); safe: this run holds the lock
        they were written under, and only our own regular files are removed, never a link."""
        for leftover in self.path.parent.glob(f".{glob.escape(self.path.name)}.*.tmp"):
            with contextlib.suppress(OSError):
                info = os.lstat(leftover)
                if stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid():
                    os.unlink(leftover)

    def load_done(self) -> Done:
        """For --resume: the keys already answered, the input fingerprint kept with them.

        Records may be in any order. A torn or unreadable line (a crash mid-write, a corrupted
        block) is removed from the file, atomically, so that its input line runs again.
        """
        keys: list[str] = []
        offsets = array.array("q")
        kept: list[bool] = []  # per line of the file: readable (kept by a rewrite)
        dropped, errors, rewrite, pos = 0, 0, False, 0  # pos: where the line starts once the file is clean
        with open(self._fd, "rb", closefd=False) as f:
            f.seek(0)
            for raw in f:
                key, failed = _key_of(raw)
                kept.append(key is not None)
                if key is None:
                    dropped += raw.strip() != b""
                    rewrite = True
                    continue
                keys.append(key)
                offsets.append(pos)
                pos += len(raw) + (not raw.endswith(b"\n"))
                errors += failed
                rewrite |= not raw.endswith(b"\n")  # a complete last record without its newline
        if rewrite:
            self._rewrite(kept)
        self._keys, self._offsets = keys, offsets
        self._fingerprint, options, system = self._read_resume_file()
        return Done(set(keys), errors, dropped, self._fingerprint, options, system)

    def start(self, truncate: bool, options: dict | None = None) -> None:
        """Begin writing: truncated for a fresh run, appended to for --resume. ``options`` (those the
        records depend on) then replace the ones kept beside the output; a fresh run's old ones go
        in any case. The output is truncated first: a crash in between leaves no records under
        options they were not made with."""
        if truncate:
            os.ftruncate(self._fd, 0)
            self._size = 0
            self._fingerprint = None
            self._keys, self._offsets = [], array.array("q")
        if (truncate or options is not None) and self.resume_path is not None:
            self._replace_resume_file(options)

    def write(self, record: dict, position: int, key: str) -> None:
        """One record, answering the input line keyed ``key``, as one full line written now (durable at
        the next `sync`); any ``position``. SIGINT/SIGTERM/SIGHUP wait until it is written (on the main
        thread), so a stop never splits it and `written` always counts exactly the lines in the file."""
        data = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        held = threading.current_thread() is threading.main_thread()
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS) if held else None
        try:
            done = os.write(self._fd, data)  # O_APPEND: the whole line goes to the end
            while done < len(data):  # only on a full disk or an interrupted write
                done += os.write(self._fd, data[done:])
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._size)  # no torn line left behind
            raise OutputWriteError(f"cannot write output file {self.path}: {e.strerror or e}") from None
        else:
            self._offsets.append(self._size)
            self._keys.append(key)
            self._size += len(data)
            self.written += 1
            self.errors_written += record.get("error") is not None
            self._unsynced = True
        finally:
            if held:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)

    def sync(self, fingerprint: Fingerprint | None = None) -> None:
        """Make the lines written durable; first keep ``fingerprint`` (what the run has read) beside them."""
        known = self._fingerprint.size if self._fingerprint is not None else -1
        if fingerprint is not None and self.resume_path is not None and fingerprint.size > known:
            self._write_fingerprint(fingerprint)  # only ever grows: it covers every line answered
        if self._unsynced:
            try:
                os.fsync(self._fd)
            except OSError as e:
                raise OutputWriteError(f"cannot write output file {self.path}: {e.strerror or e}") from None
            self._unsynced = False

    def keep_system_fingerprint(self, value: str) -> None:
        """Keep the run's system_fingerprint (docs/reproducibility.md) in the resume file, now and with
        every later update of the input's fingerprint."""
        self.system_fingerprint = value
        if self.resume_path is not None:
            self._write_fingerprint(self._fingerprint)

    def _head(self, fingerprint: Fingerprint | None) -> bytes:
        """The resume file's first record: the input's fingerprint and the run's system_fingerprint."""
        doc = None if fingerprint is None else fingerprint.to_dict()
        if self.system_fingerprint is not None:
            doc = {**(doc or {}), "system_fingerprint": self.system_fingerprint}
        return json.dumps(doc).encode().ljust(_RESUME_BYTES - 1) + b"\n"

    def _write_fingerprint(self, fingerprint: Fingerprint | None) -> None:
        data = self._head(fingerprint)
        try:
            if self._resume_fd is None:
                self._resume_fd = os.open(
                    self.resume_path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644
                )
            os.pwrite(self._resume_fd, data, 0)  # one sector: never half old, half new
            os.fsync(self._resume_fd)
        except OSError as e:
            raise OutputWriteError(f"cannot write {self.resume_path}: {e.strerror or e}") from None
        self._fingerprint = fingerprint

    def _replace_resume_file(self, options: dict | None) -> None:
        """A new resume file (renamed over the old one: never a mix of both): the fingerprint kept so
        far, then ``options`` (none: nothing can be checked against them)."""
        data = self._head(self._fingerprint)
        if options is not None:
            data += json.dumps({"options": options}, ensure_ascii=False).encode("utf-8") + b"\n"
        try:
            fd = _renamed_over(self.resume_path, [data], stat.S_IMODE(os.fstat(self._fd).st_mode), lock=False)
        except OSError as e:
            raise OutputWriteError(f"cannot write {self.resume_path}: {e.strerror or e}") from None
        if self._resume_fd is not None:
            os.close(self._resume_fd)
        self._resume_fd = fd  # the fingerprint is rewritten in place in this one
        _sync_directory(self.resume_path.parent)

    def _read_resume_file(self) -> tuple[Fingerprint | None, dict | None, str | None]:
        """(fingerprint, options, system_fingerprint) kept beside the output; None for each one missing
        or unreadable (an older version kept the fingerprint alone)."""
        if self.resume_path is None:
            return None, None, None
        try:
            fd = os.open(self.resume_path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return None, None, None
        try:
            with open(fd, "rb", closefd=False) as f:
                data = f.read(_RESUME_MAX)
        except OSError:
            return None, None, None
        finally:
            os.close(fd)
        head = data[:_RESUME_BYTES]
        return _fingerprint_of(head), _options_of(data[_RESUME_BYTES:]), _system_fingerprint_of(head)

    def reorder(self, rank: Callable[[str], int | None]) -> bool:
        """Rewrite the file in input order (``rank`` of each record's key), if it is not already.

        The keys and offsets are the ones kept as lines were written (or read by `load_done`): no
        record is read back. Records with no rank keep their order at the end. Raises
        OutputWriteError (the file is then left as it was: every line still there).
        """
        keys, offsets = self._keys, self._offsets
        ranks = array.array("q", ((1 << 62) + i if (r := rank(k)) is None else r for i, k in enumerate(keys)))
        if all(a <= b for a, b in itertools.pairwise(ranks)):
            return False
        order = sorted(range(len(ranks)), key=ranks.__getitem__)
        ends = offsets[1:] + array.array("q", [self._size])
        with open(self._fd, "rb", closefd=False) as src:

            def lines():
                for i in order:
                    src.seek(offsets[i])
                    yield src.read(ends[i] - offsets[i])

            self._replace(lines())
        self._keys = [keys[i] for i in order]
        self._offsets = array.array(
            "q", itertools.accumulate((ends[i] - offsets[i] for i in order[:-1]), initial=0)
        )
        return True

    def _rewrite(self, kept: list[bool]) -> None:
        """The file again with only the lines ``kept`` says (one flag per line, as `load_done` read
        them), each ending in a newline."""
        with open(self._fd, "rb", closefd=False) as src:
            src.seek(0)
            self._replace(
                raw if raw.endswith(b"\n") else raw + b"\n"
                for raw, keep in zip(src, kept, strict=True)
                if keep
            )

    def _replace(self, lines) -> None:
        """Write ``lines`` to a new file renamed over the output; keep the lock on it."""
        try:
            fd = _renamed_over(self.path, lines, stat.S_IMODE(os.fstat(self._fd).st_mode), lock=True)
        except OSError as e:
            raise OutputWriteError(f"cannot rewrite output file {self.path}: {e.strerror or e}") from None
        os.close(self._fd)
        self._fd = fd
        os.lseek(fd, 0, os.SEEK_END)
        fl = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, fl | os.O_APPEND)
        self._size = os.fstat(fd).st_size
        _sync_directory(self.path.parent)

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                self.sync()
            os.close(self._fd)
            self._fd = None
        if self._resume_fd is not None:
            os.close(self._resume_fd)
            self._resume_fd = None


def _renamed_over(path: Path, chunks, mode: int, lock: bool) -> int:
    """Write ``chunks`` to a new temporary file beside ``path`` (created exclusively: a file or link
    planted at any name is never followed; ``.<name>.*.tmp``, which a killed run leaves for the next
    one to remove), make it durable, give it ``mode`` (and the lock) and rename it over ``path``.
    Returns its descriptor; raises OSError, with the temporary file removed."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with open(fd, "wb", closefd=False) as f:
            for raw in chunks:
                f.write(raw)
            f.flush()
            os.fsync(fd)
        os.fchmod(fd, mode)
        if lock:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # new inode: no other run can hold it yet
        os.replace(tmp, path)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return fd


def _sync_directory(path: Path) -> None:
    """Make a rename in ``path`` durable where the OS allows."""
    with contextlib.suppress(OSError):
        dir_fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _fingerprint_of(head: bytes) -> Fingerprint | None:
    try:
        doc = json.loads(head)
        return Fingerprint(int(doc["size"]), int(doc["lines"]), str(doc["sha256"]))
    except (ValueError, KeyError, TypeError):
        return None


def _system_fingerprint_of(head: bytes) -> str | None:
    try:
        value = json.loads(head)["system_fingerprint"]
    except (ValueError, KeyError, TypeError):
        return None
    return value if isinstance(value, str) else None


def _options_of(tail: bytes) -> dict | None:
    try:
        options = json.loads(tail)["options"]
    except (ValueError, KeyError, TypeError, RecursionError):
        return None
    return options if isinstance(options, dict) else None


class StreamOutput:
    """Stdout, a device or a FIFO: records in input order; one that finishes early waits for the lines
    before it (at most the run's window of them)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self.written = 0
        self.errors_written = 0
        self.next = 0  # the first position without a written record
        self.held: dict[int, dict] = {}
        self._fd: int | None = None
        if path is None:
            return
        try:  # a FIFO without a reader: fail now rather than block
            self._fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            os.set_blocking(self._fd, True)
        except OSError as e:
            why = "no process is reading it" if e.errno == errno.ENXIO else (e.strerror or str(e))
            raise OutputError(f"cannot write output {path}: {why}") from None

    def write(self, record: dict, position: int, key: str) -> None:
        """Print ``record`` once every record before ``position`` is printed (``key``: not needed)."""
        self.held[position] = record
        while self.next in self.held:
            self._emit(self.held.pop(self.next))
            self.next += 1

    def sync(self, fingerprint: Fingerprint | None = None) -> None:
        """Nothing to do: each record is flushed as it is printed."""

    def flush_held(self) -> None:
        """After an interruption: print the records still waiting on an earlier line (out of order)."""
        for position in sorted(self.held):
            self._emit(self.held.pop(position))

    def _emit(self, record: dict) -> None:
        data = json.dumps(record, ensure_ascii=False) + "\n"
        try:
            if self._fd is None:
                sys.stdout.write(data)
                sys.stdout.flush()
            else:
                raw = data.encode("utf-8")
                done = 0
                while done < len(raw):
                    done += os.write(self._fd, raw[done:])
        except BrokenPipeError:
            if self._fd is None:  # no "Exception ignored" when the interpreter flushes stdout at exit
                with contextlib.suppress(OSError, AttributeError, ValueError):
                    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise OutputClosed(f"the reader of the output closed it after {self.written} records") from None
        except OSError as e:
            raise OutputWriteError(
                f"cannot write output {self.path or 'stdout'}: {e.strerror or e}"
            ) from None
        self.written += 1
        self.errors_written += record.get("error") is not None

    def close(self) -> None:
        if self.path is not None and self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
