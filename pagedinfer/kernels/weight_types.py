"""The weight types of the CPU GEMM's panels, declared once (as ggml's ``type_traits``).

`WEIGHT_TYPES` is the single declaration of every panel format: its id (the C enum's value, which the
ctypes bindings pass in ``gemm_segment.kind``), its name, its group and record layout, the GGUF block
it is read from, and the switches the C tiles branch on. Everything else is derived from it: the C
header ``kernels/cpu_weight_types.h`` (the enum, the X-macro lists of kinds and the ``fmt_*`` trait
functions; committed, written by ``python -m pagedinfer.kernels.weight_types``, and checked to be up
to date by tests/test_c_abi.py), the panel packer's `KINDS` and `LAYOUTS`, the GGUF reader's
`GGUF_BLOCKS` and the checker's `GGUF_SCALE_OFFSETS`. A new type is one entry here plus its kernel
code (the C group setup, and for a GGUF type the Python block splitter in model/gguf_blocks.py).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PANEL_ROWS = 16  # weight rows (output columns) per panel: the C NR; each record field holds 16 values

Fields = tuple[tuple[str, str], ...]  # (name, numpy dtype) of fields stored 16 at a time


@dataclass(frozen=True)
class RecordLayout:
    """One block format's records: its group length, the fields before each group's values (name and
    numpy dtype, 16 of each), the bits above the nibble stored as planes, and the super-block fields
    written before every ``super_groups`` groups (K-quants)."""

    group: int
    fields: Fields
    planes: int = 0
    super_groups: int = 1
    super_fields: Fields = ()
    int8_values: bool = False  # values stored as int8 bytes (Q8_0), not nibbles


@dataclass(frozen=True)
class WeightType:
    """One panel format. ``group``: k values per scale group (0: given per weight, int4's 32 or 128;
    None: no records, the values as they are: F32, BF16, I8). ``zero``: subtracted from every stored
    value (w = s * (q - zero)); ``direct``: the tiles read it from its nibbles in registers at one and
    two rows; ``avx2_split``: the AVX2 build multiplies MR + 1 to HR rows by half tiles that form
    each half panel once for all of them, then up to SPLIT_ROWS rows by blocks of MR rows through the
    in-register tiles (cpu_gemm_schedule.h), not through the buffer.
    ``gguf_block``/``gguf_bytes``: a GGUF type kept as stored, values and bytes per block;
    ``gguf_f16_scales``: the byte offsets of its float16 scale fields in a block. ``q8_dot``: llama.cpp's
    numerics serve it (integer dot products with int8 activations: cpu_gemm_q8dot.h). ``lookup``: each
    stored 4-bit value names its weight's multiple of the scale in a table of 16 (MXFP4's E2M1 values,
    doubled: cpu_gemm_formats.h's MXFP4_VALUES), not the value itself."""

    id: int
    name: str
    quantized: bool = True
    group: int | None = None
    fields: Fields = ()
    planes: int = 0
    super_groups: int = 1
    super_fields: Fields = ()
    int8_values: bool = False
    zero: int = 0
    direct: bool = False
    avx2_split: bool = False
    gguf_block: int = 0
    gguf_bytes: int = 0
    gguf_f16_scales: tuple[int, ...] = ()
    q8_dot: bool = False
    lookup: bool = False

    @property
    def layout(self) -> RecordLayout | None:
        """Its records' layout (None: no records)."""
        if self.group is None:
            return None
        return RecordLayout(
            self.group, self.fields, self.planes, self.super_groups, self.super_fields, self.int8_values
        )

    @property
    def head_bytes(self) -> int:
        """Bytes of a group record's scale fields."""
        return PANEL_ROWS * sum(np.dtype(t).itemsize for _, t in self.fields)

    @property
    def super_bytes(self) -> int:
        """Bytes of a super-block's header (K-quants), 0 where there is none."""
        return PANEL_ROWS * sum(np.dtype(t).itemsize for _, t in self.super_fields)

    @property
    def has_offset(self) -> bool:
        """w = q * s + m with a stored offset (m, or K-quants' dmin * mn)."""
        return any(name in ("m", "mn") for name, _ in self.fields)


