"""A GGUF file's header (metadata and tensor index) read within stated limits, before any other reader.

gguf-py's reader trusts the counts and lengths a file states: a cut header surfaces as numpy's "index
0 is out of bounds", an array of 20 million items as minutes of parsing (one view per item), a huge
length as numpy's dtype message. `read` walks the header once with its own bounds: every count and
length is checked against the limits below and against the bytes the file holds before anything is
read or allocated, every string must be UTF-8, and every tensor's dimensions, type, offset and size
must describe bytes inside the file. A file that passes is one gguf-py and transformers parse in
bounded time. Failures are `HeaderError` with the reason in the user's terms (the caller adds the
file's name).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

VERSIONS = (2, 3)  # gguf-py reads these; version 1 had 32-bit counts
DEFAULT_ALIGNMENT = 32
# Limits (docs/cli.md "What is checked before a run"). Real files hold well under them: ~1,200 tensors
# for a 405B Llama, ~60 metadata keys, a 262,144-token vocabulary (Gemma 3: 786,432 array items with its
# scores and types), 280,147 merges (Llama 3), chat templates of tens of KB. gguf-py parses an array
# item by item (tens of microseconds each), twice per first load: the item limits bound that time.
MAX_TENSORS = 65_536
MAX_KEYS = 4_096
MAX_NAME_BYTES = 256  # a metadata key or a tensor name (llama.cpp's own tensor-name limit is 64)
MAX_STRING_BYTES = 16 << 20  # one string value: a chat template, an embedded tokenizer.json
MAX_ARRAY_ITEMS = 65_536  # an array value, e.g. a per-layer setting
MAX_TOKENIZER_ITEMS = 1 << 19  # an array under tokenizer.*: the vocabulary, its scores, types, merges
MAX_ITEMS = 1 << 21  # the items of all arrays together (gguf-py and transformers parse each one apart)
TOKENIZER_PREFIX = "tokenizer."
MAX_DIMS = 4  # GGML_MAX_DIMS

# GGUF value types: struct format of the scalars (8: string, 9: array)
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
UINT32, STRING, ARRAY = 4, 8, 9
RESERVED = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count")  # gguf-py's names for the header fields
TYPE_NAMES = {
    0: "uint8",
    1: "int8",
    2: "uint16",
    3: "int16",
    4: "uint32",
    5: "int32",
    6: "float32",
    7: "bool",
    8: "string",
    9: "array",
    10: "uint64",
    11: "int64",
    12: "float64",
}


class HeaderError(ValueError):
    """The header is malformed or past a limit; the message says which key or tensor and why."""


@dataclass
class TensorInfo:
    name: str
    kind: str  # gguf-py's type name: F32, F16, BF16, Q4_1, Q6_K, ...
    shape: list[int]  # numpy order: [rows, in] for a matrix (GGUF's ne reversed)
    offset: int  # of its bytes in the file
    nbytes: int


@dataclass
class ArrayValue:
    """An array's item type and its items, read within the limits: a numpy array of the scalars, or a
    list of the strings."""

    item_type: int
    items: np.ndarray | list[str]

    @property
    def count(self) -> int:
        return len(self.items)


@dataclass
class Header:
    version: int
    metadata: dict[str, object]  # scalars and strings as values, arrays as `ArrayValue`
    types: dict[str, int]  # each key's GGUF value type
    tensors: list[TensorInfo]

    @property
    def arch(self) -> str:
        return self.metadata["general.architecture"]  # checked to be a string by `read`


def _quant_sizes() -> dict[int, tuple[str, int, int]]:
    """GGML type id -> (name, values per block, bytes per block), from gguf-py."""
    import gguf

    return {int(t): (t.name, *gguf.GGML_QUANT_SIZES[t]) for t in gguf.GGMLQuantizationType}


class _Cursor:
    """Bounded reads over the file's bytes; running out is a `HeaderError` saying where."""

    def __init__(self, data: mmap.mmap | bytes) -> None:
        self.data, self.pos, self.where = data, 0, "the header"
        self.items = 0  # array items read so far

    def skip(self, n: int) -> int:
        """Step over ``n`` bytes (checked to be there); returns where they start."""
        if n > len(self.data) - self.pos:
            raise HeaderError(
                f"its header is cut short at {len(self.data):,} bytes (in {self.where}; a truncated download?)"
            )
        self.pos += n
        return self.pos - n

    def take(self, n: int) -> bytes:
        start = self.skip(n)
        return self.data[start : start + n]  # a copy: no view outlives the memory map

    def scalar(self, fmt: str) -> int | float | bool:
        return struct.unpack_from("<" + fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self, what: str, limit: int = MAX_STRING_BYTES) -> str:
        n = self.scalar("Q")
        if n > limit:
            raise HeaderError(f"{what} is a string of {n:,} bytes (the limit is {limit:,})")
        raw = self.take(n)
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError:
            raise HeaderError(f"{what} is not valid UTF-8") from None


