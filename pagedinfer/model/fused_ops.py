"""The elementwise chains of a Llama-family layer: one C call each on CPU float32/bfloat16, torch ops elsewhere.

The C loops (kernels/cpu_llama_ops.c, built like every kernel: pagedinfer/kernels) replace 3-8 small torch ops per
chain; at batch 1-16 those ops cost more in dispatch than in arithmetic. The bfloat16 loops compute
in float32 and round where transformers' bfloat16 modules round. Without a compiler, off the CPU or
in float16, the same chains run as torch ops (same results up to rounding). The sampler's argmax and
temperature draw (kernels/cpu_sampling.c) live here too: torch's CPU argmax is not vectorized, and its
draw takes five passes over [R, V] tensors.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F
from torch import nn

from pagedinfer.kernels.abi import SUFFIX, Refusal, check, debug
from pagedinfer.kernels.build import optional_library
from pagedinfer.kernels.sources import KERNELS_DIR

SOURCE = KERNELS_DIR / "cpu_llama_ops.c"
SAMPLING_SOURCE = KERNELS_DIR / "cpu_sampling.c"
DTYPES = (torch.float32, torch.bfloat16)  # the instantiations
# an MLP's activation (the config's name) -> its chain act(gate) * up over a fused gate-up product
ACT_CHAINS = {"silu": "silu_mul", "gelu_pytorch_tanh": "gelu_tanh_mul"}


@functools.cache
def _library() -> ctypes.CDLL | None:
    dll = optional_library(SOURCE)  # None: these chains run as torch ops
    if dll is None:
        return None
    ptr, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    for suffix in (SUFFIX[d] for d in DTYPES):
        getattr(dll, f"add_rms_norm_{suffix}").argtypes = [ptr] * 4 + [i32, i32, f32]
        getattr(dll, f"qk_norm_rope_{suffix}").argtypes = [
            ptr,
            i64,
            i32,
            i32,
            i32,
            i32,
            ptr,
            ptr,
            ptr,
            ptr,
            f32,
        ]
        for name in ACT_CHAINS.values():
            getattr(dll, f"{name}_{suffix}").argtypes = [ptr, ptr, i32, i32]
        getattr(dll, f"clamped_swiglu_mul_{suffix}").argtypes = [ptr, ptr, i32, i32, f32, f32]
        for name in ("add_rms_norm", "qk_norm_rope", "clamped_swiglu_mul", *ACT_CHAINS.values()):
            getattr(dll, f"{name}_{suffix}").restype = None
    return dll


@functools.cache
def _sampling_library() -> ctypes.CDLL | None:
    dll = optional_library(SAMPLING_SOURCE)  # None: the sampler runs torch ops
    if dll is None:
        return None
    ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    refusal = ctypes.POINTER(Refusal)
    dll.argmax_rows_f32.argtypes = [ptr, i32, ptr, i32, i64, ptr, i32, refusal]
    dll.argmax_rows_f32.restype = ctypes.c_int  # rows without a finite maximum, or -(a refusal's code)
    dll.sample_rows_f32.argtypes = [ptr, i32, ptr, i32, i64, ptr, ptr, ptr, i32, refusal]
    dll.sample_rows_f32.restype = ctypes.c_int  # rows without a finite maximum, or -(a refusal's code)
    return dll


def _fn(name: str, t: torch.Tensor):
    """The C chain ``name`` for ``t``'s dtype."""
    return getattr(_library(), f"{name}_{SUFFIX[t.dtype]}")


def use_c(t: torch.Tensor) -> bool:
    """The C chains serve float32 and bfloat16 tensors in host memory (when the library built)."""
    return t.device.type == "cpu" and t.dtype in DTYPES and _library() is not None


def _sample_in_c(logits: torch.Tensor) -> bool:
    """The C sampler serves float32 logits in host memory of unit column stride (when its library built)."""
    return (
        logits.dtype == torch.float32
        and logits.stride(1) == 1
        and logits.device.type == "cpu"
        and _sampling_library() is not None
    )


