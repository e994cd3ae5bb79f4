"""GPU backend: CUDA kernels for block-table attention and KV-cache upkeep, launched through CuPy.

Why CuPy: the ``.cu`` sources in ``kernels/`` (found beside the ``pagedinfer`` package, as in a source
checkout or editable install) are compiled at run time with NVRTC, once per process and per
instantiation, so no CUDA toolchain is needed to install the project. Torch CUDA tensors are passed
zero-copy as raw device pointers, and kernels run on torch's current stream.

Tests drive this same launch code on the CPU: ``set_raw_module_factory(cuda_on_cpu.RawModule)`` swaps
the compiler for g++ plus a CUDA shim, and CPU tensors then stand in for device memory.
"""

from __future__ import annotations

import functools
import math
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedinfer.attention.metadata import AttentionMetadata
from pagedinfer.kernels.sources import KERNELS_DIR

DTYPE_NAMES = {torch.float16: "__half", torch.bfloat16: "__nv_bfloat16", torch.float32: "float"}
HEAD_SIZES = (64, 80, 96, 128, 256)
BLOCK_SIZES = (8, 16, 32)
DECODE_GROUPS = (1, 2, 4, 8)  # query heads per decode CUDA block (template parameter GROUP)
# Decode split-K: contexts are cut into partitions (multiples of PARTITION_QUANTUM keys) until the
# grid holds about DECODE_BLOCKS_PER_SM CUDA blocks per SM; each partition then streams at least
# PARTITION_QUANTUM keys, so the merge's extra traffic stays a few percent of the K/V read.
DECODE_BLOCKS_PER_SM = 4
PARTITION_QUANTUM = 256
DEFAULT_SM_COUNT = 132  # an H100/H200: what the CPU harness plans partitions for


def _cu_constants(source: str) -> dict[str, int]:
    """The ``constexpr int NAME = expression;`` lines of a .cu file, evaluated in order: the launch
    grids read the kernels' own constants, never a Python copy of them."""
    values: dict[str, int] = {}
    for name, expr in re.findall(r"^constexpr int (\w+) = ([\w\s*/+()-]+);", source, re.M):
        values[name] = int(eval(expr, {"__builtins__": {}}, dict(values)))  # noqa: S307 - integer arithmetic on names
    return values


CU_CONSTANTS = _cu_constants((KERNELS_DIR / "paged_attention.cu").read_text())
_NUM_THREADS = CU_CONSTANTS["NUM_THREADS"]  # threads per CUDA block
_MAX_GROUP = CU_CONSTANTS["MAX_GROUP"]  # query heads per CUDA block
_PREFILL_ROWS = CU_CONSTANTS["PREFILL_ROWS"]  # prefill (token, head) rows per CUDA block

RawModuleFactory = Callable[..., Any]  # cupy.RawModule-like: (code=, options=, name_expressions=)
_factory: RawModuleFactory | None = None
_kernels: dict[tuple[str, tuple[str, ...]], dict[str, Any]] = {}
_lock = threading.Lock()


def is_available() -> bool:
    """True when CuPy imports and a CUDA device is present."""
    try:
        import cupy

        return torch.cuda.is_available() and cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def unsupported_reason(head_dims: set[tuple[int, int]], dtype: torch.dtype, block_size: int) -> str | None:
    """Why the kernels cannot serve a model with these (D, Dv) head sizes, dtype and block size."""
    if dtype not in DTYPE_NAMES:
        return f"no kernels for dtype {dtype}"
    if block_size not in BLOCK_SIZES:
        return f"no kernels for block size {block_size} (have {BLOCK_SIZES})"
    for d, dv in head_dims:
        if d != dv or d not in HEAD_SIZES:
            return f"no kernels for head size {d}/{dv} (have {HEAD_SIZES}, K and V equal)"
    return None


def set_raw_module_factory(factory: RawModuleFactory | None) -> None:
    """Compiles kernels with ``factory`` from now on (None: ``cupy.RawModule``); drops loaded ones."""
    global _factory
    with _lock:
        _factory = factory
        _kernels.clear()


def nvrtc_options() -> tuple[str, ...]:
    """NVRTC options for the sources (CuPy adds the architecture)."""
    try:
        from cuda.pathfinder import find_nvidia_header_directory

        include = find_nvidia_header_directory("cudart")
    except ImportError:
        include = None
    return ("--std=c++17", "-ftz=true", *([f"-I{include}"] if include else []))