D, M = ("d", "<u2"), ("m", "<u2")  # float16 scale and offset
K_FIELDS, K_SUPER = (("sc", "u1"), ("mn", "u1")), (("d", "<u2"), ("dmin", "<u2"))  # Q4_K's and Q5_K's

# fmt: off
WEIGHT_TYPES = (
    WeightType(0, "F32", quantized=False),
    WeightType(1, "BF16", quantized=False),
    WeightType(2, "I8", avx2_split=True, q8_dot=True),
    WeightType(3, "I4", group=0, fields=(("s", "<f4"),), zero=8, direct=True, q8_dot=True),
    WeightType(4, "I4Z", group=0, fields=(("s", "<f4"), ("z", "u1")), q8_dot=True),
    WeightType(5, "Q8_0", group=32, fields=(D,), int8_values=True, avx2_split=True,
               gguf_block=32, gguf_bytes=34, gguf_f16_scales=(0,), q8_dot=True),
    WeightType(6, "Q4_0", group=32, fields=(D,), zero=8, direct=True, avx2_split=True,
               gguf_block=32, gguf_bytes=18, gguf_f16_scales=(0,), q8_dot=True),
    WeightType(7, "Q4_1", group=32, fields=(D, M), direct=True, avx2_split=True,
               gguf_block=32, gguf_bytes=20, gguf_f16_scales=(0, 2), q8_dot=True),
    WeightType(8, "Q5_0", group=32, fields=(D,), planes=1, zero=16,
               gguf_block=32, gguf_bytes=22, gguf_f16_scales=(0,)),
    WeightType(9, "Q5_1", group=32, fields=(D, M), planes=1,
               gguf_block=32, gguf_bytes=24, gguf_f16_scales=(0, 2)),
    WeightType(10, "Q4_K", group=32, fields=K_FIELDS, super_groups=8, super_fields=K_SUPER, direct=True,
               gguf_block=256, gguf_bytes=144, gguf_f16_scales=(0, 2)),
    WeightType(11, "Q5_K", group=32, fields=K_FIELDS, planes=1, super_groups=8, super_fields=K_SUPER,
               gguf_block=256, gguf_bytes=176, gguf_f16_scales=(0, 2)),
    WeightType(12, "Q6_K", group=16, fields=(("sc", "i1"),), planes=2, super_groups=16, super_fields=(D,),
               zero=32, avx2_split=True, gguf_block=256, gguf_bytes=210, gguf_f16_scales=(208,)),
    WeightType(13, "MXFP4", group=32, fields=(("e", "u1"),), lookup=True, gguf_block=32, gguf_bytes=17),
)
# fmt: on
BY_NAME = {t.name: t for t in WEIGHT_TYPES}
KINDS = {t.name: t.id for t in WEIGHT_TYPES}  # the C enum's values (K_<name>)
LAYOUTS = {t.name: t.layout for t in WEIGHT_TYPES if t.layout is not None}  # the formats stored in records
GGUF_BLOCKS = {t.name: (t.gguf_block, t.gguf_bytes) for t in WEIGHT_TYPES if t.gguf_block}  # kept as stored
GGUF_SCALE_OFFSETS = {t.name: t.gguf_f16_scales for t in WEIGHT_TYPES if t.gguf_block}
Q8_DOT_KINDS = tuple(t.name for t in WEIGHT_TYPES if t.q8_dot)  # those llama.cpp's numerics serve
GGUF_Q8_DOT_KINDS = tuple(t for t in Q8_DOT_KINDS if t in GGUF_BLOCKS)  # of them, the GGUF types

HEADER = "cpu_weight_types.h"


def _kinds(of) -> str:
    """``K_A K_B ...`` of the types ``of`` selects, in id order, as X-macro arguments."""
    return " ".join(f"X(K_{t.name})" for t in WEIGHT_TYPES if of(t))


