"""The attention function every Hugging Face layer calls: write new K/V into the pool, read per block table.

Registered through ``transformers.AttentionInterface`` under the name ``"pagedinfer"`` when a model runs on
transformers' modules (`transformers_name`; pagedinfer's own layers call `attend` and never import
transformers' modeling code, a second of start-up). The
model runner sets a `StepContext` for the duration of one forward pass; each layer finds its pool
tensors by ``module.layer_idx``. The model passes RoPE'd ``query [1, Hq, T, D]`` and un-repeated
``key``/``value [1, Hkv, T, D]`` of ALL tokens packed in one row; masking is ours (per-sequence
causal, sliding window), and so are softcap, attention sinks and the model's ``scaling``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from pagedinfer.attention.kv_cache import KVCache, LayerShape
from pagedinfer.attention.metadata import AttentionMetadata
from pagedinfer.attention.portable_backend import PortablePlan
from pagedinfer.kernels import paged_decode

ATTN_NAME = "pagedinfer"


@dataclass
class StepContext:
    meta: AttentionMetadata | None
    kv: KVCache | None
    use_cuda_kernels: bool = False
    probe: dict[int, LayerShape] | None = None  # set while discovering the layers' K/V shapes
    _plans: dict = field(default_factory=dict)  # per-step derived index tensors, shared by layers


_ctx: StepContext | None = None


def set_context(ctx: StepContext | None) -> None:
    global _ctx
    _ctx = ctx


def current_context() -> StepContext | None:
    """The running step's context (None outside a step): what a model's own layers may read."""
    return _ctx


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' entry: ``query [1, Hq, T, D]``, ``key``/``value [1, kvh, T, D]`` -> ``[1, T, Hq, Dv]``."""
    out = attend(
        module.layer_idx,
        query[0].transpose(0, 1),  # [T, Hq, D]
        key[0].transpose(0, 1),  # [T, kvh, D]
        value[0].transpose(0, 1),  # [T, kvh, Dv]
        scaling,
        int(kwargs.get("sliding_window") or 0),
        float(kwargs.get("softcap") or 0.0),
        kwargs.get("s_aux"),
    )
    return out.unsqueeze(0), None


def attend(
    layer: int,
    q: torch.Tensor,  # [T, Hq, D], last dim contiguous
    k: torch.Tensor,  # [T, kvh, D]
    v: torch.Tensor,  # [T, kvh, Dv]
    scaling: float | None = None,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # [T, Hq, Dv]
    """Write this step's K/V of ``layer`` into the pool and attend every query token (pagedinfer's own
    layers call this directly, without transformers' [1, H, T, D] layout)."""
    ctx = _ctx
    if ctx is None:
        raise RuntimeError("the pagedinfer attention runs only inside a pagedinfer engine step")
    if ctx.probe is not None:
        ctx.probe[layer] = LayerShape(k.shape[1], k.shape[2], v.shape[2], window)
        return q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
    scale = float(scaling) if scaling is not None else q.shape[-1] ** -0.5
    k_cache, v_cache = ctx.kv.k[layer], ctx.kv.v[layer]
    group = ctx.kv.layer_group[layer] if ctx.meta.group_metas else 0
    meta = ctx.meta.group_metas[group] if group else ctx.meta  # the layer's group's block tables
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])  # [T, Hq, Dv]
    if ctx.use_cuda_kernels:
        from pagedinfer.attention import cuda_kernels

        cuda_kernels.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        cuda_kernels.paged_attention(out, q, k_cache, v_cache, meta, scale, window, softcap, sinks)
    else:
        use_kernel = use_cpu_kernel(q, k, v, k_cache)
        # one plan per step and layer group (two if layers differ in kernel support); a kernel plan
        # built for one group serves the others with their tables
        plan = ctx._plans.get((group, use_kernel))
        if plan is None:
            built = [p for (_, kernel), p in ctx._plans.items() if kernel == use_kernel] if use_kernel else []
            plan = built[0].for_group(meta) if built else PortablePlan.build(meta, use_kernel)
            ctx._plans[group, use_kernel] = plan
        plan.attend(out, q, k, v, k_cache, v_cache, meta.slot_mapping, scale, window, softcap, sinks)
    return out


def select_cuda_kernels(
    requested: bool | None,
    device: torch.device,
    shapes: dict[int, LayerShape],
    dtype: torch.dtype,
    block_size: int,
    kv_dtype: torch.dtype | None = None,
) -> bool:
    """CUDA kernels when asked (or, by default, on a CUDA device with CuPy); else the torch path. They
    take a pool of the model's dtype only (``kv_dtype``: the pool's, when it differs)."""
    if requested is False or (requested is None and device.type != "cuda"):
        return False
    from pagedinfer.attention import cuda_kernels

    dims = {(s.head_dim, s.head_dim_v) for s in shapes.values()}
    reason = cuda_kernels.unsupported_reason(dims, dtype, block_size)
    if kv_dtype not in (None, dtype):
        reason = f"the CUDA kernels read a K/V pool of the model's dtype only, not {kv_dtype} under {dtype}"
    if requested is None:
        return reason is None and cuda_kernels.is_available()
    if reason:
        raise ValueError(f"use_cuda_kernels=True but {reason}")
    return True


def use_cpu_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Decode rows go through the C kernel: a pool in host memory, queries and new K/V of one dtype with
    an instantiation over the pool's (float32, bfloat16, float16; float32 over a 16-bit pool), shapes
    within its limits."""
    return (
        k_cache.device.type == "cpu"
        and q.dtype == k.dtype == v.dtype
        and paged_decode.available(q.dtype, k_cache.dtype)
        and paged_decode.supports(q.shape[1], k.shape[1], q.shape[2], v.shape[2], k_cache.shape[1])
    )


@functools.cache
def transformers_name() -> str:
    """`ATTN_NAME`, registered with transformers' attention interface (``attn_implementation=`` of a
    transformers model); imported and registered on first use."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, paged_attention)
    return ATTN_NAME