def _attention_names(dtype: str, head: int, block: int, group: int) -> tuple[str, ...]:
    return (
        f"paged_decode_kernel<{dtype}, {head}, {group}>",
        f"paged_decode_merge<{dtype}, {head}>",
        f"paged_prefill_kernel<{dtype}, {head}, {block}>",
    )


def decode_group(num_heads: int, num_kv_heads: int) -> int:
    """The decode kernel's GROUP for this GQA ratio: the fewest registers that hold a block's heads."""
    ratio = num_heads // num_kv_heads
    return next(g for g in DECODE_GROUPS if g >= min(ratio, _MAX_GROUP))


def decode_partitions(cuda_blocks: int, visible: int, sm_count: int = DEFAULT_SM_COUNT) -> tuple[int, int]:
    """(keys per partition, partitions) for a decode over ``visible`` keys (the longest sequence's)
    whose grid has ``cuda_blocks`` blocks per partition: enough partitions that the grid fills
    ``sm_count`` SMs DECODE_BLOCKS_PER_SM times, none shorter than PARTITION_QUANTUM keys."""
    wanted = max(1, math.ceil(DECODE_BLOCKS_PER_SM * sm_count / cuda_blocks))
    size = max(1, math.ceil(visible / wanted / PARTITION_QUANTUM)) * PARTITION_QUANTUM
    return size, max(1, math.ceil(visible / size))


@dataclass(frozen=True)
class DecodePlan:
    """How a decode step is launched: grid (head_blocks, seqs, partitions) of GROUP-head CUDA blocks."""

    group: int
    head_blocks: int  # CUDA blocks per sequence and partition
    partition_size: int  # keys
    partitions: int


def decode_plan(
    num_heads: int, num_kv_heads: int, num_seqs: int, visible: int, device: torch.device
) -> DecodePlan:
    """The decode launch for this batch on ``device`` (the CPU harness plans for DEFAULT_SM_COUNT SMs)."""
    group = decode_group(num_heads, num_kv_heads)
    head_blocks = num_kv_heads * math.ceil(num_heads // num_kv_heads / group)
    sm_count = _sm_count(device) if device.type == "cuda" else DEFAULT_SM_COUNT
    return DecodePlan(group, head_blocks, *decode_partitions(head_blocks * num_seqs, visible, sm_count))


@functools.cache
def _sm_count(device: torch.device) -> int:
    """Asked once per device: the plan is made for every layer of every decode step."""
    return torch.cuda.get_device_properties(device).multi_processor_count


_CACHE_NAMES = (*(f"reshape_and_cache<{d}>" for d in DTYPE_NAMES.values()), "copy_blocks")


def name_expressions() -> dict[str, list[str]]:
    """Every kernel instantiation the dispatch below can ask for, per source file."""
    attention = (
        n
        for d in DTYPE_NAMES.values()
        for h in HEAD_SIZES
        for b in BLOCK_SIZES
        for g in DECODE_GROUPS
        for n in _attention_names(d, h, b, g)
    )
    return {"paged_attention.cu": list(dict.fromkeys(attention)), "cache_ops.cu": list(_CACHE_NAMES)}


def _kernels_of(source: str, names: tuple[str, ...]) -> dict[str, Any]:
    """Compiles (once per process) a module holding just the instantiations asked for."""
    with _lock:
        if (source, names) not in _kernels:
            if _factory is None:
                import cupy

                factory: RawModuleFactory = cupy.RawModule
            else:
                factory = _factory
            module = factory(
                code=(KERNELS_DIR / source).read_text(), options=nvrtc_options(), name_expressions=list(names)
            )
            _kernels[source, names] = {n: module.get_function(n) for n in names}
        return _kernels[source, names]


def _ptr(t: torch.Tensor | None) -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())  # a pointer parameter: 8 bytes, as CuPy passes it


def _launch(
    kernel: Any, grid: tuple[int, ...], block: tuple[int, ...], args: Sequence[Any], like: torch.Tensor
):
    """Launches on torch's current stream of ``like``'s device (CUDA), or in the CPU harness."""
    if not like.is_cuda:
        if _factory is None:
            raise ValueError(
                "CUDA kernels need CUDA tensors (or set_raw_module_factory(cuda_on_cpu.RawModule))"
            )
        kernel(grid, block, args)
        return
    import cupy

    with cupy.cuda.Device(like.device.index), _cupy_stream(cupy, torch.cuda.current_stream(like.device)):
        kernel(grid, block, args)


