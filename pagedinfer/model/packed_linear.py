"""CPU linears with their weights packed once for oneDNN instead of re-laid out on every call.

A decode step multiplies a few dozen rows by each weight; MKL's sgemm re-lays the whole weight out
per call, which costs about as much as the multiply itself at that size. oneDNN's prepacked
weights run the same products 1.2-2.5x faster on the CPU (the 49152-wide lm_head most), for
every row count (measured in docs/bench.md), so `pack_linears` swaps each ``nn.Linear`` of a
loaded CPU float32 model for a `PackedLinear`. bfloat16 models are packed too where the CPU has
native bfloat16 instructions (AVX512-BF16, AMX): there the prepacked bfloat16 products ran 1.4-4x
faster than ``F.linear``'s (docs/kernels.md); elsewhere oneDNN would emulate them.

On CPUs without AVX-512, float32 linears go through kernels/cpu_gemm.c instead, on a weight laid
out once in 16-row panels: at decode batch sizes a step streams every weight from memory, and
oneDNN streams a packed weight at half the memory speed or less there (6-10 GB/s of 15-20 at 1-16
rows), while the panel kernel streams it near memory speed and keeps the FMA units busy from 64 rows
up. Measured on a SmolLM2-135M stack of linears (docs/kernels.md): 1.3-1.7x faster than oneDNN at
1-64 rows, even at 256-2048 (prefill). One copy of the weight either way. On an AMD Zen 4 with
AVX-512 (256-bit units underneath) the panel kernel was within 10% of oneDNN at every row count and
faster at 1-2 rows, and the one-call decode step it enables (decode_step.py) made batch-1 decode
1.7x faster, so it serves there too. Intel's AVX-512 CPUs keep oneDNN's kernels (they were as fast
at one row there, and the panel kernel is written for 8-float vectors). ``PAGEDINFER_CPU_GEMM=panels``
/ ``=onednn`` forces one.

bfloat16 linears take the same panels, with k in pairs for vdpbf16ps, where the kernel was built
with AVX512-BF16 (and ``in`` is even): on the Zen 4 they ran 1.0-1.6x oneDNN's bfloat16 products at
1-256 rows and 0.95x at 2048, the bits equal, and they let a bfloat16 decode step run in one C call.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
from collections import Counter

import torch
from torch import nn

from pagedinfer.attention.cpu_kernel import KernelUnavailable, compile_library, cpu_flags, cpu_vendor
from pagedinfer.attention.sources import KERNELS_DIR
from pagedinfer.model.dtype import cpu_bf16_flags
from pagedinfer.model.fused_ops import GatedLinear, gated

GEMM_SOURCE = KERNELS_DIR / "cpu_gemm.c"
PANEL_ROWS = 16  # weight rows per panel of the panel kernel's layout (its NR)
# the panel kernel's weight dtypes: gemm_panels_[silu_mul_]<suffix> (int8: float32 activations)
SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16", torch.int8: "i8"}
GEMMS = ("panels", "onednn")  # PAGEDINFER_CPU_GEMM's values (anything else: chosen per CPU)
ROWS_HINT = 2048  # the row count oneDNN picks its weight layout for; it serves any row count
MIN_WEIGHTS = 1 << 17  # smaller weights stay with MKL: oneDNN's ~30 us a call outweighs its gain
MADV_DONTNEED = 4  # madvise(2): drop these pages


class PackedLinear(nn.Module):
    """``nn.Linear`` forward on a weight laid out once for a faster GEMM; inference only.

    ``panels``: the weight in kernels/cpu_gemm.c's panels (float32; bfloat16 where that kernel has
    its AVX512-BF16 half); otherwise (or for another dtype, or where that kernel did not build)
    oneDNN's prepacked layout. A `GatedLinear` stays gated: its
    output is ``silu(gate) * up``, computed by the panel kernel as it writes the product.
    """

    def __init__(self, linear: nn.Linear, panels: bool = False, int8: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.gated = isinstance(linear, GatedLinear)
        weight = linear.weight.detach().contiguous()  # [out, in]
        bias = None if linear.bias is None else linear.bias.detach()  # [out]
        self.scale = None  # int8: [P, 1, 16] float32, each column's scale, packed like a bias
        if int8:
            if weight.dtype != torch.float32 or _gemm_library() is None:
                raise ValueError("int8 weights need a float32 model and the panel kernel (a C compiler)")
            weight, scale = quantize_int8(weight)  # [out, in] int8, [out] float32
            self.scale = pack_panels(scale.unsqueeze(1), self.gated)  # [P, 1, 16]
        if int8 or (panels and panel_dtype(weight.dtype, self.in_features)):
            self.panels = pack_panels(weight, self.gated)  # [P, in, 16]: panel j holds 16 weight rows
            # cpu_gemm.c's entry for these weights and activation, e.g. gemm_panels_silu_mul_bf16
            self.kernel = "gemm_panels_" + "silu_mul_" * self.gated + SUFFIX[weight.dtype]
            bias = None if bias is None else bias.float().unsqueeze(1)  # [out, 1] float32: added to the sums
            self.bias = None if bias is None else pack_panels(bias, self.gated)  # [P, 1, 16]
            self.packed = None
        else:
            self.panels = self.kernel = None
            self.bias = None if bias is None else bias.clone()  # [out]
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, ROWS_HINT)  # opaque oneDNN layout

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out] ([..., out / 2] gated)
        x = x.contiguous()
        if self.panels is None:
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
            return gated(y) if self.gated else y  # [..., out] or [..., out / 2]
        if x.dtype != self.activation_dtype:  # the kernel reads x as that type
            raise TypeError(f"PackedLinear: input is {x.dtype}, the kernel takes {self.activation_dtype}")
        y = x.new_empty(*x.shape[:-1], self.out_features // 2 if self.gated else self.out_features)
        scale = () if self.scale is None else (self.scale.data_ptr(),)  # int8 entries take the scales
        getattr(_gemm_library(), self.kernel)(
            x.data_ptr(),
            self.panels.data_ptr(),
            *scale,
            None if self.bias is None else self.bias.data_ptr(),
            y.data_ptr(),
            x.numel() // self.in_features,
            self.out_features,
            self.in_features,
        )
        return y

    @property
    def activation_dtype(self) -> torch.dtype:
        """The dtype of inputs and outputs: the weight's, float32 for int8 weights."""
        return torch.float32 if self.scale is not None else self.panels.dtype

    def extra_repr(self) -> str:
        layout = "cpu_gemm.c panels" if self.panels is not None else "oneDNN"
        layout += ", int8 weights" if self.scale is not None else ""
        gated = ", silu(gate) * up" if self.gated else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, packed={layout}{gated}"


