"""The input file, read once, a line at a time: memory does not grow with the file.

`InputLines` opens the input and yields its non-blank lines as ``(number, text)``. An input that is
not a regular file (a pipe, ``/dev/stdin``, a process substitution) can be read only once, so it is
first copied once into an unnamed spool file, which then serves as the input. While it reads, it
keeps a running SHA-256 of the bytes read (`fingerprint`): the output keeps the fingerprint of what
it answers, and ``--resume`` refuses an input whose already-read part changed (`check_fingerprint`).
Only problems of the whole file (missing, a directory, empty, UTF-16/32) raise `InputFileError`; a
line that is not UTF-8 becomes an error for that line alone.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

_WIDE_BOMS = (b"\xff\xfe", b"\xfe\xff")  # UTF-16/32 byte order marks: not a JSONL file we can read


class InputFileError(Exception):
    """The input file as a whole is unusable; the message is one line."""


class LineDecodeError(Exception):
    """One line is not UTF-8 (the line fails alone)."""


@dataclass(frozen=True)
class Fingerprint:
    """The first ``size`` bytes of an input (``lines`` lines of it) hash to ``sha256``."""

    size: int
    lines: int
    sha256: str

    def to_dict(self) -> dict:
        return {"size": self.size, "lines": self.lines, "sha256": self.sha256}


class InputLines:
    """The input, opened once (spooled first when it is not a regular file); iterate once for its lines."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            raise InputFileError(f"input file {path} does not exist") from None
        except OSError as e:
            raise InputFileError(f"cannot read input file {path}: {e.strerror or e}") from None
        if stat.S_ISDIR(mode):
            raise InputFileError(f"input path {path} is a directory; give a .jsonl file")
        try:
            self._file = open(path, "rb")  # noqa: SIM115 - held for the run, closed by close()
        except OSError as e:
            raise InputFileError(f"cannot read input file {path}: {e.strerror or e}") from None
        self.spooled = not stat.S_ISREG(mode)
        if self.spooled:
            self._file = _spool(self._file, path)
        self.size = os.fstat(self._file.fileno()).st_size
        head = self._file.read(4)
        if head.startswith(_WIDE_BOMS) or head[:3] == b"\x00\x00\xfe":
            raise InputFileError(f"input file {path} is UTF-16 or UTF-32 text; save it as UTF-8")
        if not self._has_content(head):
            raise InputFileError(f"input file {path} is empty: it needs one JSON request per line")
        self.rewind()

    def _has_content(self, head: bytes) -> bool:
        """Whether any byte is not white space (only the leading white space is looked at)."""
        chunk = head
        while chunk:
            if chunk.strip():
                return True
            chunk = self._file.read(1 << 16)
        return False

    def rewind(self) -> None:
        """Back to the first line (``--strict`` reads the input again after checking it)."""
        self._file.seek(0)
        self._hash = hashlib.sha256()
        self.bytes_read = 0
        self.lines_read = 0  # all lines, blank ones included
        self.count = 0  # non-blank lines

    def __iter__(self) -> Iterator[tuple[int, str | LineDecodeError]]:
        """Each non-blank line as (number, text), or (number, LineDecodeError) for a line that is not UTF-8."""
        for raw in self._file:
            self._hash.update(raw)
            self.bytes_read += len(raw)
            self.lines_read += 1
            try:
                text = raw.decode("utf-8-sig" if self.lines_read == 1 else "utf-8")
            except UnicodeDecodeError as e:
                self.count += 1
                yield (
                    self.lines_read,
                    LineDecodeError(
                        f"is not UTF-8 text (byte 0x{raw[e.start]:02x} at position {e.start + 1})"
                    ),
                )
                continue
            if text.strip():
                self.count += 1
                yield self.lines_read, text

    def count_unread(self) -> int:
        """The non-blank lines not read yet: a stopped run counts them as not run (it reads only as far
        as the engine has room for). Neither the fingerprint nor the place read changes."""
        here = self._file.tell()
        unread = sum(1 for raw in self._file if raw.decode("utf-8", "replace").strip())
        self._file.seek(here)
        return unread

    def fingerprint(self) -> Fingerprint:
        """What has been read so far."""
        return Fingerprint(self.bytes_read, self.lines_read, self._hash.hexdigest())

    def check_fingerprint(self, earlier: Fingerprint) -> str | None:
        """Why this input is not the one an earlier run read (its first ``earlier.size`` bytes differ), or None.

        Reads those bytes once more, then rewinds.
        """
        if self.size < earlier.size:
            return f"it is shorter than the {earlier.size:,} bytes the earlier run had read"
        self._file.seek(0)
        digest, left = hashlib.sha256(), earlier.size
        while left:
            chunk = self._file.read(min(left, 1 << 20))
            digest.update(chunk)
            left -= len(chunk)
        self.rewind()
        if digest.hexdigest() != earlier.sha256:
            return f"its first {earlier.lines:,} lines differ from the ones the earlier run answered"
        return None

    def close(self) -> None:
        self._file.close()


def _spool(source, path: Path):
    """Copy a pipe (or any non-regular input) once into an unnamed temporary file and rewind it."""
    spool = tempfile.TemporaryFile(prefix="pagedinfer-input-")  # noqa: SIM115 - replaces the source
    try:
        with source:
            shutil.copyfileobj(source, spool, 1 << 20)
    except OSError as e:
        spool.close()
        raise InputFileError(f"cannot read input {path}: {e.strerror or e}") from None
    spool.seek(0)
    return spool