def _cupy_stream(cupy: Any, stream: torch.cuda.Stream) -> Any:
    """torch's stream as CuPy's: through the CUDA stream protocol where both have it (CuPy 14
    deprecates ExternalStream), else by its raw handle."""
    if hasattr(cupy.cuda.Stream, "from_external") and hasattr(stream, "__cuda_stream__"):
        return cupy.cuda.Stream.from_external(stream)
    return cupy.cuda.ExternalStream(stream.cuda_stream, stream.device.index)


def _dtype_name(t: torch.Tensor) -> str:
    if t.dtype not in DTYPE_NAMES:
        raise TypeError(f"unsupported dtype {t.dtype}; kernels exist for {list(DTYPE_NAMES)}")
    return DTYPE_NAMES[t.dtype]


def _check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dtype != v_cache.dtype or k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(
            f"K/V caches disagree: {k_cache.shape} {k_cache.dtype}, {v_cache.shape} {v_cache.dtype}"
        )
    for c in (k_cache, v_cache):
        if not c.is_contiguous() or c.data_ptr() % 16:
            raise ValueError("caches must be contiguous and 16-byte aligned")


def reshape_and_cache(
    key: torch.Tensor,  # [T, kv_heads, D], any strides with D contiguous
    value: torch.Tensor,  # [T, kv_heads, Dv]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, Dv]
    slot_mapping: torch.Tensor,  # [T] int64, < 0 for padding tokens
) -> None:
    """Writes this step's new K/V rows into their cache slots, before attention reads them in place."""
    _check_caches(k_cache, v_cache)
    tokens = key.shape[0]
    if tokens == 0:
        return
    for x, c in ((key, k_cache), (value, v_cache)):
        if x.dtype != c.dtype or x.shape[1:] != c.shape[2:] or x.stride(2) != 1 or x.device != c.device:
            raise ValueError(f"rows {tuple(x.shape)} {x.dtype} don't fit cache {tuple(c.shape)} {c.dtype}")
    if slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous():
        raise ValueError("slot_mapping must be a contiguous int64 tensor")
    kernel = _kernels_of("cache_ops.cu", _CACHE_NAMES)[f"reshape_and_cache<{_dtype_name(key)}>"]
    ints = (*key.stride()[:2], *value.stride()[:2], key.shape[1], key.shape[2], value.shape[2])
    args = (*map(_ptr, (key, value, k_cache, v_cache, slot_mapping)), *map(np.int32, ints))
    _launch(kernel, (tokens,), (_NUM_THREADS,), args, key)