def add_rms_norm(
    residual: torch.Tensor,  # [T, H], updated in place: residual += x
    x: torch.Tensor | None,  # [T, H] contiguous, or None (only normalise)
    weight: torch.Tensor,  # [H]
    eps: float,
    fast: bool,
) -> torch.Tensor:  # [T, H]: RMSNorm(residual) * weight
    """Residual add and RMSNorm in one pass (HF: ``residual + x``, then ``weight * (h * rsqrt(...))``)."""
    if fast:
        if debug():  # what the caller vouches for
            assert residual.is_contiguous() and weight.shape == residual.shape[1:]
            assert x is None or (x.shape == residual.shape and x.is_contiguous())
        out = torch.empty_like(residual)
        _fn("add_rms_norm", residual)(
            residual.data_ptr(),
            None if x is None else x.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            residual.shape[0],
            residual.shape[1],
            eps,
        )
        return out
    if x is not None:
        residual.add_(x)
    return F.rms_norm(residual, (residual.shape[-1],), weight, eps)


def qk_norm_rope_(
    qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) * D], rows contiguous: q heads, k heads, v heads
    q_heads: int,
    k_heads: int,
    head_dim: int,
    cos: torch.Tensor,  # [T, D / 2] contiguous
    sin: torch.Tensor,  # [T, D / 2] contiguous
    q_norm: torch.Tensor | None,  # [D] per-head RMSNorm weight (Qwen3), or None
    k_norm: torch.Tensor | None,  # [D]
    eps: float,
    fast: bool,
) -> None:
    """In place: the q and k heads of ``qkv`` get their per-head norm (if any), then rotate-half RoPE."""
    if fast:
        if debug():  # what the caller vouches for
            assert qkv.stride(1) == 1 and qkv.shape[1] >= (q_heads + k_heads) * head_dim
            assert cos.shape == sin.shape == (qkv.shape[0], head_dim // 2) and cos.is_contiguous()
            assert sin.is_contiguous() and all(w is None or w.shape == (head_dim,) for w in (q_norm, k_norm))
        _fn("qk_norm_rope", qkv)(
            qkv.data_ptr(),
            qkv.stride(0),
            qkv.shape[0],
            q_heads,
            k_heads,
            head_dim,
            cos.data_ptr(),
            sin.data_ptr(),
            None if q_norm is None else q_norm.data_ptr(),
            None if k_norm is None else k_norm.data_ptr(),
            eps,
        )
        return
    t = qkv.shape[0]
    qk = qkv[:, : (q_heads + k_heads) * head_dim].view(t, q_heads + k_heads, head_dim)  # [T, Hq + Hkv, D]
    if q_norm is not None:
        qk[:, :q_heads] = F.rms_norm(qk[:, :q_heads], (head_dim,), q_norm, eps)
        qk[:, q_heads:] = F.rms_norm(qk[:, q_heads:], (head_dim,), k_norm, eps)
    half = head_dim // 2
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, D / 2]
    x1, x2 = qk[..., :half], qk[..., half:]  # [T, Hq + Hkv, D / 2] views
    first = x1 * c - x2 * s
    x2.mul_(c).addcmul_(x1, s)
    x1.copy_(first)


def silu_mul(gate_up: torch.Tensor, fast: bool) -> torch.Tensor:  # [T, 2 I] -> [T, I]
    """``silu(gate) * up`` of a fused gate-up GEMM output."""
    return act_mul(gate_up, "silu", fast)


def act_mul(gate_up: torch.Tensor, activation: str, fast: bool) -> torch.Tensor:  # [T, 2 I] -> [T, I]
    """``act(gate) * up`` of a fused gate-up GEMM output, ``activation`` one of `ACT_CHAINS`."""
    if fast:
        return _gate_up_chain(ACT_CHAINS[activation], gate_up)
    inter = gate_up.shape[1] // 2
    gate = gate_up[:, :inter]
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    return act * gate_up[:, inter:]


