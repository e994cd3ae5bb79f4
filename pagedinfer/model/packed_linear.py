"""CPU linears with their weights packed once for oneDNN instead of re-laid out on every call.

A decode step multiplies a few dozen rows by each weight; MKL's sgemm re-lays the whole weight out
per call, which costs about as much as the multiply itself at that size. oneDNN's prepacked
weights run the same products 1.2-2.5x faster on the CPU (the 49152-wide lm_head most), for
every row count (measured in docs/bench.md), so `pack_linears` swaps each ``nn.Linear`` of a
loaded CPU float32 model for a `PackedLinear`. bfloat16 models are packed too where the CPU has
native bfloat16 instructions (AVX512-BF16, AMX): there the prepacked bfloat16 products ran 1.4-4x
faster than ``F.linear``'s (docs/kernels.md); elsewhere oneDNN would emulate them.

At 1-8 rows (batch-1 and small-batch decode) a linear is a matrix-vector product bound by reading
the weight. On AVX2 CPUs oneDNN streams it at about half the memory speed there, and
kernels/cpu_gemv.c reads the plain weight near memory speed (1.3-2x faster at one row,
docs/kernels.md). On AVX-512 CPUs oneDNN's own kernels stream as fast at one row and run 1.3-1.8x
faster than that AVX2 loop at 2-8 rows (measured on an AVX512-BF16 EPYC), so the loop is not used
there by default. It needs the plain weight kept beside the packed one: twice the linears' weight
memory. By default the copies are kept only on CPUs without AVX-512 and while they take at most a
tenth of the memory available at load time (SmolLM2-135M's 538 MB on a 23 GiB machine, but not a 1B
float32 model's 5 GB: the process's memory is for the KV pool and whatever else runs beside it);
``PAGEDINFER_SMALL_BATCH_GEMV=1`` / ``=0`` keeps them always / never.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
from collections import Counter

import psutil
import torch
from torch import nn

from pagedinfer.attention.cpu_kernel import KernelUnavailable, compile_library, cpu_flags
from pagedinfer.attention.sources import KERNELS_DIR
from pagedinfer.model.dtype import cpu_bf16_flags

GEMV_SOURCE = KERNELS_DIR / "cpu_gemv.c"
GEMV_MAX_ROWS = 8  # up to here the matrix-vector kernel beats oneDNN; at 16 rows they tie (docs/kernels.md)
GEMV_MEMORY_SHARE = 0.1  # plain copies kept by default while they fit in this share of available memory
ROWS_HINT = 2048  # the row count oneDNN picks its weight layout for; it serves any row count
MIN_WEIGHTS = 1 << 17  # smaller weights stay with MKL: oneDNN's ~30 us a call outweighs its gain
MADV_DONTNEED = 4  # madvise(2): drop these pages


class PackedLinear(nn.Module):
    """``nn.Linear`` forward through oneDNN with a prepacked (opaque) weight; inference only."""

    def __init__(self, linear: nn.Linear, gemv: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().contiguous()  # [out, in]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, ROWS_HINT)  # opaque oneDNN layout
        self.bias = None if linear.bias is None else linear.bias.detach().clone()  # [out]
        # [out, in] plain copy for the float32 small-batch kernel (None: every call goes through oneDNN)
        keep = gemv and weight.dtype == torch.float32 and _gemv_library() is not None
        self.weight = weight.clone() if keep else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        x = x.contiguous()
        rows = x.numel() // self.in_features
        if self.weight is not None and rows <= GEMV_MAX_ROWS:
            y = x.new_empty(*x.shape[:-1], self.out_features)  # [..., out]
            _gemv_library().gemv_f32(
                x.data_ptr(),
                self.weight.data_ptr(),
                None if self.bias is None else self.bias.data_ptr(),
                y.data_ptr(),
                rows,
                self.out_features,
                self.in_features,
            )
            return y
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        gemv = f", gemv<={GEMV_MAX_ROWS} rows" if self.weight is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN{gemv}"


@functools.cache
def _gemv_library() -> ctypes.CDLL | None:
    try:
        lib = compile_library(GEMV_SOURCE)
    except KernelUnavailable:  # the decode kernel's message already said it; oneDNN serves every row count
        return None
    if lib is None:
        return None
    dll = ctypes.CDLL(str(lib))
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    dll.gemv_f32.argtypes = [ptr] * 4 + [i32] * 3
    dll.gemv_f32.restype = None
    return dll


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
def pack_linears(model: nn.Module, min_weights: int | None = None, gemv: bool | None = None) -> int:
    """Replace each ``nn.Linear`` of at least ``min_weights`` weights by a `PackedLinear`; return how many.

    ``gemv``: each float32 one also keeps its plain weight for the small-batch kernel (twice the
    weight memory); None: only on a CPU without AVX-512 and if those copies fit in
    `GEMV_MEMORY_SHARE` of the memory available now.

    A tied output head keeps its embedding (the lookup still needs it) and gains a packed copy.
    The tensors left (embeddings, norms) are copied out of the checkpoint's memory map, which
    would otherwise stay mapped, and resident, for their sake: the unpacked weights' pages with it.
    """
    min_weights = MIN_WEIGHTS if min_weights is None else min_weights
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and child.in_features * child.out_features >= min_weights
    ]
    if gemv is None:
        copies = {
            c.weight.data_ptr(): c.weight.numel() * c.weight.element_size()
            for _, _, c in targets
            if c.weight.dtype == torch.float32
        }
        fits = sum(copies.values()) <= GEMV_MEMORY_SHARE * psutil.virtual_memory().available
        gemv = fits and not cpu_flags(("avx512f",))
    packed = {id(child) for _, _, child in targets}
    kept = {  # weights that other modules (a tied embedding) go on using
        p.data_ptr() for m in model.modules() if id(m) not in packed for p in m.parameters(recurse=False)
    }
    users = Counter(child.weight.data_ptr() for _, _, child in targets)  # a weight tied across linears
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child, gemv))
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
