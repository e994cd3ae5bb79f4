"""The CPU decode-attention kernel's bindings (kernels/cpu_paged_decode.c): the K/V write, decode
attention over the paged pool, and the split of a step's sequences among the threads.

One instantiation per K/V dtype (float32, bfloat16, float16; float32 arithmetic in all three), and
float32 queries over a bfloat16 or float16 pool (``--kv-cache-dtype``): a 16-bit pool is read at
half the bytes of a float32 one, which is what decode attention is bound by.

Decode is where the torch path would gather every sequence's whole history into a padded copy in
every layer of every step; this kernel reads K/V in place through the block table instead. Where it
cannot be built (`build`), the torch path runs instead, and `_unavailable` says so once.
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import itertools

import torch

from pagedinfer.kernels.abi import SUFFIX, Refusal, check, debug
from pagedinfer.kernels.build import KernelUnavailable, compile_library
from pagedinfer.kernels.sources import KERNELS_DIR
from pagedinfer.terminal import note

SOURCE = KERNELS_DIR / "cpu_paged_decode.c"
# (activation dtype, pool dtype) pairs with an instantiation: one dtype, or float32 over a 16-bit pool
PAIRS = [(dt, dt) for dt in SUFFIX] + [(torch.float32, torch.bfloat16), (torch.float32, torch.float16)]
# how many times slower decode attention runs per call without the kernel, on W1's shape, as the warning
# says (scripts/bench_decode_fallback.py measures it; the figure is in docs/kernels.md)
TORCH_PATH_SLOWDOWN = 18
MIN_WORK_PER_THREAD = 1 << 16  # multiply-adds; below this waking a second thread costs more than it saves


@functools.cache
def _library() -> ctypes.CDLL | None:
    try:
        lib = compile_library(SOURCE)
    except KernelUnavailable as e:
        return _unavailable(str(e))
    if lib is None:
        return None
    dll = ctypes.CDLL(str(lib))
    ptr, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    refusal = ctypes.POINTER(Refusal)
    for q, kv in PAIRS:  # f16 only where the compiler has _Float16
        fn = getattr(dll, f"paged_decode_ranges_{_name(q, kv)}", None)
        if fn is not None:
            fn.argtypes = (
                [ptr, i32] + [ptr] * 7 + [i32] * 6 + [i64, i64, f32, i32, f32, ptr, i32, i64, i64, refusal]
            )
            fn.restype = ctypes.c_int  # 0, or what was out of range
            store = getattr(dll, f"store_kv_{_name(q, kv)}")
            store.argtypes = [ptr] * 5 + [i32] * 4 + [i64] * 5 + [refusal]
            store.restype = ctypes.c_int
    return dll


def _unavailable(why: str) -> None:
    """Say once, on stderr, that decode attention runs slower (the torch path) and why."""
    note(
        f"pagedinfer: the CPU decode kernel is unavailable ({why}); decode attention falls back to the "
        f"torch path, about {TORCH_PATH_SLOWDOWN}x slower per call. Install a C compiler (gcc) to fix it."
    )
    return None


def _name(q: torch.dtype, kv: torch.dtype) -> str:
    """The instantiation's suffix: ``f32`` for one dtype, ``f32_kv_f16`` for float32 over a float16 pool."""
    return SUFFIX[q] if q == kv else f"{SUFFIX[q]}_kv_{SUFFIX[kv]}"


def available(dtype: torch.dtype = torch.float32, kv_dtype: torch.dtype | None = None) -> bool:
    """The kernel built, with an instantiation for queries of ``dtype`` over K/V of ``kv_dtype`` (the
    same by default)."""
    lib = _library()
    pair = (dtype, kv_dtype or dtype)
    return lib is not None and pair in PAIRS and hasattr(lib, f"paged_decode_ranges_{_name(*pair)}")


def supports(num_heads: int, num_kv_heads: int, head_dim: int, head_dim_v: int, block_size: int) -> bool:
    """The kernel's limits: 8-float rows; heads, head size and block size bounded because they size
    its per-call working memory (logit rows, accumulators, one widened block; about a megabyte at
    the shapes served)."""
    return (
        head_dim % 8 == 0
        and head_dim_v % 8 == 0
        and max(head_dim, head_dim_v) <= 512
        and num_heads <= 128
        and block_size <= 128
    )