def pack_panels(weight: torch.Tensor, gated: bool = False) -> torch.Tensor:
    """``[out, in]`` -> ``[P, in, 16]``: the panel kernel's layout, 16 weight rows per panel (zero past
    ``out``). ``gated``: the halves paired, panel j = rows 8j..8j+7 of the gate half, then of the up half."""
    if gated:
        halves = weight.view(2, weight.shape[0] // 2, -1)  # [2, I, in]: gate, up
        half = PANEL_ROWS // 2
        padded = torch.nn.functional.pad(halves, (0, 0, 0, -halves.shape[1] % half))  # [2, P * 8, in]
        rows = padded.view(2, -1, half, weight.shape[1]).transpose(0, 1)  # [P, 2, 8, in]
    else:
        padded = torch.nn.functional.pad(weight, (0, 0, 0, -weight.shape[0] % PANEL_ROWS))  # [P * 16, in]
        rows = padded.view(-1, PANEL_ROWS, weight.shape[1])  # [P, 16, in]
    panels = rows.reshape(rows.shape[0], PANEL_ROWS, -1).transpose(1, 2)  # [P, in, 16]
    if weight.dtype == torch.bfloat16:  # k in pairs for vdpbf16ps: [P, in / 2, 16, 2]
        panels = panels.reshape(panels.shape[0], -1, 2, PANEL_ROWS).transpose(2, 3)
    return panels.reshape(rows.shape[0], -1, PANEL_ROWS).contiguous()  # [P, in, 16]


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight-only int8, symmetric per output row: ``q = round(w / s)`` with ``s = max|w_row| / 127``.

    ``[out, in]`` float32 -> ``q [out, in]`` int8, ``s [out]`` float32 (1 for an all-zero row). The
    GEMM uses ``q * s``, each weight within ``s / 2`` of its float32 value."""
    scale = weight.abs().amax(dim=1) / 127  # [out]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(weight / scale.unsqueeze(1)).clamp_(-127, 127).to(torch.int8)  # [out, in]
    return q, scale


def panel_dtype(dtype: torch.dtype, in_features: int) -> bool:
    """The panel kernel serves this dtype here: float32, or bfloat16 with an even ``in`` where it was
    built with AVX512-BF16."""
    lib = _gemm_library()
    if lib is None:
        return False
    return dtype == torch.float32 or (
        dtype == torch.bfloat16 and in_features % 2 == 0 and hasattr(lib, "gemm_panels_bf16")
    )


@functools.cache
def _gemm_library() -> ctypes.CDLL | None:
    try:
        lib = compile_library(GEMM_SOURCE)
    except KernelUnavailable:  # the decode kernel's message already said it; oneDNN serves instead
        return None
    if lib is None:
        return None
    dll = ctypes.CDLL(str(lib))
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    for suffix in SUFFIX.values():  # bf16: built with AVX512-BF16 only
        for epilogue in ("", "silu_mul_"):
            fn = getattr(dll, f"gemm_panels_{epilogue}{suffix}", None)
            if fn is None:
                continue
            fn.argtypes = [ptr] * (5 if suffix == "i8" else 4) + [i32] * 3  # int8: + the scales
            fn.restype = None
    return dll


def panels_by_default() -> bool:
    """The panel kernel serves float32 linears except on Intel CPUs with AVX-512, whose full-width
    512-bit units oneDNN's kernels use (AMD's Zen 4 runs them as two 256-bit halves: there the panel
    kernel matched oneDNN and the one-call decode step it enables won end to end)."""
    return not (cpu_flags(("avx512f",)) and cpu_vendor() == "GenuineIntel")


def can_pack(model: nn.Module) -> bool:
    """A CPU model in float32, or in bfloat16 on a CPU with native bfloat16 instructions."""
    param = next(model.parameters(), None)
    native_bf16 = bool(cpu_bf16_flags()) and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return (
        param is not None
        and param.device.type == "cpu"
        and (param.dtype == torch.float32 or (param.dtype == torch.bfloat16 and native_bf16))
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


@torch.inference_mode()
def pack_linears(
    model: nn.Module, min_weights: int | None = None, panels: bool | None = None, int8: bool = False
) -> int:
    """Replace each ``nn.Linear`` of at least ``min_weights`` weights by a `PackedLinear`; return how many.

    ``panels``: float32 weights go to the panel kernel (True) or oneDNN (False); None: as
    `panels_by_default` says for this CPU. ``int8``: float32 weights quantized to int8 per output
    row (`quantize_int8`) in the panel kernel's int8 panels, whatever ``panels`` says.

    A tied output head keeps its embedding (the lookup still needs it) and gains a packed copy.
    The tensors left (embeddings, norms) are copied out of the checkpoint's memory map, which
    would otherwise stay mapped, and resident, for their sake: the unpacked weights' pages with it.
    """
    min_weights = MIN_WEIGHTS if min_weights is None else min_weights
    panels = panels_by_default() if panels is None else panels
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) in (nn.Linear, GatedLinear) and child.in_features * child.out_features >= min_weights
    ]
    packed = {id(child) for _, _, child in targets}
    kept = {  # weights that other modules (a tied embedding) go on using
        p.data_ptr() for m in model.modules() if id(m) not in packed for p in m.parameters(recurse=False)
    }
    users = Counter(child.weight.data_ptr() for _, _, child in targets)  # a weight tied across linears
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child, panels, int8))
        users[child.weight.data_ptr()] -= 1
        if users[child.weight.data_ptr()] == 0 and child.weight.data_ptr() not in kept:
            _release_pages(child.weight)  # its last user is packed
    for tensor in [*model.parameters(), *model.buffers()]:
        tensor.data = tensor.data.clone()
    return len(targets)


def _release_pages(t: torch.Tensor) -> None:
    """Hand the pages wholly inside ``t`` back to the OS now (its contents are gone after).

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


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    return libc if libc is not None and hasattr(libc, "madvise") else None