def _value(cur: _Cursor, key: str, vtype: int) -> object:
    """One metadata value of ``vtype``: scalars and strings decoded, arrays walked and counted."""
    what = f"metadata key {key!r}"
    if vtype in SCALARS:
        return cur.scalar(SCALARS[vtype])
    if vtype == STRING:
        return cur.string(what)
    if vtype != ARRAY:
        raise HeaderError(f"{what} has unknown value type {vtype} (GGUF's are 0-12)")
    item_type, count = cur.scalar("I"), cur.scalar("Q")
    limit = MAX_TOKENIZER_ITEMS if key.startswith(TOKENIZER_PREFIX) else MAX_ARRAY_ITEMS
    if count > limit:
        raise HeaderError(f"{what} is an array of {count:,} items (the limit is {limit:,})")
    cur.items += count
    if cur.items > MAX_ITEMS:
        raise HeaderError(f"its metadata arrays hold more than {MAX_ITEMS:,} items in all (at {what})")
    if item_type in SCALARS:
        dtype = np.dtype("<" + SCALARS[item_type])
        items = np.frombuffer(cur.take(count * dtype.itemsize), dtype)
    elif item_type == STRING:
        items = [cur.string(f"{what} item {i}") for i in range(count)]
    elif item_type == ARRAY:
        raise HeaderError(f"{what} is an array of arrays, which GGUF readers do not support")
    else:
        raise HeaderError(f"{what} is an array of unknown value type {item_type} (GGUF's are 0-12)")
    return ArrayValue(item_type, items)


def _tensor_info(cur: _Cursor, sizes: dict[int, tuple[str, int, int]]) -> tuple[str, list[int], int, int]:
    """(name, dims in GGUF order, type id, offset in the data section) of one tensor-info entry."""
    name = cur.string("a tensor name", MAX_NAME_BYTES)
    what = f"tensor {name!r}"
    cur.where = f"the info of {what}"
    n_dims = cur.scalar("I")
    if not 1 <= n_dims <= MAX_DIMS:
        raise HeaderError(f"{what} has {n_dims} dimensions (GGUF tensors have 1 to {MAX_DIMS})")
    dims = [cur.scalar("Q") for _ in range(n_dims)]
    kind = cur.scalar("I")
    offset = cur.scalar("Q")
    if kind not in sizes:
        raise HeaderError(f"{what} has unknown type {kind}")
    if 0 in dims:
        raise HeaderError(f"{what} has a dimension of 0 ({_shape(dims)})")
    type_name, block, _ = sizes[kind]
    if dims[0] % block:
        raise HeaderError(
            f"{what} of type {type_name} has rows of {dims[0]:,} values, not a multiple of its "
            f"{block}-value blocks"
        )
    return name, dims, kind, offset


def _shape(dims: list[int]) -> str:
    """GGUF dims (fastest first) as the numpy shape ``[rows, in]`` the errors and the index use."""
    return "[" + ", ".join(f"{d:,}" for d in reversed(dims)) + "]"


def read(path: Path) -> Header:
    """The header of ``path`` (whose first four bytes are the GGUF magic), checked within the limits."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    try:
        return _read(_Cursor(data), size)
    finally:
        if isinstance(data, mmap.mmap):
            data.close()


def _read(cur: _Cursor, size: int) -> Header:
    cur.skip(4)  # the magic, checked by the caller
    version = cur.scalar("I")
    if version not in VERSIONS:
        swapped = struct.unpack("<I", struct.pack(">I", version))[0]
        if swapped in VERSIONS:
            raise HeaderError("it is a big-endian GGUF file; pagedinfer reads little-endian ones")
        raise HeaderError(f"it is GGUF version {version}; pagedinfer reads versions 2 and 3")
    n_tensors, n_keys = cur.scalar("Q"), cur.scalar("Q")
    if n_tensors > MAX_TENSORS:
        raise HeaderError(f"it declares {n_tensors:,} tensors (the limit is {MAX_TENSORS:,})")
    if n_keys > MAX_KEYS:
        raise HeaderError(f"it declares {n_keys:,} metadata keys (the limit is {MAX_KEYS:,})")
    metadata: dict[str, object] = {}
    types: dict[str, int] = {}
    for i in range(n_keys):
        cur.where = f"metadata key {i + 1} of {n_keys}"
        key = cur.string(cur.where + "'s name", MAX_NAME_BYTES)
        cur.where = f"metadata key {key!r}"
        if key in metadata or key in RESERVED:
            raise HeaderError(
                f"metadata key {key!r} appears twice" if key in metadata else f"{key!r} is reserved"
            )
        types[key] = cur.scalar("I")
        metadata[key] = _value(cur, key, types[key])
    if types.get("general.architecture") != STRING:
        raise HeaderError("its metadata has no general.architecture string")
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    kind = types.get("general.alignment", UINT32)
    if kind != UINT32 or alignment == 0 or alignment & (alignment - 1):
        found = "an array" if kind == ARRAY else f"the {TYPE_NAMES.get(kind, kind)} {alignment!r}"
        raise HeaderError(f"general.alignment must be a uint32 power of two, not {found}")
    sizes = _quant_sizes()
    infos = []
    for i in range(n_tensors):
        cur.where = f"tensor {i + 1} of {n_tensors}'s info"
        infos.append(_tensor_info(cur, sizes))
    data_start = -(-cur.pos // alignment) * alignment
    tensors: list[TensorInfo] = []
    seen: set[str] = set()
    for name, dims, kind, offset in infos:
        what = f"tensor {name!r}"
        if name in seen:
            raise HeaderError(f"{what} appears twice")
        seen.add(name)
        if offset % alignment:
            raise HeaderError(
                f"{what} starts at offset {offset:,}, not a multiple of the alignment {alignment}"
            )
        type_name, block, block_bytes = sizes[kind]
        elements = 1
        for d in dims:
            elements *= d
        nbytes = elements // block * block_bytes
        start = data_start + offset
        if start + nbytes > size:
            raise HeaderError(
                f"its tensor data is cut short at {size:,} bytes: {what} {_shape(dims)} {type_name} "
                f"needs bytes {start:,} to {start + nbytes:,} (a truncated download?)"
            )
        tensors.append(TensorInfo(name, type_name, [int(d) for d in reversed(dims)], start, nbytes))
    return Header(version, metadata, types, tensors)