def store_kv(
    k_cache: torch.Tensor,  # [NB, bs, kvh, D]
    v_cache: torch.Tensor,  # [NB, bs, kvh, Dv] the same dtype
    k: torch.Tensor,  # [T, kvh, D] the pool's dtype, or float32 over a 16-bit pool; last dim contiguous
    v: torch.Tensor,  # [T, kvh, Dv] k's dtype, last dim contiguous
    slots: torch.Tensor,  # [T] int64, contiguous
) -> None:
    """Write the step's K/V rows at their slots, rounded to the pool's dtype as ``.to()`` rounds: one C
    loop instead of two index_copy_ calls per layer. A slot outside the pool: `IndexOutOfRange`, nothing
    written (a negative slot is padding, skipped)."""
    if debug():  # what the caller vouches for
        assert k.shape[1:] == k_cache.shape[2:] and v.shape[:2] == k.shape[:2]
        assert v.shape[2] == v_cache.shape[3] and slots.shape == k.shape[:1]
        assert k_cache.shape[:3] == v_cache.shape[:3] and k_cache.is_contiguous() and v_cache.is_contiguous()
        assert slots.dtype == torch.int64 and slots.is_contiguous()
    refusal = Refusal()
    code = getattr(_library(), f"store_kv_{_name(k.dtype, k_cache.dtype)}")(
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        slots.data_ptr(),
        k.shape[0],
        k.shape[1],
        k.shape[2],
        v.shape[2],
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.shape[0] * k_cache.shape[1],
        refusal,
    )
    check(code, refusal, "store_kv")


def split(ctx_lens: list[int], madds_per_key: int) -> ctypes.Array:
    """Sequence ranges of about equal context length, one per thread: bounds ``[0, ..., S]`` (int32).

    Computed once per step (every layer of the same shape reuses it)."""
    work = list(itertools.accumulate(ctx_lens))  # [S] keys read up to each sequence
    if not work:
        return (ctypes.c_int32 * 1)(0)  # no sequences: no ranges
    total = work[-1]
    threads = min(torch.get_num_threads(), len(work), max(1, total * madds_per_key // MIN_WORK_PER_THREAD))
    cuts = []
    for k in range(1, threads):
        target = k * total / threads
        i = bisect.bisect_left(work, target)  # work[i] >= target: end after i if that is nearer
        cuts.append(i + 1 if work[i] - target < target - (work[i - 1] if i else 0) else i)
    return (ctypes.c_int32 * (threads + 1))(0, *cuts, len(work))


def paged_decode(
    out: torch.Tensor,  # [T, Hq, Dv] q's dtype, contiguous
    q: torch.Tensor,  # [T, Hq, D] the pool's dtype, or float32 over a 16-bit pool; last dim contiguous
    k_cache: torch.Tensor,  # [NB, bs, kvh, D] float32, bfloat16 or float16
    v_cache: torch.Tensor,  # [NB, bs, kvh, Dv] same dtype
    block_tables: torch.Tensor,  # [S, max_blocks] int32, contiguous
    ctx_lens: torch.Tensor,  # [S] int32
    rows: torch.Tensor,  # [S] int64: packed-row index of each sequence's query token
    bounds: ctypes.Array,  # [threads + 1] int32 from split(): one range of sequences per thread
    scale: float,
    window: int,
    softcap: float,
    sinks: torch.Tensor | None,  # [Hq] float32
) -> None:
    """Write attention outputs of ``S`` single-token queries into ``out[rows]``. A block id outside the
    pool, a context longer than its table or a row outside ``q``: `IndexOutOfRange`, nothing written."""
    seqs, max_blocks = block_tables.shape
    num_blocks, block_size, kvh, head_dim = k_cache.shape
    if debug():  # what the caller vouches for
        assert out.is_contiguous() and out.shape == (*q.shape[:2], v_cache.shape[3])
        assert q.shape[2] == head_dim and (sinks is None or sinks.shape == q.shape[1:2])
        assert k_cache.shape[:3] == v_cache.shape[:3] and k_cache.is_contiguous() and v_cache.is_contiguous()
        assert block_tables.dtype == ctx_lens.dtype == torch.int32 and rows.dtype == torch.int64
        assert block_tables.is_contiguous() and ctx_lens.is_contiguous() and rows.is_contiguous()
        assert ctx_lens.shape == rows.shape == (seqs,)
    if not (out.dtype == q.dtype and k_cache.dtype == v_cache.dtype and (q.dtype, k_cache.dtype) in PAIRS):
        raise TypeError(
            f"out and q must share one dtype and the K/V pool be that dtype or, under float32, a 16-bit one; "
            f"got {out.dtype}, {q.dtype}, {k_cache.dtype}"
        )
    sinks = None if sinks is None else sinks.detach().float().contiguous()
    refusal = Refusal()
    code = getattr(_library(), f"paged_decode_ranges_{_name(q.dtype, k_cache.dtype)}")(
        bounds,
        len(bounds) - 1,
        out.data_ptr(),
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        ctx_lens.data_ptr(),
        rows.data_ptr(),
        max_blocks,
        block_size,
        q.shape[1],
        kvh,
        head_dim,
        v_cache.shape[3],
        q.stride(0),
        q.stride(1),
        scale,
        window,
        softcap,
        None if sinks is None else sinks.data_ptr(),
        seqs,
        num_blocks,
        q.shape[0],
        refusal,
    )
    check(code, refusal, "paged_decode")
