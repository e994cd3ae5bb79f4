"""The weight formats of kernels/cpu_gemm.c's panels, and packing a weight into them.

A panel holds 16 weight rows (output columns) over all of ``in``, k-major. float32 and bfloat16
weights are packed as their values (`pack_float`); int8 (per output row) and int4 (per group of 32
or 128 inputs, float32 scales, optional zero points) are quantized here from float weights; GGUF
block types arrive as the file's values and scale fields (`pagedinfer.model.gguf_blocks`) and are
laid out here in records of one group each (kernels/cpu_gemm_formats.h describes the bytes; the
formats themselves are declared once, in pagedinfer/kernels/weight_types.py). Every
format keeps its quantized values as stored: 4.5-8.5 bits per weight instead of 32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedinfer.kernels.weight_types import LAYOUTS, PANEL_ROWS

PACK_CHUNK = 1 << 22  # weights `pack_float` gathers at a time


@dataclass
class Segment:
    """A run of a linear's output columns in one format: what cpu_gemm.c's gemm_segment points to."""

    kind: str  # a weight type's name (kernels/weight_types.py)
    cols: int  # output columns (the gated half's for a gated weight)
    panels: torch.Tensor  # [P, in, 16] float32 / int8, [P, in / 2, 32] bfloat16, or [P, bytes] uint8
    bias: torch.Tensor | None = None  # [P, 1, 16] float32, added to the sums
    scale: torch.Tensor | None = None  # I8: [P, 1, 16] float32, each column's scale
    group: int = 0  # I4's group length
    in_features: int = 0
    gated_pairs: bool = False  # a fused gate-up: cols is the half, the panels hold 2 * cols rows
    bf16_io: bool = False  # a quantized kind under bfloat16 activations (x and y bfloat16; BF16: always)
    q8_dot: bool = False  # a Q8_DOT_KINDS kind under llama.cpp's numerics (`matmul_numerics`)

    @property
    def activation_dtype(self) -> torch.dtype:
        """The dtype the kernel reads x and writes y in."""
        return torch.bfloat16 if self.kind == "BF16" or self.bf16_io else torch.float32

    @property
    def weights(self) -> int:
        return self.cols * (2 if self.gated_pairs else 1) * self.in_features

    @property
    def nbytes(self) -> int:
        """Bytes of the weight's panels and scales (not the bias)."""
        scale = 0 if self.scale is None else self.scale.numel() * 4
        return self.panels.numel() * self.panels.element_size() + scale


