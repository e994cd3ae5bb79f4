"""A GGUF file's weights as packed panels, kept on disk in its cache folder and mapped back.

Packing a quantized GGUF's blocks into the kernels' panels (`packed_linear.gguf_segment`) reads
and rewrites every weight in numpy passes: most of a warm load. The panels depend only on the file's
content (its cache folder is named by its digest), the packing code and the kernel's formats, so a
load keeps them in one file in that folder, named by a key over those (`key`), and the next load
maps that file instead of packing.

The file is data the kernels index by shape alone, so nothing in it is trusted beyond what is
checked: its magic, its index (each entry inside the data, of the size the kernel reads for that
weight, 64-byte aligned), and its total size (a truncated file fails it). A file that fails any
check, or lacks an entry, is not used for that weight: it is packed again and the file rewritten.

The file is mapped (copy-on-write), not read: its pages come from the page cache as the first step
touches them, where reading it copied every byte into fresh memory the kernel had to zero first (a
new process paid that for the whole file). A mapped file must not shrink under the process, so it is
never written in place: a new one is written under a temporary name and renamed over it, and a
process still mapping the old one keeps it whole.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import torch

MAGIC = b"PIPANEL1"
HEAD = struct.Struct("<8sQ")  # magic, index bytes (UTF-8 JSON)
ALIGN = 64  # each weight's records start on a cache line (the mapping starts on a page)
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
        """The cache at ``path``, its file mapped when it passes every check (else it starts empty)."""
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
    """The records in the file at ``path``, checked, as views of its mapping (`ValueError` for a file
    that fails a check)."""
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
        entries = index["entries"].items()
        for _, (at, panels, width) in entries:
            if not all(isinstance(v, int) and v >= 0 for v in (at, panels, width)):
                raise ValueError("bad entry")
            if at % ALIGN or at + panels * width > total:
                raise ValueError("entry outside the data")
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # the views keep it open
    data = np.frombuffer(mapped, np.uint8, total, start)
    return {
        name: data[at : at + panels * width].reshape(panels, width) for name, (at, panels, width) in entries
    }
