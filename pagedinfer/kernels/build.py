"""Building the C kernels: each library compiled once with the system C compiler, cached by its sources,
flags and CPU, and loaded.

A library is named by its root translation unit ``kernels/cpu_<name>.c`` and links every other unit
whose header it includes (`sources.translation_units`). It is built on first use (about a second;
`prebuild` builds every library at once when a model loads, saying so in one line) and cached in
`kernel_cache`; if no compiler is there, or ``PAGEDINFER_CPU_KERNEL=0``, the torch paths run instead.
Threads are OpenMP's: a library names libgomp by soname and so gets the copy torch loaded, whose
workers are already awake after each op; a pool of our own would fight them for the cores.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import time
from pathlib import Path

from pagedinfer import envs
from pagedinfer.kernels import kernel_cache
from pagedinfer.kernels.sources import library_roots, local_includes, translation_units
from pagedinfer.terminal import keep, note

# -DNDEBUG: the kernels' assert()ions (preconditions their callers vouch for) only in the debug build
FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-std=gnu11", "-DNDEBUG"]
THREADING = (["-fopenmp"], ["-fopenmp-simd"])  # libgomp (torch's, by soname); else one thread per call
# GCC's tunings for AMD Zen (what -march=native picks there) leave some `a * b + c` of a chain unfused
# to shorten its latency, so two builds of one kernel (the AVX-512 head tiles and the AVX2 one head
# at a time) round differently; with these off every such product-sum is fused, on every CPU
FMA_CHAIN_TUNINGS = ("avoid_fma_chains", "avoid_fma256_chains", "avoid_fma512_chains")


class KernelUnavailable(RuntimeError):
    """A C source could not be built here (no compiler, or the build failed); the message says why."""


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
    """(flags, cached library) of each way to build the library of root ``source``, best first: the
    cache key is the text of its translation units (with every local file they include), the flags and
    the CPU. Raises `kernel_cache.KernelCacheError` for a cache folder others could write."""
    code = b"".join(path.read_bytes() for path in local_includes(*translation_units(source)))
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
    """Start compiling the library of root ``source`` (its translation units) into a temporary file
    beside ``lib`` (renamed over it once it built)."""
    _say_compiling()
    tmp = lib.with_suffix(f".{os.getpid()}.tmp")
    cmd = [compiler, *flags, *map(str, translation_units(source)), "-o", str(tmp), "-lm"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE), tmp


@functools.cache
def _say_compiling() -> None:
    """One line, once per process, before the first compiler runs: the first run waits for it."""
    note(f"pagedinfer: compiling CPU kernels (once; cached in {keep(str(envs.kernel_cache()))})")


def compile_library(source: Path) -> Path | None:
    """Build the library of root ``source`` (it and the units it links, `translation_units`) once,
    cached by their text (with every local file they include), flags and CPU.

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


def prebuild(sources: list[Path] | None = None) -> float:
    """Compile every library (of ``sources``' roots; default: every one, `library_roots`) not in the
    cache yet, all at once (one compiler each, in parallel), so that no compile lands inside a timed
    generation; the seconds it took (0.0 when every one was cached).

    A source that fails here is left to `compile_library`, which tries the serial build and says why.
    Raises `kernel_cache.KernelCacheError` for a cache folder, or a library cached there, that
    another user could have written (so a model load refuses it before any kernel runs).
    """
    try:
        compiler = _compiler()
    except KernelUnavailable:
        return 0.0  # said once, by the first kernel that is asked for
    roots = library_roots() if sources is None else sources
    each = [(s, _targets(s, compiler)) for s in roots] if compiler is not None else []
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
