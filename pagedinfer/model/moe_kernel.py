"""A mixture-of-experts layer's routed experts in one C call (kernels/cpu_moe.c), and its whole MLP's
description for the one-call decode step (`MoeLayer`).

From Python, `moe.ExpertMLP`'s routing and per-expert loop are a dozen torch ops and module calls per
active expert: at batch 1 on a 64-expert model more time than the experts' GEMMs themselves. The C
call does the same arithmetic in the same order through the same panels and activation chains, so
its outputs are the same bits. It serves a layer whose every expert linear is on the panels
(`PackedLinear` segments: float32, bfloat16, int8/int4 or GGUF blocks) under the activations' dtype
(float32 or bfloat16) on the CPU; any other layer (oneDNN's layout, torch linears, float16, no
compiler) keeps the torch loop. Each row's top k experts are chosen in C (highest logit first, of tied
logits the lower index first: `moe.route`'s rule), so the layer path and the one-call step choose alike.
"""

from __future__ import annotations

import ctypes
import functools

import torch
from torch import nn

from pagedinfer.kernels import abi
from pagedinfer.kernels.build import optional_library
from pagedinfer.kernels.sources import KERNELS_DIR
from pagedinfer.model.packed_linear import PackedLinear

SOURCE = KERNELS_DIR / "cpu_moe.c"
DTYPES = (torch.float32, torch.bfloat16)
_ptr = ctypes.c_void_p


class MoeExpert(ctypes.Structure):  # kernels/cpu_moe.c: moe_expert
    _fields_ = [
        ("gate_up", _ptr),
        ("gate_up_segments", ctypes.c_int),
        ("paired", ctypes.c_int),
        ("down", _ptr),
    ]


class MoeShape(ctypes.Structure):  # kernels/cpu_moe.c: moe_shape
    _fields_ = [
        *((n, ctypes.c_int) for n in ("experts", "top_k", "hidden", "inter", "renormalise", "glu")),
        ("alpha", ctypes.c_float),
        ("limit", ctypes.c_float),
    ]


class MoeLayerStruct(ctypes.Structure):  # kernels/cpu_moe.h: moe_layer
    _fields_ = [
        ("router", _ptr),
        ("router_segments", ctypes.c_int),
        ("experts", _ptr),
        ("shape", MoeShape),
        ("shared", _ptr),
        ("shared_gate", _ptr),
        ("shared_inter", ctypes.c_int),
    ]


@functools.cache
def _library() -> ctypes.CDLL | None:
    dll = optional_library(SOURCE)  # None: the torch loop serves
    if dll is None:
        return None
    for suffix in (abi.SUFFIX[d] for d in DTYPES):
        fn = getattr(dll, f"moe_experts_{suffix}")
        fn.argtypes = [_ptr, _ptr, _ptr, _ptr, _ptr, ctypes.c_int, _ptr, _ptr, ctypes.POINTER(abi.Refusal)]
        fn.restype = ctypes.c_int  # 0, or what was out of range
    dll.moe_layer_work.argtypes = [ctypes.POINTER(MoeLayerStruct), ctypes.c_int]
    dll.moe_layer_work.restype = ctypes.c_int64
    return dll


@functools.cache
def _workspace(dtype: torch.dtype) -> list[torch.Tensor]:
    """One scratch tensor per dtype, grown as steps need (layers run one after another): a fresh one per
    call would fault its pages in every layer of every step."""
    return [torch.empty(0, dtype=dtype)]


def _scratch(numel: int, dtype: torch.dtype) -> torch.Tensor:
    held = _workspace(dtype)
    if held[0].numel() < numel:
        held[0] = torch.empty(numel, dtype=dtype)
    return held[0]