def panel_order(out: int, gated: bool) -> np.ndarray:
    """``[P * 16]`` the weight row of each panel row, -1 for padding. ``gated``: panel j holds gate rows
    8j..8j+7, then the up rows of the same index (the halves of ``[2 I, in]``)."""
    if not gated:
        rows = np.arange(-(-out // PANEL_ROWS) * PANEL_ROWS)
        return np.where(rows < out, rows, -1)
    half, inter = PANEL_ROWS // 2, out // 2
    j = np.arange(-(-inter // half))[:, None, None]  # [P, 1, 1]
    part = np.arange(2)[None, :, None]  # gate, up
    i = j * half + np.arange(half)[None, None, :]  # [P, 1, 8] index within a half
    return np.where(i < inter, part * inter + i, -1).reshape(-1)  # [P * 16]


def _take_rows(a: np.ndarray, order: np.ndarray) -> np.ndarray:
    """``a[order]`` with zeros where order is -1 (padding rows)."""
    padded = np.concatenate([a, np.zeros((1, *a.shape[1:]), a.dtype)])
    return padded[np.where(order < 0, len(a), order)]


def _columns(a: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Per-row fields ``[out, n]`` as panel bytes ``[P, n, 16 * itemsize]``: each panel's 16 values of a field."""
    f = _take_rows(a, order)  # [P * 16, n]
    f = f.reshape(-1, PANEL_ROWS, f.shape[1]).transpose(0, 2, 1)  # [P, n, 16]
    return np.ascontiguousarray(f).view(np.uint8)  # [P, n, 16 * itemsize]


def pack_records(
    kind: str,
    values: np.ndarray,  # [out, in] uint8 (the stored values: 0-15, 0-31, 0-63) or int8 (Q8_0)
    fields: dict[str, np.ndarray],  # each [out, groups] (super fields: [out, super-blocks])
    gated: bool = False,
    group: int = 0,
) -> np.ndarray:  # [P, panel bytes] uint8
    """The records of a block-format weight, as cpu_gemm_formats.h reads them."""
    layout = LAYOUTS[kind]
    g = layout.group or group
    out, k = values.shape
    order = panel_order(out, gated)
    groups = -(-k // g)
    v = _take_rows(values, order).reshape(-1, PANEL_ROWS, k).transpose(0, 2, 1)  # [P, in, 16]
    p = v.shape[0]
    if groups * g != k:  # a short last group (int4 only): zero-padded here, cut below
        v = np.concatenate([v, np.zeros((p, groups * g - k, PANEL_ROWS), v.dtype)], axis=1)
    v = v.reshape(p, groups, g * PANEL_ROWS)  # [P, groups, 16 g]: value i = 16 kk + column
    if layout.int8_values:
        body = [v.view(np.uint8)]
    else:
        chunks = v.reshape(p, groups, g // 4, 64)  # 4 k per chunk
        nib = chunks & 15
        body = [(nib[..., :32] | (nib[..., 32:] << 4)).reshape(p, groups, -1).astype(np.uint8)]
        for bit in range(4, 4 + layout.planes):
            plane = np.packbits((chunks >> bit) & 1, axis=-1, bitorder="little")  # [P, groups, g / 4, 8]
            body.append(plane.reshape(p, groups, -1))
    head = [_columns(np.asarray(fields[name], dtype), order) for name, dtype in layout.fields]
    records = np.concatenate([*head, *body], axis=-1)  # [P, groups, record bytes]
    if groups * g != k:
        rest = k - (groups - 1) * g
        full = records[:, :-1].reshape(p, -1)
        last = np.concatenate([*(h[:, -1] for h in head), body[0][:, -1, : -(-rest // 4) * 32]], axis=-1)
        return np.concatenate([full, last], axis=-1)
    if layout.super_fields:
        supers = groups // layout.super_groups
        sup = [_columns(np.asarray(fields[name], dtype), order) for name, dtype in layout.super_fields]
        records = np.concatenate([*sup, records.reshape(p, supers, -1)], axis=-1)  # [P, supers, bytes]
    return np.ascontiguousarray(records.reshape(p, -1))


def pack_float(weight: torch.Tensor, gated: bool = False) -> torch.Tensor:
    """``[out, in]`` -> ``[P, in, 16]``: 16 weight rows per panel (zero past ``out``), k-major; bfloat16
    with k in pairs for vdpbf16ps (``[P, in / 2, 32]`` in memory order). ``gated``: see `panel_order`."""
    order = torch.from_numpy(panel_order(weight.shape[0], gated))  # [P * 16]: a row, or -1 (zeros)
    k = weight.shape[1]
    out = weight.new_empty(order.numel() // PANEL_ROWS, k, PANEL_ROWS)  # [P, in, 16]
    # panels packed a chunk at a time: beside the weight, the packed copy and one chunk's rows only
    step = max(1, PACK_CHUNK // (PANEL_ROWS * k))
    for first in range(0, out.shape[0], step):
        picked = order[first * PANEL_ROWS : (first + step) * PANEL_ROWS]
        rows = weight[picked.clamp(min=0)]  # [n * 16, in]
        rows[picked < 0] = 0
        panels = rows.view(-1, PANEL_ROWS, k).transpose(1, 2)  # [n, in, 16]
        if weight.dtype == torch.bfloat16:  # k in pairs: [n, in / 2, 16, 2]
            panels = panels.reshape(panels.shape[0], -1, 2, PANEL_ROWS).transpose(2, 3)
        out[first : first + step] = panels.reshape(panels.shape[0], -1, PANEL_ROWS)
    return out


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight-only int8, symmetric per output row: ``q = round(w / s)`` with ``s = max|w_row| / 127``.

    ``[out, in]`` float32 -> ``q [out, in]`` int8, ``s [out]`` float32 (1 for an all-zero row). The
    GEMM uses ``q * s``, each weight within ``s / 2`` of its float32 value."""
    scale = weight.abs().amax(dim=1) / 127  # [out]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(weight / scale.unsqueeze(1)).clamp_(-127, 127).to(torch.int8)  # [out, in]
    return q, scale


def quantize_int4(
    weight: torch.Tensor, group: int, zero_points: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Weight-only int4 per group of ``group`` inputs of a row (the last group shorter if ``in`` is not a
    multiple): ``q`` in 0..15 with ``w ~ s * (q - z)``. Symmetric (``zero_points`` False): ``z = 8``,
    ``s = max|w| / 7``, q in 1..15 (round(w / s) + 8); with zero points: ``s = (max - min) / 15``,
    ``z = round(-min / s)`` in 0..15, q = round(w / s) + z clamped to 0..15.

    ``[out, in]`` float32 -> ``q [out, in]`` uint8, ``s [out, groups]`` float32 (1 for an all-zero
    group), ``z [out, groups]`` uint8 or None. The GEMM uses ``(q - z) * s`` in float32
    (`dequantize_int4`)."""
    out, k = weight.shape
    groups = -(-k // group)
    w = torch.nn.functional.pad(weight.float(), (0, groups * group - k)).view(out, groups, group)
    if zero_points:
        lo, hi = w.amin(dim=2).clamp(max=0), w.amax(dim=2).clamp(min=0)  # [out, groups]: 0 representable
        scale = (hi - lo) / 15
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        zero = torch.round(-lo / scale).clamp_(0, 15)
    else:
        scale = w.abs().amax(dim=2) / 7
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        zero = torch.full_like(scale, 8)
    q = (torch.round(w / scale.unsqueeze(2)) + zero.unsqueeze(2)).clamp_(0, 15)  # [out, groups, group]
    q = q.reshape(out, -1)[:, :k].to(torch.uint8)
    return q, scale, zero.to(torch.uint8) if zero_points else None


def dequantize_int4(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group: int
) -> torch.Tensor:
    """``(q - z) * s`` per group in float32: the values the int4 panels multiply by. [out, in]."""
    z = torch.full_like(scale, 8) if zero is None else zero.float()
    idx = torch.arange(q.shape[1]) // group  # [in] each input's group
    return (q.float() - z[:, idx]) * scale[:, idx]


def pack_int4(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group: int, gated: bool
) -> np.ndarray:
    """int4 values and their group fields in I4 (symmetric) or I4Z records ``[P, bytes]``."""
    fields = {"s": scale.numpy()}
    if zero is not None:
        fields["z"] = zero.numpy()
    return pack_records("I4" if zero is None else "I4Z", q.numpy(), fields, gated, group)


def bits_per_weight(segments: list[Segment]) -> float:
    """The panels' bits per real weight (scale fields included, panel padding too)."""
    weights = sum(s.weights for s in segments)
    return 8 * sum(s.nbytes for s in segments) / weights if weights else 0.0