def copy_blocks(
    k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], pairs: list[tuple[int, int]]
) -> None:
    """Copies block src -> dst in every layer with one launch; dst blocks must not also be sources."""
    if not pairs or not k_caches:
        return
    for k, v in zip(k_caches, v_caches, strict=True):
        _check_caches(k, v)
        if k.shape != k_caches[0].shape or v.shape != v_caches[0].shape or k.dtype != k_caches[0].dtype:
            raise ValueError("all layers' caches must share shape and dtype")
    device = k_caches[0].device
    k_block, v_block = (
        c[0].numel() * c.element_size() for c in (k_caches[0], v_caches[0])
    )  # bytes per block
    if k_block % 16 or v_block % 16:
        raise ValueError("blocks must be whole 16-byte units")
    k_ptrs = torch.tensor([c.data_ptr() for c in k_caches], dtype=torch.int64).to(device)  # [layers]
    v_ptrs = torch.tensor([c.data_ptr() for c in v_caches], dtype=torch.int64).to(device)  # [layers]
    pair_t = torch.tensor(pairs, dtype=torch.int32).to(device)  # [pairs, 2]
    kernel = _kernels_of("cache_ops.cu", _CACHE_NAMES)["copy_blocks"]
    args = (_ptr(k_ptrs), _ptr(v_ptrs), _ptr(pair_t), np.int64(k_block // 16), np.int64(v_block // 16))
    _launch(kernel, (len(pairs), len(k_caches)), (_NUM_THREADS,), args, k_caches[0])


def paged_attention(
    out: torch.Tensor,  # [T, Hq, Dv], contiguous
    query: torch.Tensor,  # [T, Hq, D], any strides with D contiguous (e.g. [1, Hq, T, D][0].transpose(0, 1))
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, Dv]
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,  # [Hq]
) -> None:
    """Attention of the step's packed queries over the paged cache (new K/V already cached).

    Decode kernel (split over context partitions, then merged) when every sequence has one query,
    else the prefill/extend kernel.
    """
    _check_caches(k_cache, v_cache)
    tokens, num_heads, head = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if head not in HEAD_SIZES or v_cache.shape[3] != head or k_cache.shape[3] != head:
        raise NotImplementedError(
            f"head sizes {k_cache.shape[3]}/{v_cache.shape[3]}: kernels need D == Dv in {HEAD_SIZES}"
        )
    if block_size not in BLOCK_SIZES or meta.block_size != block_size:
        raise NotImplementedError(f"block size {block_size} (meta {meta.block_size}) not in {BLOCK_SIZES}")
    if num_heads % num_kv_heads or query.dtype != k_cache.dtype or out.dtype != query.dtype:
        raise ValueError(
            f"{num_heads} query heads over {num_kv_heads} KV heads; dtypes {query.dtype}/{k_cache.dtype}"
        )
    if out.shape != query.shape or not out.is_contiguous() or query.stride(2) != 1:
        raise ValueError("out must be contiguous [T, Hq, D] and query's last dim contiguous")
    for name in ("query_start_loc", "context_lens", "block_tables"):
        t = getattr(meta, name)
        if t.dtype != torch.int32 or not t.is_contiguous() or t.device != query.device:
            raise ValueError(f"{name} must be a contiguous int32 tensor on {query.device}")
    if sinks is not None:
        sinks = sinks.to(query.device, torch.float32).contiguous()
    if tokens == 0:
        return
    num_seqs, max_blocks = meta.block_tables.shape
    visible = min(meta.max_context_len, sliding_window) if sliding_window > 0 else meta.max_context_len
    plan = decode_plan(num_heads, num_kv_heads, num_seqs, visible, query.device)
    names = _attention_names(_dtype_name(query), head, block_size, plan.group)
    decode, merge, prefill = (_kernels_of("paged_attention.cu", names)[n] for n in names)
    tables = (_ptr(meta.query_start_loc), _ptr(meta.context_lens), _ptr(meta.block_tables), _ptr(sinks))
    sizes = tuple(map(np.int32, (*query.stride()[:2], num_heads, num_kv_heads, max_blocks)))
    features = (np.float32(scale), np.int32(sliding_window), np.float32(softcap))
    caches = (_ptr(query), _ptr(k_cache), _ptr(v_cache))
    if meta.max_query_len > 1:
        head_blocks = num_kv_heads * math.ceil(num_heads // num_kv_heads / _MAX_GROUP)
        tokens_per_cuda_block = _PREFILL_ROWS // min(num_heads // num_kv_heads, _MAX_GROUP)
        grid = (math.ceil(meta.max_query_len / tokens_per_cuda_block), num_seqs, head_blocks)
        _launch(prefill, grid, (_NUM_THREADS,), (_ptr(out), *caches, *tables, *sizes, *features), query)
        return
    part_acc = part_ml = None
    if plan.partitions > 1:
        part_acc = torch.empty(
            (num_seqs, num_heads, plan.partitions, head), dtype=torch.float32, device=query.device
        )
        part_ml = torch.empty(
            (num_seqs, num_heads, plan.partitions, 2), dtype=torch.float32, device=query.device
        )
    block_shift = np.int32(block_size.bit_length() - 1)
    partition = np.int32(plan.partition_size)
    args = (
        _ptr(out),
        _ptr(part_acc),
        _ptr(part_ml),
        *caches,
        *tables,
        *sizes,
        block_shift,
        *features,
        partition,
    )
    _launch(decode, (plan.head_blocks, num_seqs, plan.partitions), (_NUM_THREADS,), args, query)
    if plan.partitions > 1:
        merge_args = (
            _ptr(out), _ptr(part_acc), _ptr(part_ml), *tables[:2], tables[3],
            np.int32(num_heads), np.int32(plan.partitions), np.int32(sliding_window), partition,
        )  # fmt: skip
        _launch(merge, (num_heads, num_seqs), (_NUM_THREADS,), merge_args, query)


__all__ = [
    "BLOCK_SIZES",
    "DecodePlan",
    "DECODE_BLOCKS_PER_SM",
    "DECODE_GROUPS",
    "PARTITION_QUANTUM",
    "DTYPE_NAMES",
    "HEAD_SIZES",
    "KERNELS_DIR",
    "copy_blocks",
    "decode_group",
    "decode_partitions",
    "decode_plan",
    "is_available",
    "name_expressions",
    "nvrtc_options",
    "paged_attention",
    "reshape_and_cache",
    "set_raw_module_factory",
    "unsupported_reason",
]
