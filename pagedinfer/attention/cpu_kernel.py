"""The CPU decode-attention kernel (kernels/cpu_paged_decode.c): compiled once, run on all cores.

One instantiation per K/V dtype (float32, bfloat16, float16; float32 arithmetic in all three), and
float32 queries over a bfloat16 or float16 pool (``--kv-cache-dtype``): a 16-bit pool is read at
half the bytes of a float32 one, which is what decode attention is bound by.

Decode is where the torch path would gather every sequence's whole history into a padded copy in
every layer of every step; this kernel reads K/V in place through the block table instead. It is
built with the system C compiler on first use (about a second; `prebuild` builds every CPU kernel at
once when a model loads, saying so in one line) and cached by source and CPU; if no compiler is there, or ``PAGEDINFER_CPU_KERNEL=0``, the torch path runs instead. Its threads are
OpenMP's: the library names libgomp by soname and so gets the copy torch loaded, whose workers are
already awake after each op; a pool of our own would fight them for the cores.
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import hashlib
import itertools
import os
import shutil
import subprocess
import time
from pathlib import Path

import torch

from pagedinfer import envs
from pagedinfer.attention import kernel_cache
from pagedinfer.attention.sources import KERNELS_DIR
from pagedinfer.terminal import keep, note

SOURCE = KERNELS_DIR / "cpu_paged_decode.c"
SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}  # kernel names' suffixes
# (activation dtype, pool dtype) pairs with an instantiation: one dtype, or float32 over a 16-bit pool
PAIRS = [(dt, dt) for dt in SUFFIX] + [(torch.float32, torch.bfloat16), (torch.float32, torch.float16)]
# -DNDEBUG: the kernels' assert()ions (preconditions their callers vouch for) only in the debug build
FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-std=gnu11", "-DNDEBUG"]
THREADING = (["-fopenmp"], ["-fopenmp-simd"])  # libgomp (torch's, by soname); else one thread per call
# GCC's tunings for AMD Zen (what -march=native picks there) leave some `a * b + c` of a chain unfused
# to shorten its latency, so two builds of one kernel (the AVX-512 head tiles and the AVX2 one head
# at a time) round differently; with these off every such product-sum is fused, on every CPU
FMA_CHAIN_TUNINGS = ("avoid_fma_chains", "avoid_fma256_chains", "avoid_fma512_chains")
# how many times slower decode attention runs per call without the kernel, on W1's shape, as the warning
# says (scripts/bench_decode_fallback.py measures it; the figure is in docs/kernels.md)
TORCH_PATH_SLOWDOWN = 18
MIN_WORK_PER_THREAD = 1 << 16  # multiply-adds; below this waking a second thread costs more than it saves


class KernelUnavailable(RuntimeError):
    """A C source could not be built here (no compiler, or the build failed); the message says why."""


class IndexOutOfRange(IndexError):
    """A C kernel refused an index outside the buffer it indexes (nothing was read or written through
    it): a token id past an embedding's rows, a slot or block id past the KV pool, a context longer
    than its block table, a row past its tensor. The message names it and the bound."""


class Refusal(ctypes.Structure):  # kernels/cpu_bounds.h: refusal
    _fields_ = [("at", ctypes.c_int64), ("found", ctypes.c_int64), ("limit", ctypes.c_int64)]


# kernels/cpu_bounds.h's REFUSED_* codes: what was out of range, said with the refusal's fields
REFUSED = {
    1: "the slot {found} of new token {at} is outside the KV pool's {limit} slots",
    2: "sequence {at}'s block table names block {found}, outside the KV pool's {limit} blocks",
    3: "sequence {at}'s context of {found} tokens is outside its block table's {limit} slots",
    4: "sequence {at}'s query row {found} is outside the {limit} query rows",
    5: "thread range {at} ends at sequence {found}, outside the {limit} sequences",
    6: "id {found} at position {at} is outside the table's {limit} rows",
    7: "logits row {found} (entry {at}) is outside the {limit} rows",
    8: "rows {at}:{found} are not a range of the {limit} rows",
}


@functools.cache
def debug() -> bool:
    """The kernels' debug build (``PAGEDINFER_KERNEL_DEBUG=1``, read once as each library is loaded
    once): the bindings then assert the shapes their callers vouch for, per call (else they cost
    microseconds a call, and a layer-by-layer step makes a dozen calls a layer)."""
    return envs.kernel_debug()


def check(code: int, refusal: Refusal, kernel: str) -> None:
    """Raise `IndexOutOfRange` where a kernel returned a refusal ``code`` (0: it ran)."""
    if code:
        what = REFUSED[code].format(at=refusal.at, found=refusal.found, limit=refusal.limit)
        raise IndexOutOfRange(f"{kernel}: {what}")


@functools.cache
def _cpuinfo_field(name: str) -> str:
    """The first ``name`` line's value in /proc/cpuinfo ("" where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    line = next((line for line in text.splitlines() if line.split(":")[0].strip() == name), "")
    return line.partition(":")[2].strip()


def cpu_flags(names: tuple[str, ...]) -> list[str]:
    """Which of ``names`` (instruction-set flags such as ``avx512f``) this CPU reports."""
    flags = _cpuinfo_field("flags").split()
    return [n for n in names if n in flags]


def local_includes(source: Path) -> list[Path]:
    """``source`` and every file it includes with ``#include "..."``, recursively, each once."""
    found: list[Path] = []
    pending = [source]
    while pending:
        path = pending.pop()
        if path in found:
            continue
        found.append(path)
        for line in path.read_text().splitlines():
            if line.startswith('#include "'):
                pending.append(path.parent / line.split('"')[1])
    return found


