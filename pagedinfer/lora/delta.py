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

import torch

from pagedinfer.kernels.abi import Refusal, check, debug
from pagedinfer.kernels.build import optional_library
from pagedinfer.kernels.sources import KERNELS_DIR

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
    """``n`` rounded up to a whole number of the kernel's panels."""
    return -(-n // LANES) * LANES


def add_delta(y: torch.Tensor, x: torch.Tensor, lo: int, hi: int, w: DeltaWeights) -> None:
    """``y[lo:hi] += scaling * (x[lo:hi] A^T) B^T``; ``y`` ``[N, out]`` (contiguous), ``x`` ``[N, in]``. A
    range that is not one of the N rows: `IndexOutOfRange`, nothing written."""
    fn = _kernel(y, x)
    if fn is None:
        t = x[lo:hi].float() @ w.a_t[:, : w.rank]  # [n, R]
        delta = (t @ w.b_t[:, : w.out]) * w.scaling  # [n, out]
        y[lo:hi] = (y[lo:hi].float() + delta).to(y.dtype)
        return
    if debug():  # what the caller vouches for
        assert y.is_contiguous() and x.shape == (y.shape[0], w.a_t.shape[0]) and y.shape[1] == w.out
        assert w.a_t.is_contiguous() and w.b_t.is_contiguous() and w.b_t.shape[0] == w.rank
        assert (
            w.a_t.dtype == w.b_t.dtype == torch.float32
            and w.a_t.shape[1] % LANES == w.b_t.shape[1] % LANES == 0
        )
    x = x.contiguous()
    (rows, in_features), a_ld = x.shape, w.a_t.shape[1]
    scratch = torch.empty(
        max(hi - lo, 0), a_ld, dtype=torch.float32
    )  # [n, R padded]: the rows' first product
    refusal = Refusal()
    code = fn(
        x.data_ptr(),
        y.data_ptr(),
        rows,
        lo,
        hi,
        in_features,
        w.out,
        w.a_t.data_ptr(),
        a_ld,
        w.b_t.data_ptr(),
        w.b_t.shape[1],
        w.rank,
        w.scaling,
        scratch.data_ptr(),
        refusal,
    )
    check(code, refusal, "LoRA delta")


def _kernel(y: torch.Tensor, x: torch.Tensor):
    """The kernel's function for these tensors, or None (torch computes the delta)."""
    lib = library()
    if lib is None or x.device.type != "cpu" or x.dtype != y.dtype or x.dtype not in SUFFIX:
        return None
    return getattr(lib, f"lora_delta_{SUFFIX[x.dtype]}")


@functools.cache
def library() -> ctypes.CDLL | None:
    """The kernel, built on first use (None without a C compiler, or with ``PAGEDINFER_CPU_KERNEL=0``)."""
    dll = optional_library(SOURCE)  # None: torch computes the deltas
    return None if dll is None else bind(dll)


def bind(dll: ctypes.CDLL) -> ctypes.CDLL:
    """The loaded library ``dll``, its functions' argument types set."""
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    for suffix in SUFFIX.values():
        fn = getattr(dll, f"lora_delta_{suffix}")
        fn.argtypes = [ptr, ptr] + [i32] * 5 + [ptr, i32, ptr, i32, i32, ctypes.c_float, ptr]
        fn.argtypes += [ctypes.POINTER(Refusal)]
        fn.restype = i32  # 0, or what was out of range
    return dll
