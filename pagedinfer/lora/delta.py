"""An adapter's delta on its rows of one linear, ``y[rows] += scaling * (x[rows] A^T) B^T``, in float32.

On the CPU it runs in kernels/cpu_lora.c, where each row's values are multiply-add chains in a fixed
order whatever the row count, tile, thread split or vector width: a line's bits do not change with the
other rows of its adapter in the step (the base linears' panels promise the same; torch's GEMMs, whose
products change with the row count, do not). Elsewhere (another device, no C compiler, float16
activations) torch computes the same formula, in its own order of sums.

Either way the activations enter as their float32 values, both products and the scaling are float32,
and the delta is added to the base output in float32 and rounded once to the activations' dtype (as
PEFT computes an adapter it keeps in float32 over a bfloat16 model: its default).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedinfer.attention.cpu_kernel import KernelUnavailable, compile_library
from pagedinfer.attention.sources import KERNELS_DIR

SOURCE = KERNELS_DIR / "cpu_lora.c"
LANES = 16  # the kernel's column width: A^T's and B^T's rows are padded to a multiple of it
SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}  # activations the kernel takes


@dataclass(frozen=True)
class DeltaWeights:
    """One adapter's matrices at one site, as the kernel reads them (float32, unscaled)."""

    a_t: torch.Tensor  # [in, ceil(R / LANES) * LANES], zero past column R
    b_t: torch.Tensor  # [R, ceil(out / LANES) * LANES], zero past column out
    rank: int  # R
    out: int
    scaling: float


def padded(n: int) -> int:
    return -(-n // LANES) * LANES


def add_delta(y: torch.Tensor, x: torch.Tensor, lo: int, hi: int, w: DeltaWeights) -> None:
    """``y[lo:hi] += scaling * (x[lo:hi] A^T) B^T``; ``y`` ``[N, out]`` (contiguous), ``x`` ``[N, in]``."""
    fn = _kernel(y, x)
    if fn is None:
        t = x[lo:hi].float() @ w.a_t[:, : w.rank]  # [n, R]
        delta = (t @ w.b_t[:, : w.out]) * w.scaling  # [n, out]
        y[lo:hi] = (y[lo:hi].float() + delta).to(y.dtype)
        return
    x = x.contiguous()
    a_ld, b_ld = w.a_t.shape[1], w.b_t.shape[1]
    rows, in_features = x.shape
    if (in_features, y.shape[1], y.shape[0]) != (w.a_t.shape[0], w.out, rows):  # what C cannot check
        raise ValueError(
            f"LoRA deltas: x {list(x.shape)} and y {list(y.shape)} do not fit A^T [{w.a_t.shape[0]}, R] "
            f"and B^T [R, {w.out}]"
        )
    code = fn(
        x.data_ptr(),
        y.data_ptr(),
        rows,
        lo,
        hi,
        in_features,
        y.shape[1],
        w.a_t.data_ptr(),
        a_ld,
        w.b_t.data_ptr(),
        b_ld,
        w.rank,
        w.scaling,
    )
    if code:
        what = "out of memory" if code == -2 else "arguments out of range"
        raise RuntimeError(
            f"cpu_lora.c: {what} (rows {lo}:{hi} of {rows}, in {in_features}, out {y.shape[1]}, rank {w.rank})"
        )


def _kernel(y: torch.Tensor, x: torch.Tensor):
    """The kernel's function for these tensors, or None (torch computes the delta)."""
    lib = library()
    if lib is None or x.device.type != "cpu" or x.dtype != y.dtype or x.dtype not in SUFFIX:
        return None
    if not y.is_contiguous():  # written in place: the layers hand the GEMM's own output
        raise ValueError("LoRA deltas: the base output y must be contiguous")
    return getattr(lib, f"lora_delta_{SUFFIX[x.dtype]}")


@functools.cache
def library() -> ctypes.CDLL | None:
    """The kernel, built on first use (None without a C compiler, or with ``PAGEDINFER_CPU_KERNEL=0``)."""
    try:
        path = compile_library(SOURCE)
    except KernelUnavailable:  # the decode kernel's message already said it; torch serves instead
        return None
    return None if path is None else bind(path)


def bind(path: Path) -> ctypes.CDLL:
    """The built library at ``path``, its functions' argument types set."""
    dll = ctypes.CDLL(str(path))
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    for suffix in SUFFIX.values():
        fn = getattr(dll, f"lora_delta_{suffix}")
        fn.argtypes = [ptr, ptr] + [i32] * 5 + [ptr, i32, ptr, i32, i32, ctypes.c_float]
        fn.restype = i32
    return dll