class RoutedExperts:
    """The C description of one layer's experts (pointers into its linears' segment arrays, which the
    linears keep alive); `run` computes the layer's routed output."""

    def __init__(self, experts, top_k: int, renormalise: bool, glu: tuple[float, float] | None) -> None:
        self.experts = _c_experts(experts)
        first = experts[0]
        self.hidden, self.inter = first.gate_up_proj.in_features, first.down_proj.in_features
        alpha, limit = glu if glu is not None else (0.0, 0.0)
        self.shape = MoeShape(
            len(experts), top_k, self.hidden, self.inter, int(renormalise), int(glu is not None)
        )
        self.shape.alpha, self.shape.limit = alpha, limit
        self.dtype = first.gate_up_proj.activation_dtype
        self.fn = getattr(_library(), f"moe_experts_{abi.SUFFIX[self.dtype]}")

    @staticmethod
    def serves(experts, glu: tuple[float, float] | None) -> bool:
        """Every expert's gate-up and down linears on the panels under one activation dtype the call
        takes, the down in one segment; the gate-up gated (SiLU, paired or not) or, with ``glu``, plain."""
        if _library() is None:
            return False
        dtype = None
        for expert in experts:
            gate_up, down = expert.gate_up_proj, expert.down_proj
            if not (isinstance(gate_up, PackedLinear) and isinstance(down, PackedLinear)):
                return False
            if not (gate_up.segments and down.segments) or len(down.segments) != 1:
                return False
            if gate_up.gated == (glu is not None):
                return False
            dtype = dtype or gate_up.activation_dtype
            if dtype not in DTYPES or gate_up.activation_dtype != dtype or down.activation_dtype != dtype:
                return False
        return True

    def run(self, x: torch.Tensor, logits: torch.Tensor, chosen: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` [T, H] (the experts' dtype), the router's ``logits`` [T, E] (that dtype) and each row's
        ``chosen`` experts [T, k] int64 (highest logit first; None: each row's top k, chosen in C) ->
        the weighted sum of the row's k experts' outputs in rank order [T, H]."""
        rows, k = x.shape[0], self.shape.top_k
        x, logits = x.contiguous(), logits.contiguous()
        chosen = None if chosen is None else chosen.contiguous()
        if abi.debug():  # what the caller vouches for
            assert x.dtype == logits.dtype == self.dtype
            assert x.shape[1] == self.hidden and logits.shape == (rows, self.shape.experts)
            assert chosen is None or (chosen.dtype == torch.int64 and chosen.shape == (rows, k))
        y = x.new_empty(rows, self.hidden)  # [T, H]
        work = _scratch(rows * k * (2 * self.hidden + 3 * self.inter), self.dtype)
        refusal = abi.Refusal()
        code = self.fn(
            self.experts,
            ctypes.byref(self.shape),
            x.data_ptr(),
            logits.data_ptr(),
            None if chosen is None else chosen.data_ptr(),
            rows,
            y.data_ptr(),
            work.data_ptr(),
            refusal,
        )
        abi.check(code, refusal, "mixture of experts")
        return y


def _c_experts(experts) -> ctypes.Array:
    """Each expert's `MoeExpert` (pointers into its linears' segment arrays, which the linears keep alive)."""
    out = (MoeExpert * len(experts))()
    for c, expert in zip(out, experts, strict=True):
        gate_up, down = expert.gate_up_proj, expert.down_proj
        c.gate_up, c.gate_up_segments = ctypes.addressof(gate_up._c), len(gate_up.segments)
        c.paired, c.down = int(gate_up.paired), ctypes.addressof(down._c)
    return out


class MoeLayer:
    """A layer's whole MLP of experts as the one-call decode step takes it (kernels/cpu_moe.h moe_layer):
    the router's GEMM, the routed experts (`RoutedExperts`) and the shared expert where the layer has
    one, the same calls in the same order as `moe.ExpertMLP`'s forward over them."""

    def __init__(self, routed: RoutedExperts, router: PackedLinear, shared) -> None:
        self.routed = routed  # (keeps the experts' descriptions alive)
        self.shared = None if shared is None else _c_experts([shared.expert])
        self.c = MoeLayerStruct(
            ctypes.addressof(router._c),
            len(router.segments),
            ctypes.addressof(routed.experts),
            routed.shape,
            None if shared is None else ctypes.addressof(self.shared),
            None if shared is None else ctypes.addressof(shared.gate._c),
            0 if shared is None else shared.expert.down_proj.in_features,
        )

    @staticmethod
    def serves(routed: RoutedExperts, router: nn.Module, shared) -> bool:
        """The router a panel linear under the experts' activation dtype; the shared expert's linears
        (where there is one) as `RoutedExperts.serves` takes an expert's, its gate one plain segment."""
        if not _plain(router, routed.dtype):
            return False
        if shared is None:
            return True
        glu = shared.expert.glu
        gate = shared.gate
        return (
            RoutedExperts.serves([shared.expert], glu)
            and _plain(gate, routed.dtype)
            and len(gate.segments) == 1
        )

    def work(self, rows: int) -> int:
        """Elements of the scratch the layer takes for ``rows`` rows (cpu_moe.c moe_layer_work)."""
        return _library().moe_layer_work(ctypes.byref(self.c), rows)


def _plain(linear: nn.Module, dtype: torch.dtype) -> bool:
    """An ungated panel linear under ``dtype`` activations."""
    return (
        isinstance(linear, PackedLinear)
        and bool(linear.segments)
        and not linear.gated
        and linear.activation_dtype == dtype
    )
