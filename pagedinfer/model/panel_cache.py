"""A GGUF file's weights as packed panels, kept on disk beside its cache folder and read back whole.

Packing a quantized GGUF's blocks into the kernels' panels (`packed_linear.gguf_segments`) reads
and rewrites every weight in numpy passes: most of a warm load. The panels depend only on the file's
content (its cache folder is named by its digest), the packing code and the kernel's formats, so a
load keeps them in one file in that folder, named by a key over those (`key`), and the next load
reads that file into memory in one go instead of packing.

The file is data the kernels index by shape alone, so nothing in it is trusted beyond what is
checked: its magic, its index (each entry inside the data, of the size the kernel reads for that
weight, 64-byte aligned), and its total size (a truncated file fails it). A file that fails any
check, or lacks an entry, is not used for that weight: it is packed again and the file rewritten
(atomically, under a temporary name). Read into memory rather than mapped: a file truncated or
rewritten in place while mapped would fault the process, and anonymous memory is what packed
panels always were (the same pages, the same decode speed).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import torch

MAGIC = b"PIPANEL1"
HEAD = struct.Struct("<8sQ")  # magic, index bytes (UTF-8 JSON)
ALIGN = 64  # each weight's records start on a cache line, as the buffer itself
# what reading a missing, short or spoilt file raises (its index: JSON of any shape)
UNREADABLE = (OSError, ValueError, KeyError, TypeError, AttributeError, struct.error)


def key(sources: Iterable[Path], library: str) -> str:
    """A name for the panels of one file under this code: the packing's sources and the kernel library
    (named by its own sources, flags and CPU)."""
    h = hashlib.sha256(library.encode())
    for path in sources:
        h.update(path.read_bytes())
    return h.hexdigest()[:20]


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _empty(n: int) -> np.ndarray:
    """``n`` bytes starting on an `ALIGN` boundary."""
    raw = np.empty(n + ALIGN, np.uint8)
    shift = -raw.ctypes.data % ALIGN
    return raw[shift : shift + n]


class PanelCache:
    """The panels of one GGUF file's weights: those the file on disk holds, and those packed in this
    load (written back by `save`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.stored: dict[str, np.ndarray] = {}  # name -> [P, panel bytes] records read from the file
        self.used: dict[str, np.ndarray] = {}  # every weight's records in this load, in order
        self.packed = 0  # weights packed in this load (not in the file, or not usable from it)

    @classmethod
    def open(cls, path: Path) -> PanelCache:
        """The cache at ``path``, its file read when it passes every check (else it starts empty)."""
        cache = cls(path)
        with contextlib.suppress(*UNREADABLE):
            cache.stored = _read(path)
        return cache

    def records(self, name: str, shape: tuple[int, int], pack: Callable[[], np.ndarray]) -> torch.Tensor:
        """The records ``[P, panel bytes]`` of weight ``name`` (the file's tensors it is made of, and how),
        of the ``shape`` the kernel reads: the file's, else ``pack()``'s."""
        got = self.stored.get(name)
        if got is None or got.shape != shape:
            got = pack()
            self.packed += 1
        self.used[name] = got
        return torch.from_numpy(got)

    def save(self) -> None:
        """Write this load's records when any was packed, in place of any other key's file in the folder
        (one file of panels per GGUF file: another version's or kernel build's is packed again). A file
        that cannot be written is left as it was: the next load packs again."""
        if not self.packed:
            return
        entries, offset = {}, 0
        for name, records in self.used.items():
            entries[name] = [offset, *records.shape]
            offset = _aligned(offset + records.nbytes)
        index = json.dumps({"size": offset, "entries": entries}).encode()
        start = _aligned(HEAD.size + len(index))
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(HEAD.pack(MAGIC, len(index)) + index)
                for (at, *_), records in zip(entries.values(), self.used.values(), strict=True):
                    f.seek(start + at)
                    f.write(np.ascontiguousarray(records).data)
                f.truncate(start + offset)
            os.replace(tmp, self.path)
            for stale in self.path.parent.glob("panels-*.bin"):  # another version's or kernel build's
                if stale != self.path:
                    stale.unlink(missing_ok=True)
        except OSError:
            tmp.unlink(missing_ok=True)


def _read(path: Path) -> dict[str, np.ndarray]:
    """The records in the file at ``path``, checked (`ValueError` for a file that fails a check)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        magic, index_bytes = HEAD.unpack(f.read(HEAD.size))
        if magic != MAGIC or HEAD.size + index_bytes > size:
            raise ValueError("not a panel cache")
        index = json.loads(f.read(index_bytes))
        start = _aligned(HEAD.size + index_bytes)
        total = index["size"]
        if not isinstance(total, int) or start + total != size:
            raise ValueError("truncated or grown")
        views = {}
        data = _empty(total)
        for name, (at, panels, width) in index["entries"].items():
            if not all(isinstance(v, int) and v >= 0 for v in (at, panels, width)):
                raise ValueError("bad entry")
            if at % ALIGN or at + panels * width > total:
                raise ValueError("entry outside the data")
            views[name] = data[at : at + panels * width].reshape(panels, width)
        f.seek(start)
        if f.readinto(memoryview(data)) != total:
            raise ValueError("short read")
    return views
