"""GGUF's quantized blocks read apart into their stored values and scale fields, for the panels.

Each GGUF type stores a row of ``in`` weights as blocks of 32 (or 256 for K-quants): float16 scales
(MXFP4: an E8M0 exponent byte), packed 4-8 bit values, and K-quants' 6-bit sub-block scales.
`split_blocks` returns, for a tensor's rows, the values as they are stored (one byte each, before
any offset: 0-15 for 4 bits, 0-31 for 5, 0-63 for 6; int8 for Q8_0; MXFP4's 4-bit indexes of E2M1
values) and the fields per row and group that kernels/cpu_gemm_formats.h turns into float32 scales
exactly as gguf-py's dequantizer computes them (``gguf.quants``), so the panels multiply by the same
weights a dequantized model holds. The bit layouts below follow gguf-py's ``dequantize_blocks`` of each type (MXFP4's also llama.cpp's ``dequantize_row_mxfp4``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from pagedinfer.kernels.weight_types import GGUF_BLOCKS

if TYPE_CHECKING:
    from pagedinfer.model.panel_cache import PanelCache

BLOCKS = GGUF_BLOCKS  # the GGUF types the panels keep as stored: (block length, bytes per block)


@dataclass
class GGUFWeight:
    """A linear weight as a GGUF file stores it: rows of blocks of one type."""

    kind: str  # a BLOCKS key
    data: np.ndarray  # [out, row bytes] uint8 (a view of the memory-mapped file, or a copy)
    in_features: int
    release: Callable[[], None] | None = None  # drops the file's pages once the blocks are packed
    bf16_io: bool = False  # multiplied under bfloat16 activations (the run's dtype), else float32
    name: str = ""  # the file's tensor it was read from ("blk.0.attn_q.weight", "...[2]" for an expert)
    panels: PanelCache | None = None  # where its panels may be stored already (`packed_linear.gguf_segment`)

    @property
    def out_features(self) -> int:
        return self.data.shape[0]


def concat(parts: list[GGUFWeight]) -> list[GGUFWeight]:
    """Row-concatenate consecutive parts of the same type (a fused QKV or gate-up): one weight per run."""
    runs: list[list[GGUFWeight]] = []
    for part in parts:
        if runs and runs[-1][0].kind == part.kind:
            runs[-1].append(part)
        else:
            runs.append([part])
    out = []
    for run in runs:
        if len(run) == 1:
            out.append(run[0])
            continue
        releases = [p.release for p in run if p.release]
        data = np.concatenate([p.data for p in run])
        out.append(
            GGUFWeight(
                run[0].kind, data, run[0].in_features, lambda r=releases: [f() for f in r], run[0].bf16_io
            )
        )
    return out


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """``[n, B]`` bytes -> ``[n, 2 B]``: for each run of ``width`` bytes, their low nibbles, then high."""
    n = qs.shape[0]
    runs = qs.reshape(n, -1, 1, width) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (runs & 15).reshape(n, -1)


def _bits(qh: np.ndarray, width: int) -> np.ndarray:
    """``[n, W]`` bytes -> ``[n, 8 W]``: bit b of each byte, for b = 0..7, runs of ``width`` bytes each."""
    n = qh.shape[0]
    return ((qh.reshape(n, 1, width) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1).reshape(n, -1)


def _scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit minimums (gguf-py's get_scale_min)."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn  # [n, 8] each


def split_blocks(kind: str, data: np.ndarray, in_features: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """``data [out, row bytes]`` of type ``kind`` -> ``values [out, in]`` and its fields, each ``[out, n]``
    (per group of the panels' layout, or per 256-block for K-quants' d and dmin)."""
    block, size = BLOCKS[kind]
    out = data.shape[0]
    if data.shape[1] != in_features // block * size or in_features % block:
        raise ValueError(
            f"a {kind} row of {in_features} weights is not {data.shape[1]} bytes of {block}-blocks"
        )
    b = np.ascontiguousarray(data).reshape(-1, size)  # [out * blocks, size]
    rows = lambda a: a.reshape(out, -1)  # noqa: E731 - per block -> per row
    half = lambda a: rows(a.view("<u2"))  # noqa: E731 - float16 bits
    if kind == "Q8_0":
        return rows(b[:, 2:].view(np.int8)), {"d": half(b[:, :2])}
    if kind == "Q4_0":
        return rows(_nibbles(b[:, 2:], 16)), {"d": half(b[:, :2])}
    if kind == "Q4_1":
        return rows(_nibbles(b[:, 4:], 16)), {"d": half(b[:, :2]), "m": half(b[:, 2:4])}
    if kind in ("Q5_0", "Q5_1"):
        head = 2 if kind == "Q5_0" else 4
        high = _bits(b[:, head : head + 4], 4)  # [n, 32]: bit j of the 32-bit qh
        high = high.reshape(-1, 8, 4).transpose(0, 2, 1).reshape(-1, 32)  # value j = byte j // 8, bit j % 8
        values = _nibbles(b[:, head + 4 :], 16) | (high << 4)
        fields = {"d": half(b[:, :2])} | ({"m": half(b[:, 2:4])} if kind == "Q5_1" else {})
        return rows(values), fields
    if kind in ("Q4_K", "Q5_K"):
        sc, mn = _scale_min_k4(b[:, 4:16])
        values = _nibbles(b[:, -128:], 32)  # [n, 256]: chunk c = low nibbles of 32 bytes, then high
        if kind == "Q5_K":
            values = values | (_bits(b[:, 16:48], 32) << 4)  # [n, 256]: sub-block i takes bit i
        fields = {"d": half(b[:, :2]), "dmin": half(b[:, 2:4]), "sc": rows(sc), "mn": rows(mn)}
        return rows(values), fields
    if kind == "Q6_K":
        low = _nibbles(b[:, :128], 64)  # [n, 256]
        n = b.shape[0]
        high = (
            b[:, 128:192].reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
        ) & 3
        values = low | (high.reshape(n, -1) << 4)
        return rows(values), {"sc": rows(b[:, 192:208].view(np.int8)), "d": half(b[:, 208:210])}
    if kind == "MXFP4":  # e: the E8M0 exponent byte; values: indexes into E2M1's 16 (kvalues_mxfp4)
        return rows(_nibbles(b[:, 1:], 16)), {"e": rows(b[:, :1])}
    raise ValueError(f"GGUF type {kind} is not kept as stored")
