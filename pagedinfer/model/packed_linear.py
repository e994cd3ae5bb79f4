"""CPU linears with their weights packed once for oneDNN instead of re-laid out on every call.

A decode step multiplies a few dozen rows by each weight; MKL's sgemm re-lays the whole weight out
per call, which costs about as much as the multiply itself at that size. oneDNN's prepacked
weights skip that re-layout, so `pack_linears` swaps each ``nn.Linear`` of a loaded CPU float32
or bfloat16 model for a `PackedLinear`.

float32 linears go through kernels/cpu_gemm.c instead, on a weight laid out once in 16-row panels:
at decode batch sizes a step streams every weight from memory, and oneDNN streams a packed weight
well below the memory's rate there, while the panel kernel streams it near memory speed, and past
its register tiles' rows its wide tiles keep the FMA units busy. The panels are also what the
one-call decode step (decode_step.py) needs. One copy of the weight either way.
``PAGEDINFER_CPU_GEMM=panels`` / ``=onednn`` forces one. (Measurements per CPU: docs/kernels.md.)

bfloat16 linears take the same panels, with k in pairs for vdpbf16ps (where ``in`` is even): the bits
equal oneDNN's bfloat16 products on an AVX512-BF16 CPU, and they let a bfloat16 decode step run in
one C call. A kernel built without AVX512-BF16 (an AVX2 or AVX-512F CPU) takes the same products in
the same order with two fused multiply-adds per pair, lane for lane the instruction's bits, so a
bfloat16 model computes the same bits on every CPU (docs/reproducibility.md). Where the CPU has AMX
and the kernel was built for it, 8 rows and more run on the tiles from the same panels.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from torch import nn

from pagedinfer.config import Quantization
from pagedinfer.kernels.abi import Refusal, check, debug
from pagedinfer.kernels.build import optional_library
from pagedinfer.kernels.sources import KERNELS_DIR
from pagedinfer.kernels.weight_types import KINDS, Q8_DOT_KINDS
from pagedinfer.model import gguf_blocks, panel_formats
from pagedinfer.model.dtype import cpu_bf16_flags, dtype_name
from pagedinfer.model.fused_ops import GatedLinear, gated
from pagedinfer.model.gguf_blocks import GGUFWeight
from pagedinfer.model.panel_formats import Segment

GEMM_SOURCE = KERNELS_DIR / "cpu_gemm.c"
ROWS_HINT = 2048  # the row count oneDNN picks its weight layout for; it serves any row count
MIN_WEIGHTS = 1 << 17  # under oneDNN smaller weights stay with MKL: oneDNN's cost a call outweighs its gain
MADV_DONTNEED = 4  # madvise(2): drop these pages


class GemmSegment(ctypes.Structure):  # kernels/cpu_gemm.c: gemm_segment
    _fields_ = [
        ("kind", ctypes.c_int),
        ("group", ctypes.c_int),
        ("cols", ctypes.c_int),
        ("panels", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("scale", ctypes.c_void_p),
        ("bf16_io", ctypes.c_int),
        ("q8_dot", ctypes.c_int),
    ]


def c_segment(s: Segment, into: GemmSegment | None = None) -> GemmSegment:
    """``s`` as cpu_gemm.c reads it (pointers into its tensors: keep ``s`` alive)."""
    c = into if into is not None else GemmSegment()
    c.kind, c.group, c.cols = KINDS[s.kind], s.group, s.cols
    c.panels = s.panels.data_ptr()
    c.bias = None if s.bias is None else s.bias.data_ptr()
    c.scale = None if s.scale is None else s.scale.data_ptr()
    c.bf16_io = int(s.bf16_io)
    c.q8_dot = int(s.q8_dot)
    return c


def check_panels(s: Segment) -> None:
    """Refuse a segment whose panels (or bias, scales) are not the size its columns and input width make
    in the kernel's layout: the kernels index them by column and k alone, so a short one would be read
    past its end (ValueError naming both sizes)."""
    lib = _gemm_library()
    if lib is None:  # no kernel to read them
        return
    rows = s.cols * (2 if s.gated_pairs else 1)
    panels = -(-rows // panel_formats.PANEL_ROWS)
    need = panels * lib.gemm_panel_bytes(KINDS[s.kind], s.in_features, s.group)
    have = s.panels.numel() * s.panels.element_size()
    floats = [(name, t.numel()) for name, t in (("bias", s.bias), ("scales", s.scale)) if t is not None]
    if have != need or any(n != panels * panel_formats.PANEL_ROWS for _, n in floats):
        found = ", ".join([f"{have} bytes of panels"] + [f"{n} {name}" for name, n in floats])
        raise ValueError(
            f"{s.kind} weight of {rows} rows x {s.in_features}: the kernel reads {need} bytes of panels"
            f" ({panels} panels) and {panels * panel_formats.PANEL_ROWS} values of bias and scales; found {found}"
        )


class PackedLinear(nn.Module):
    """``nn.Linear`` forward on a weight laid out once for a faster GEMM; inference only.

    ``panels``: the weight in kernels/cpu_gemm.c's panels (float32; bfloat16 with an even ``in``);
    otherwise (or for another dtype, or where that kernel did not build) oneDNN's prepacked layout.
    ``quantization``: the weight quantized to int8 or int4 panels, under ``activations`` (float32, the
    default, or bfloat16).
    ``segments``: panels already made (a GGUF's blocks, `from_segments`). A `GatedLinear` stays
    gated: its output is ``silu(gate) * up``, computed by the panel kernel as it writes the product.
    """

    def __init__(
        self,
        linear: nn.Linear,
        panels: bool = False,
        quantization: Quantization | None = None,
        segments: list[Segment] | None = None,
        activations: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.gated = isinstance(linear, GatedLinear)
        self.packed = self.bias = None
        self._natural: torch.Tensor | None = None  # see _natural_columns
        if segments is not None:
            self._set_segments(segments)
            return
        weight = linear.weight.detach().contiguous()  # [out, in]
        bias = None if linear.bias is None else linear.bias.detach()  # [out]
        if quantization is not None and not panel_dtype(activations, self.in_features):
            need = (
                "the panel kernel (a C compiler)"
                if activations == torch.float32
                else f"an even input width (this linear takes {self.in_features})"
            )
            raise ValueError(
                f"{quantization.name} weights under {dtype_name(activations)} activations need {need}"
            )
        if quantization is None and not (panels and panel_dtype(weight.dtype, self.in_features)):
            self.segments = None
            self.bias = None if bias is None else bias.clone()  # [out]
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, ROWS_HINT)  # opaque oneDNN layout
            return
        bf16_io = quantization is not None and activations == torch.bfloat16
        self._set_segments([quantized_segment(weight, bias, self.gated, quantization, bf16_io)])

    @classmethod
    def from_segments(
        cls, in_features: int, out_features: int, gated: bool, segments: list[Segment]
    ) -> PackedLinear:
        """A linear on panels already made: ``segments`` cover the output columns in order (a gated one:
        one segment of paired panels, or the gate's and the up's segments, multiplied apart)."""
        shell = (GatedLinear if gated else nn.Linear)(in_features, out_features, bias=False, device="meta")
        return cls(shell, segments=segments)

    def _set_segments(self, segments: list[Segment]) -> None:
        assert all(s.in_features == self.in_features for s in segments), "segments of another input width"
        assert sum(s.cols * (2 if s.gated_pairs else 1) for s in segments) == self.out_features
        for segment in segments:
            check_panels(segment)
        self.segments = segments
        self.paired = self.gated and len(segments) == 1  # the kernel writes silu(gate) * up itself
        self._c = (GemmSegment * len(segments))()  # what the kernel reads, built once
        for c, s in zip(self._c, segments, strict=True):
            c_segment(s, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out] ([..., out / 2] gated)
        x = x.contiguous()
        if self.segments is None:
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
            return gated(y) if self.gated else y  # [..., out] or [..., out / 2]
        if x.dtype != self.activation_dtype:  # the kernel reads x as that type
            raise TypeError(f"PackedLinear: input is {x.dtype}, the kernel takes {self.activation_dtype}")
        if x.shape[-1] != self.in_features:  # the kernel reads in_features values a row, writes a row each
            raise ValueError(
                f"PackedLinear: input rows of {x.shape[-1]} values, the weight takes {self.in_features}"
            )
        width = self.out_features // 2 if self.paired else self.out_features
        y = x.new_empty(*x.shape[:-1], width)
        _gemm_library().gemm_segments(
            self._c,
            len(self.segments),
            x.data_ptr(),
            y.data_ptr(),
            x.numel() // self.in_features,
            self.in_features,
            int(self.paired),
        )
        return gated(y) if self.gated and not self.paired else y

    def ungated(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]: gate columns, then up
        """A gated linear's product before ``silu(gate) * up`` (LoRA adds its deltas there first)."""
        x = x.contiguous()
        if self.segments is None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if not self.paired:  # the gate's and the up's segments write their own columns
            y = x.new_empty(x.shape[0], self.out_features)
            _gemm_library().gemm_segments(
                self._c, len(self.segments), x.data_ptr(), y.data_ptr(), x.shape[0], self.in_features, 0
            )
            return y
        # paired panels multiplied as plain ones: every panel's 16 columns in panel order, then reordered
        seg = c_segment(self.segments[0])
        seg.cols = self.segments[0].panels.shape[0] * panel_formats.PANEL_ROWS
        y = x.new_empty(x.shape[0], seg.cols)  # [T, P * 16]
        _gemm_library().gemm_segments(
            ctypes.byref(seg), 1, x.data_ptr(), y.data_ptr(), x.shape[0], self.in_features, 0
        )
        return y[:, self._natural_columns()]  # [T, 2 I]

    def _natural_columns(self) -> torch.Tensor:
        """``[2 I]``: for each gate / up output, its column in the paired panels' plain product."""
        if self._natural is None:
            order = torch.from_numpy(panel_formats.panel_order(self.out_features, True))  # [P * 16]
            where = torch.nonzero(order >= 0).squeeze(1)
            self._natural = torch.empty(self.out_features, dtype=torch.int64)
            self._natural[order[where]] = where
        return self._natural

    @property
    def activation_dtype(self) -> torch.dtype:
        """The dtype of inputs and outputs: bfloat16 for bfloat16 panels and quantized ones under bfloat16
        activations, float32 for the others."""
        return self.segments[0].activation_dtype if self.segments else torch.float32

    @property
    def kinds(self) -> list[str]:
        """The panels' formats, one per segment ([] in oneDNN's layout)."""
        return [s.kind for s in self.segments or []]

    def extra_repr(self) -> str:
        layout = f"cpu_gemm.c panels ({', '.join(self.kinds)})" if self.segments else "oneDNN"
        gated = ", silu(gate) * up" if self.gated else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, packed={layout}{gated}"


def use_llamacpp_numerics(model: nn.Module) -> int:
    """Put every Q4_0, Q4_1, Q8_0, int8 and int4 segment (`Q8_DOT_KINDS`) of the model's packed linears
    under float32 activations with an input width a multiple of 32 on llama.cpp's numerics (activations
    quantized per block of 32 to int8, integer dot products: kernels/cpu_gemm_q8dot.h) at every row count;
    the other segments keep theirs. How many it put."""
    count = 0
    for linear in model.modules():
        if not isinstance(linear, PackedLinear) or not linear.segments:
            continue
        for c, s in zip(linear._c, linear.segments, strict=True):
            if s.kind in Q8_DOT_KINDS and not s.bf16_io and s.in_features % 32 == 0:
                s.q8_dot = True
                c_segment(s, c)
                count += 1
    return count


def ungated(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, 2 I]
    """A fused gate-up linear's product before the activation, gate columns first (packed or not)."""
    if isinstance(linear, PackedLinear):
        return linear.ungated(x)
    return nn.functional.linear(x, linear.weight, linear.bias)


def quantized_segment(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gated: bool,
    quantization: Quantization | None,
    bf16_io: bool = False,
) -> Segment:
    """A float weight ``[out, in]`` (+ bias ``[out]``) as one segment of panels: float32 / bfloat16 as
    they are, or quantized to int8 or int4 from its values (multiplied under bfloat16 activations with
    ``bf16_io``, else float32)."""
    out, k = weight.shape
    cols = out // 2 if gated else out
    if bias is not None and bf16_io:  # as a bfloat16 linear holds it
        bias = bias.to(torch.bfloat16)
    packed_bias = (
        None if bias is None else panel_formats.pack_float(bias.float().unsqueeze(1), gated)
    )  # [P, 1, 16]
    if quantization is None:
        kind = "BF16" if weight.dtype == torch.bfloat16 else "F32"
        return Segment(
            kind, cols, panel_formats.pack_float(weight, gated), packed_bias, in_features=k, gated_pairs=gated
        )
    if quantization.bits == 8:
        q, scale = _by_rows(panel_formats.quantize_int8, weight)  # [out, in] int8, [out] float32
        return Segment(
            "I8",
            cols,
            panel_formats.pack_float(q, gated),
            packed_bias,
            panel_formats.pack_float(scale.unsqueeze(1), gated),
            in_features=k,
            gated_pairs=gated,
            bf16_io=bf16_io,
        )
    q, scale, zero = _by_rows(  # [out, in] uint8, [out, groups] float32, [out, groups] uint8 or None
        lambda w: panel_formats.quantize_int4(w, quantization.group, quantization.zero_points), weight
    )
    records = panel_formats.pack_int4(q, scale, zero, quantization.group, gated)  # [P, bytes]
    kind = "I4Z" if quantization.zero_points else "I4"
    return Segment(
        kind,
        cols,
        torch.from_numpy(records),
        packed_bias,
        group=quantization.group,
        in_features=k,
        gated_pairs=gated,
        bf16_io=bf16_io,
    )


def _by_rows(quantize, weight: torch.Tensor, rows: int = 4096) -> tuple:
    """``quantize`` (each row on its own) over ``weight`` ``[out, in]`` in float32, ``rows`` rows at a
    time, its outputs concatenated: the same values without float temporaries of the whole weight
    (three of 113 MB for a 49152-row lm_head, on top of the load's peak)."""
    parts = [quantize(weight[i : i + rows].float()) for i in range(0, weight.shape[0], rows)]
    return tuple(None if p[0] is None else torch.cat(p) for p in zip(*parts, strict=True))


def gguf_segment(parts: list[GGUFWeight], bias: torch.Tensor | None, gated: bool) -> Segment:
    """Row-concatenated GGUF weights of one type (q, k, v; gate, up; or one) as one segment of panels in
    that type: the panels stored for them already (their `panel_cache.PanelCache`), else packed from
    their blocks; the file's pages dropped after."""
    w = parts[0]
    rows = sum(p.out_features for p in parts)

    def pack() -> np.ndarray:  # [P, panel bytes]
        (whole,) = gguf_blocks.concat(parts)
        values, fields = gguf_blocks.split_blocks(
            w.kind, whole.data, w.in_features
        )  # [out, in] stored values
        return panel_formats.pack_records(w.kind, values, fields, gated)

    lib = _gemm_library()
    if w.panels is None or lib is None:
        records = torch.from_numpy(pack())
    else:  # named by the file's tensors and how they are laid out
        name = "+".join(p.name for p in parts) + (" gated" if gated else "")
        panels = -(-rows // panel_formats.PANEL_ROWS)
        shape = (panels, int(lib.gemm_panel_bytes(KINDS[w.kind], w.in_features, 0)))
        records = w.panels.records(name, shape, pack)
    for p in parts:
        if p.release is not None:
            p.release()
    packed_bias = None if bias is None else panel_formats.pack_float(bias.float().unsqueeze(1), gated)
    cols = rows // 2 if gated else rows
    return Segment(
        w.kind, cols, records, packed_bias, in_features=w.in_features, gated_pairs=gated, bf16_io=w.bf16_io
    )


def library_name() -> str:
    """The panel kernel library's file (named by its sources, flags and CPU), "" where none built."""
    lib = _gemm_library()
    return "" if lib is None else Path(lib._name).name


def gguf_linear(
    parts: list[torch.Tensor | GGUFWeight], biases: list[torch.Tensor | None], gated: bool
) -> PackedLinear:
    """A linear over row-concatenated parts of a GGUF (q, k, v; gate, up; or one weight), each run of one
    type one segment (float parts, dequantized or float in the file, in panels of the run's dtype:
    float32, or bfloat16 where the blocks are multiplied under bfloat16 activations). A gated
    pair of one type becomes paired panels (silu(gate) * up in the kernel); of two types, two
    segments multiplied apart."""
    k = parts[0].in_features if isinstance(parts[0], GGUFWeight) else parts[0].shape[1]
    rows = sum(p.out_features if isinstance(p, GGUFWeight) else p.shape[0] for p in parts)
    kinds = [p.kind if isinstance(p, GGUFWeight) else "F32" for p in parts]
    pair = gated and len(set(kinds)) == 1
    runs: list[tuple[str, list, list]] = []  # (kind, parts, biases) of consecutive parts of one kind
    for part, bias, kind in zip(parts, biases, kinds, strict=True):
        if runs and runs[-1][0] == kind:
            runs[-1][1].append(part)
            runs[-1][2].append(bias)
        else:
            runs.append((kind, [part], [bias]))
    segments = []
    for kind, run, run_bias in runs:
        bias = None if run_bias[0] is None else torch.cat(run_bias)
        if kind == "F32":  # the float tensors are in the run's dtype already (`gguf.state_dict`)
            segments.append(quantized_segment(torch.cat(run).contiguous(), bias, pair, None))
        else:
            segments.append(gguf_segment(run, bias, pair))
    return PackedLinear.from_segments(k, rows, gated, segments)


class PanelEmbedding(nn.Module):
    """An embedding table kept in panels (a GGUF's quantized token embedding, shared with a tied
    lm_head): a lookup dequantizes its rows with the kernels' own code, the values the panels hold."""

    def __init__(self, table: Segment) -> None:
        super().__init__()
        self.table = table
        self.num_embeddings, self.embedding_dim = table.cols, table.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., H] in the activations' dtype
        rows = panel_rows(self.table, ids.reshape(-1))  # [n, H] float32, rounded once to bfloat16 if so
        return rows.to(self.table.activation_dtype).view(*ids.shape, self.embedding_dim)


def dequantized(segment: Segment) -> torch.Tensor:
    """The float32 weights ``[rows, in]`` the segment's kernels multiply by, rows in weight order (not
    gated): what a float32 model of the quantized weights holds (tests, embeddings)."""
    rows = torch.arange(segment.cols, dtype=torch.int64)
    return panel_rows(segment, rows)


def panel_rows(segment: Segment, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` (int64 ``[n]``) of a non-gated segment's weight as float32 ``[n, in]``, dequantized
    by the kernels' own code (an embedding lookup on a quantized table). A row outside the weight's
    (a token id past the embedding): `IndexOutOfRange`."""
    if debug():  # what the caller vouches for
        assert not segment.gated_pairs
    check_panels(segment)  # the lookup reads the panel of each id's row
    rows = rows.contiguous().to(torch.int64)
    out = torch.empty(rows.numel(), segment.in_features)  # [n, in]
    refusal = Refusal()
    code = _gemm_library().gemm_panel_rows(
        ctypes.byref(c_segment(segment)),
        rows.data_ptr(),
        rows.numel(),
        segment.in_features,
        out.data_ptr(),
        refusal,
    )
    check(code, refusal, "embedding lookup")
    return out


def panel_dtype(dtype: torch.dtype, in_features: int) -> bool:
    """The panel kernel serves this dtype here (where it built): float32, or bfloat16 with an even
    ``in`` (x is read in pairs)."""
    lib = _gemm_library()
    if lib is None:
        return False
    return dtype == torch.float32 or (
        dtype == torch.bfloat16 and in_features % 2 == 0 and bool(lib.gemm_kind_available(KINDS["BF16"]))
    )


def native_bf16() -> bool:
    """The bfloat16 panels multiply with vdpbf16ps here (the kernel was built with AVX512-BF16); else
    they emulate it, with the same bits."""
    lib = _gemm_library()
    return lib is not None and bool(lib.gemm_native_bf16())


@functools.cache
def _gemm_library() -> ctypes.CDLL | None:
    dll = optional_library(GEMM_SOURCE)  # None: oneDNN serves instead
    if dll is None:
        return None
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    dll.gemm_segments.argtypes = [ptr, i32, ptr, ptr, i32, i32, i32]
    dll.gemm_segments.restype = None
    dll.gemm_panel_rows.argtypes = [ptr, ptr, i32, i32, ptr, ctypes.POINTER(Refusal)]
    dll.gemm_panel_rows.restype = ctypes.c_int  # 0, or what was out of range
    dll.gemm_panel_bytes.argtypes = [i32, i32, i32]
    dll.gemm_panel_bytes.restype = ctypes.c_int64
    dll.gemm_kind_available.argtypes = [i32]
    dll.gemm_native_bf16.argtypes = []
    dll.gemm_amx.argtypes = []
    return dll


def onednn_serves(dtype: torch.dtype) -> bool:
    """oneDNN's prepacked layout serves ``dtype`` here: float32, or bfloat16 where the CPU has native
    bfloat16 instructions (elsewhere oneDNN would emulate them)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    return dtype == torch.float32 or (
        dtype == torch.bfloat16 and bool(cpu_bf16_flags()) and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def can_pack(model: nn.Module) -> bool:
    """A CPU model in float32 or bfloat16 that the panels (bfloat16 too on every CPU) or oneDNN serve."""
    param = next(model.parameters(), None)
    return (
        param is not None
        and param.device.type == "cpu"
        and (panel_dtype(param.dtype, 2) or onednn_serves(param.dtype))
    )


@torch.inference_mode()
def pack_linears(
    model: nn.Module,
    min_weights: int | None = None,
    panels: bool = True,
    quantization: Quantization | None = None,
    activations: torch.dtype = torch.float32,
) -> int:
    """Replace each ``nn.Linear`` of at least ``min_weights`` weights by a `PackedLinear`; return how many.

    ``panels``: the weights go to the panel kernel (True, on every CPU: a row's bits then never depend
    on the rows beside it, nor on the CPU) or oneDNN (False). ``min_weights`` None: every linear on the panels (a row's
    products then never depend on the rows beside it: MKL's vary with the row count on some CPUs),
    `MIN_WEIGHTS` under oneDNN. ``quantization``: float32 weights quantized to int8 or int4
    (`panel_formats.quantize_int8` / `quantize_int4`) in the panel kernel's panels, whatever ``panels`` says,
    multiplied under ``activations``, the model's other parameters then copied into that dtype (the
    checkpoint is read in float32 for the quantizer; buffers keep theirs: RoPE's frequencies stay float32,
    as a bfloat16 load keeps them).

    A tied output head keeps its embedding (the lookup still needs it) and gains a packed copy.
    The tensors left (embeddings, norms) are copied out of the checkpoint's memory map, which
    would otherwise stay mapped, and resident, for their sake: the unpacked weights' pages with it.
    """
    min_weights = (0 if panels else MIN_WEIGHTS) if min_weights is None else min_weights
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) in (nn.Linear, GatedLinear)
        and child.in_features * child.out_features >= min_weights
        and (  # a bfloat16 linear the panels cannot take stays with torch where oneDNN would emulate it
            quantization is not None
            or (panels and panel_dtype(child.weight.dtype, child.in_features))
            or onednn_serves(child.weight.dtype)
        )
    ]
    packed = {id(child) for _, _, child in targets}
    left = {  # the parameters no packed linear replaces (by identity: a tied one once)
        id(p): p for m in model.modules() if id(m) not in packed for p in m.parameters(recurse=False)
    }
    dtype = activations if quantization is not None else None  # None: each keeps its own
    # copies of their own values are made before the packing (cast ones after it: the quantizer reads
    # the checkpoint's), one per tensor, given to every parameter that holds it (a tied head's too),
    # so the tensor they leave is freed at once: a tied embedding's copy is never beside its packed one
    copied = left if dtype is None else {}
    copies: dict[tuple, torch.Tensor] = {}
    for tensor in copied.values():
        key = (tensor.data_ptr(), tensor.shape, tensor.stride())
        if key not in copies:  # a tied tensor is copied once
            copies[key] = tensor.data.clone()
    for tensor in [*copied.values(), *(child.weight for _, _, child in targets)]:
        tensor.data = copies.get((tensor.data_ptr(), tensor.shape, tensor.stride()), tensor.data)
    kept = {p.data_ptr() for p in left.values()}  # weights that other modules (a tied embedding) use
    users = Counter(child.weight.data_ptr() for _, _, child in targets)  # a weight tied across linears
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child, panels, quantization, activations=activations))
        users[child.weight.data_ptr()] -= 1
        if users[child.weight.data_ptr()] == 0 and child.weight.data_ptr() not in kept:
            release_pages(child.weight)  # its last user is packed
    for tensor in model.parameters():
        if id(tensor) not in copied:
            tensor.data = tensor.data.to(dtype or tensor.dtype, copy=True)
    for tensor in model.buffers():
        tensor.data = tensor.data.clone()
    _trim_heap()
    return len(targets)


def release_pages(t: torch.Tensor) -> None:
    """Hand the pages wholly inside ``t`` (a CPU tensor) back to the OS now (its contents are gone after).

    Without this the unpacked and packed weights are resident together until the last linear is
    packed, which raises the process's peak RSS by the model's size.
    """
    libc = _libc()
    if libc is None:
        return
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    lo, hi = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
    if hi > lo:
        libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_DONTNEED)


def _trim_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc's ``malloc_trim``): packing frees temporaries
    of up to tens of MB per linear, which glibc keeps for reuse once its mmap threshold has grown (a
    quantized SmolLM2-135M held 24 MB more after loading without it)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(ctypes.c_size_t(0))


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    return libc if libc is not None and hasattr(libc, "madvise") else None