def _gate_up_chain(name: str, gate_up: torch.Tensor, *constants: float) -> torch.Tensor:
    """The C chain ``name`` (its constants after the shapes) over a fused gate-up product: [T, 2 I] -> [T, I]."""
    if debug():  # what the caller vouches for
        assert gate_up.is_contiguous()
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(rows, inter)  # [T, I]
    _fn(name, gate_up)(gate_up.data_ptr(), out.data_ptr(), rows, inter, *constants)
    return out


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float, fast: bool) -> torch.Tensor:
    """gpt-oss's expert activation of a fused gate-up product ``[T, 2 I] -> [T, I]`` (gate rows, then
    up): ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, limit)``; the C
    chain gives a row the same bits whatever rows share the call (torch's sigmoid does not)."""
    if fast:
        return _gate_up_chain("clamped_swiglu_mul", gate_up, alpha, limit)
    inter = gate_up.shape[1] // 2
    gate = gate_up[:, :inter].clamp(max=limit)
    up = gate_up[:, inter:].clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))  # transformers' GptOssExperts' order


class GatedLinear(nn.Linear):
    """A fused gate-up projection that returns ``silu(gate) * up``: ``[..., H] -> [..., I]`` from a
    ``[2 I, H]`` weight (gate rows first). A class of its own so that the CPU packer can lay it out
    for the panel kernel, which computes the activation as it writes the product (`packed_linear`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gated(super().forward(x))  # [..., I]


def gated(gate_up: torch.Tensor) -> torch.Tensor:  # [..., 2 I] -> [..., I]
    """``silu(gate) * up`` of a fused gate-up product, any leading dimensions."""
    flat = gate_up.reshape(-1, gate_up.shape[-1])  # [T, 2 I]
    return silu_mul(flat, use_c(flat)).view(*gate_up.shape[:-1], -1)  # [..., I]


def argmax(logits: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:  # [R, V] -> [R] int64
    """Each row's first maximum, as ``logits.argmax(dim=-1)``, of every row or of ``rows`` ``[S]``
    (int64, then ``[S]`` out, no rows copied); -1 for a row without a finite maximum (a NaN, +inf, or
    every logit -inf): no token is drawn from it. A row outside ``logits``: `IndexOutOfRange`."""
    if not _sample_in_c(logits):
        picked = logits if rows is None else logits[rows]  # [S, V]
        out = picked.argmax(dim=-1)  # [S]: a NaN row names its NaN, a +inf row its +inf
        best = picked.gather(1, out.unsqueeze(1)).squeeze(1)  # [S]
        return out.masked_fill_(~torch.isfinite(best), -1)
    index = None if rows is None else rows.to(torch.int64).contiguous()  # [S]
    out = torch.empty(len(logits if index is None else index), dtype=torch.int64, device=logits.device)  # [S]
    refusal = Refusal()
    bad = _sampling_library().argmax_rows_f32(
        logits.data_ptr(),
        len(out),
        None if index is None else index.data_ptr(),
        logits.shape[1],
        logits.stride(0),
        out.data_ptr(),
        logits.shape[0],
        refusal,
    )
    check(max(-bad, 0), refusal, "argmax")
    return out


def sample(
    logits: torch.Tensor, rows: torch.Tensor, temperatures: list[float], uniform: torch.Tensor
) -> torch.Tensor | None:
    """``[R]`` int64: each of ``logits[rows]`` ``[V]`` (``rows`` ``[R]`` int64) tempered, its CDF inverted
    at ``uniform[i]`` in [0, 1) (no top-k, top-p or min-p), in one C call; -1 for a row without a finite
    maximum (after its temperature). None where the C loop cannot serve (not a float32 CPU tensor of
    unit column stride, no compiler): the torch ops then run. A row outside ``logits``: `IndexOutOfRange`."""
    if not _sample_in_c(logits):
        return None
    picks = rows.to(torch.int64).contiguous()  # [R]
    temps = torch.tensor(temperatures, dtype=torch.float32, device=logits.device)  # [R]
    u = uniform.to(torch.float32).contiguous()  # [R]
    if debug():  # what the caller vouches for
        assert temps.shape == u.shape == picks.shape
    out = torch.empty(len(picks), dtype=torch.int64, device=logits.device)  # [R]
    refusal = Refusal()
    bad = _sampling_library().sample_rows_f32(
        logits.data_ptr(),
        len(picks),
        picks.data_ptr(),
        logits.shape[1],
        logits.stride(0),
        temps.data_ptr(),
        u.data_ptr(),
        out.data_ptr(),
        logits.shape[0],
        refusal,
    )
    check(max(-bad, 0), refusal, "sample")
    return out
