"""What the C kernels and their Python callers agree on besides each function's arguments: the refusal
record a kernel fills instead of reading or writing out of range (kernels/cpu_bounds.h) and its codes,
the debug build's shape checks, and the dtype suffixes of the kernels' names."""

from __future__ import annotations

import ctypes
import functools

import torch

from pagedinfer import envs

SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}  # kernel names' suffixes


class IndexOutOfRange(IndexError):
    """A C kernel refused an index outside the buffer it indexes (nothing was read or written through
    it): a token id past an embedding's rows, a slot or block id past the KV pool, a context longer
    than its block table, a row past its tensor. The message names it and the bound."""


class Refusal(ctypes.Structure):  # kernels/cpu_bounds.h: refusal
    _fields_ = [("at", ctypes.c_int64), ("found", ctypes.c_int64), ("limit", ctypes.c_int64)]


# kernels/cpu_bounds.h's REFUSED_* codes: what was out of range, said with the refusal's fields
REFUSED = {
    1: "the slot {found} of new token {at} is outside the KV pool's {limit} slots",
    2: "sequence {at}'s block table names block {found}, outside the KV pool's {limit} blocks",
    3: "sequence {at}'s context of {found} tokens is outside its block table's {limit} slots",
    4: "sequence {at}'s query row {found} is outside the {limit} query rows",
    5: "thread range {at} ends at sequence {found}, outside the {limit} sequences",
    6: "id {found} at position {at} is outside the table's {limit} rows",
    7: "logits row {found} (entry {at}) is outside the {limit} rows",
    8: "rows {at}:{found} are not a range of the {limit} rows",
    9: "expert {found} chosen at slot {at} is outside the layer's {limit} experts",
}


@functools.cache
def debug() -> bool:
    """The kernels' debug build (``PAGEDINFER_KERNEL_DEBUG=1``, read once as each library is loaded
    once): the bindings then assert the shapes their callers vouch for, per call (else they cost
    microseconds a call, and a layer-by-layer step makes a dozen calls a layer)."""
    return envs.kernel_debug()


def check(code: int, refusal: Refusal, kernel: str) -> None:
    """Raise `IndexOutOfRange` where a kernel returned a refusal ``code`` (0: it ran)."""
    if code:
        what = REFUSED[code].format(at=refusal.at, found=refusal.found, limit=refusal.limit)
        raise IndexOutOfRange(f"{kernel}: {what}")