def _compiler() -> str | None:
    """The C compiler's path; None when ``PAGEDINFER_CPU_KERNEL=0`` asks for the torch path. Raises
    `KernelUnavailable` when there is none."""
    if not envs.cpu_kernels():
        return None
    compiler = shutil.which(envs.c_compiler())
    if compiler is None:
        raise KernelUnavailable(f"no C compiler ({envs.c_compiler()}) on PATH")
    return compiler


@functools.cache
def _fused_flags(compiler: str) -> list[str]:
    """``-mtune-ctrl`` turning off each of `FMA_CHAIN_TUNINGS` this compiler knows (GCC 8-14 know
    some of them; Clang has none and fuses within each expression)."""
    probes = {  # all at once: each is a compiler start, paid by every process that loads a model
        name: subprocess.Popen(
            [compiler, f"-mtune-ctrl=^{name}", "-E", "-x", "c", os.devnull, "-o", os.devnull],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for name in FMA_CHAIN_TUNINGS
    }
    known = [name for name, probe in probes.items() if probe.wait() == 0]
    return [f"-mtune-ctrl={','.join('^' + name for name in known)}"] if known else []


def _targets(source: Path, compiler: str) -> list[tuple[list[str], Path]]:
    """(flags, cached library) of each way to build ``source``, best first: the cache key is its text
    (with every local file it includes), the flags and the CPU. Raises
    `kernel_cache.KernelCacheError` for a cache folder others could write."""
    code = b"".join(path.read_bytes() for path in local_includes(source))
    flags_line = _cpuinfo_field("flags").encode()
    cache = kernel_cache.folder()
    targets = []
    for threading in THREADING:  # a compiler without OpenMP still builds the serial kernel
        debug = ["-UNDEBUG"] if envs.kernel_debug() else []
        flags = FLAGS + _fused_flags(compiler) + debug + envs.c_flags() + threading
        key = hashlib.sha256(code + " ".join(flags).encode() + flags_line).hexdigest()[:20]
        targets.append((flags, cache / f"{source.stem}-{key}.so"))
    return targets


def _start(compiler: str, source: Path, flags: list[str], lib: Path) -> tuple[subprocess.Popen, Path]:
    """Start compiling ``source`` into a temporary file beside ``lib`` (renamed over it once it built)."""
    _say_compiling()
    tmp = lib.with_suffix(f".{os.getpid()}.tmp")
    cmd = [compiler, *flags, str(source), "-o", str(tmp), "-lm"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE), tmp


@functools.cache
def _say_compiling() -> None:
    """One line, once per process, before the first compiler runs: the first run waits for it."""
    note(f"pagedinfer: compiling CPU kernels (once; cached in {keep(str(envs.kernel_cache()))})")


def compile_library(source: Path) -> Path | None:
    """Build ``source`` into a shared library once, cached by its text (with every local file it
    includes), flags and CPU.

    None when ``PAGEDINFER_CPU_KERNEL=0`` asks for the torch path; raises `KernelUnavailable` when
    it cannot be built, `kernel_cache.KernelCacheError` when the cache or the library could have
    been written by another user (it is not loaded then). ``PAGEDINFER_CC_FLAGS`` adds compiler
    flags after ``-march=native`` (e.g. ``-mno-avx512f`` builds the AVX2 kernels on an AVX-512 CPU,
    as the tests do).
    """
    compiler = _compiler()
    if compiler is None:
        return None
    targets = _targets(source, compiler)
    cached = [lib for _, lib in targets if lib.exists()]
    if cached:
        return kernel_cache.library(cached[0])
    for flags, lib in targets:
        proc, tmp = _start(compiler, source, flags, lib)
        _, stderr = proc.communicate()
        if proc.returncode == 0:
            return kernel_cache.seal(tmp, lib)
    raise KernelUnavailable(f"{compiler} could not build {source.name}: {stderr.decode()[-300:].strip()}")


def optional_library(source: Path) -> ctypes.CDLL | None:
    """``source`` built and loaded, or None where the C kernels are off or cannot be built: the kernels
    beside the decode kernel fall back to torch then, and the decode kernel's message already said why."""
    try:
        path = compile_library(source)
    except KernelUnavailable:
        return None
    return None if path is None else ctypes.CDLL(str(path))


def prebuild(sources: list[Path]) -> float:
    """Compile every source not in the cache yet, all at once (one compiler each, in parallel), so that
    no compile lands inside a timed generation; the seconds it took (0.0 when every one was cached).

    A source that fails here is left to `compile_library`, which tries the serial build and says why.
    Raises `kernel_cache.KernelCacheError` for a cache folder, or a library cached there, that
    another user could have written (so a model load refuses it before any kernel runs).
    """
    try:
        compiler = _compiler()
    except KernelUnavailable:
        return 0.0  # said once, by the first kernel that is asked for
    each = [(s, _targets(s, compiler)) for s in sources] if compiler is not None else []
    cached = [lib for _, targets in each for _, lib in targets if lib.exists()]
    for lib in cached:  # one another user could have written refuses the load, before any runs
        kernel_cache.library(lib)
    missing = [(s, targets[0]) for s, targets in each if not any(lib in cached for _, lib in targets)]
    if not missing:
        return 0.0
    start = time.perf_counter()
    builds = [(lib, *_start(compiler, source, flags, lib)) for source, (flags, lib) in missing]
    for lib, proc, tmp in builds:
        proc.communicate()
        if proc.returncode == 0:
            kernel_cache.seal(tmp, lib)
        else:
            tmp.unlink(missing_ok=True)
    return time.perf_counter() - start


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