def _switch(signature: str, value, default: str) -> str:
    """An always-inline C function of ``int f`` returning ``value(type)`` (a C expression, or None for
    ``default``): one case line per distinct value, in id order."""
    cases: dict[str, list[str]] = {}
    for t in WEIGHT_TYPES:
        v = value(t)
        if v is not None and v != default:
            cases.setdefault(v, []).append(f"case K_{t.name}:")
    lines = [f"static inline __attribute__((always_inline)) {signature} {{", "    switch (f) {"]
    lines += [f"        {' '.join(labels)} return {v};" for v, labels in cases.items()]
    lines += [f"        default: return {default};", "    }", "}"]
    return "\n".join(lines)


def c_header() -> str:
    """The text of kernels/cpu_weight_types.h, derived from `WEIGHT_TYPES`."""
    assert [t.id for t in WEIGHT_TYPES] == list(range(len(WEIGHT_TYPES))), "ids are 0, 1, 2, ... in order"
    enum = "\n".join(f"    K_{t.name} = {t.id}," for t in WEIGHT_TYPES)
    parts = [
        "/* Generated by `python -m pagedinfer.kernels.weight_types` from pagedinfer/kernels/weight_types.py,",
        " * the one declaration of the panels' weight types: edit that table, not this file (tests/test_c_abi.py",
        " * checks that it is up to date). cpu_gemm_formats.h describes the bytes. */",
        "#ifndef PAGEDINFER_CPU_WEIGHT_TYPES_H",
        "#define PAGEDINFER_CPU_WEIGHT_TYPES_H",
        "",
        "enum {",
        enum,
        "    K_COUNT",
        "};",
        "",
        "/* X(kind) for every quantized kind: the per-kind instances of the tiles and their tables. */",
        f"#define QUANTIZED_KINDS(X) {_kinds(lambda t: t.quantized)}",
        "/* The kinds the AVX2 build multiplies past MR rows by half tiles, then MR-row blocks (SPLIT_ROWS). */",
        f"#define AVX2_SPLIT_KINDS(X) {_kinds(lambda t: t.avx2_split)}",
        "",
        "/* The group length (the format's scale block; g: int4's, given per weight); 0 without groups. */",
        _switch(
            "int fmt_group(int f, int g)",
            lambda t: None if t.group is None else ("g" if t.group == 0 else str(t.group)),
            "0",
        ),
        "/* Groups per super-block header (K-quants), 1 for the others. */",
        _switch("int fmt_super(int f)", lambda t: str(t.super_groups), "1"),
        "/* Bytes of a super-block header. */",
        _switch("int fmt_super_bytes(int f)", lambda t: str(t.super_bytes), "0"),
        "/* Bits above the nibble, stored as bit planes. */",
        _switch("int fmt_planes(int f)", lambda t: str(t.planes), "0"),
        "/* Read from the nibbles in registers (no offset to remove in int8, no bit planes). */",
        _switch("int fmt_direct(int f)", lambda t: str(int(t.direct)), "0"),
        "/* The constant subtracted from every stored value (w = s * (q - zero)), 0 for none. */",
        _switch("int fmt_zero(int f)", lambda t: str(t.zero), "0"),
        "/* Each stored value an index into the kind's table of 16 int8 values (MXFP4's). */",
        _switch("int fmt_lookup(int f)", lambda t: str(int(t.lookup)), "0"),
        "/* Bytes of a group record's scale fields. */",
        _switch("int fmt_head_bytes(int f)", lambda t: str(t.head_bytes), "0"),
        "/* w = q * s + m (an offset, or read direct with a zero: -zero * s), not q * s. */",
        _switch(
            "int fmt_has_min(int f, int direct)",
            lambda t: "1" if t.has_offset else ("direct" if t.direct and t.zero else None),
            "0",
        ),
        "",
        "#endif",
        "",
    ]
    return "\n".join(parts)


if __name__ == "__main__":  # write the C header beside the other kernel sources
    from pagedinfer.kernels.sources import KERNELS_DIR

    target = Path(sys.argv[1]) if len(sys.argv) > 1 else KERNELS_DIR / HEADER
    target.write_text(c_header())
    print(f"wrote {target}")
