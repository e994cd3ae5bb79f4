"""Every ``PAGEDINFER_*`` environment switch, read here and nowhere else (vLLM's ``envs`` shape).

Each is read when it is needed, not at import, so a test can set one with ``monkeypatch.setenv``.
docs/development.md lists them with the test suite's own switches.
"""

from __future__ import annotations

import os
from pathlib import Path


def _off(name: str) -> bool:
    return os.environ.get(name, "1") == "0"


def kernel_cache() -> Path:
    """``PAGEDINFER_CACHE``: where compiled kernels are kept (C kernels, and the CUDA kernels built for
    the CPU under ``cuda_on_cpu/``). Default: per user, ``$XDG_CACHE_HOME/pagedinfer/kernels``
    (``~/.cache/pagedinfer/kernels`` where XDG_CACHE_HOME is unset or not absolute, as the XDG
    specification says). `attention.kernel_cache` checks that no one else can write it."""
    given = os.environ.get("PAGEDINFER_CACHE")
    if given:
        return Path(given)
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "pagedinfer" / "kernels"


def c_compiler() -> str:
    """``CC``: the C compiler that builds the CPU kernels (default ``cc``)."""
    return os.environ.get("CC", "cc")


def c_flags() -> list[str]:
    """``PAGEDINFER_CC_FLAGS``: extra flags for the CPU kernels' compiler, after the defaults (e.g.
    ``-mno-avx512f`` builds the AVX2 panels on an AVX-512 CPU; the tests compare the two)."""
    return os.environ.get("PAGEDINFER_CC_FLAGS", "").split()


def kernel_debug() -> bool:
    """``PAGEDINFER_KERNEL_DEBUG=1``: the CPU kernels' debug build, their assert()ions compiled in
    (``-UNDEBUG``), and their bindings asserting the shapes their callers vouch for (the sanitizer tier)."""
    return os.environ.get("PAGEDINFER_KERNEL_DEBUG") == "1"


def cpu_kernels() -> bool:
    """``PAGEDINFER_CPU_KERNEL=0``: no C kernels at all (torch's attention path; debugging)."""
    return not _off("PAGEDINFER_CPU_KERNEL")


def decode_step() -> bool:
    """``PAGEDINFER_DECODE_STEP=0``: decode steps layer by layer instead of one C call (same bits)."""
    return not _off("PAGEDINFER_DECODE_STEP")


def pack_weights() -> bool:
    """``PAGEDINFER_PACK_WEIGHTS=0``: leave float linears as torch modules (no packed GEMM weights)."""
    return not _off("PAGEDINFER_PACK_WEIGHTS")


def cpu_gemm() -> str:
    """``PAGEDINFER_CPU_GEMM=onednn``: the CPU's linears in oneDNN's layout, outside the reproducibility
    contract (default ``panels``: the C panel kernel on every CPU)."""
    return os.environ.get("PAGEDINFER_CPU_GEMM", "panels")


def malloc_tuning() -> bool:
    """``PAGEDINFER_MALLOC_TUNING=0``: leave glibc malloc's defaults (step buffers returned to the OS)."""
    return not _off("PAGEDINFER_MALLOC_TUNING")


def cuda_cpu_cxxflags() -> list[str]:
    """``PAGEDINFER_CPU_CXXFLAGS``: compiler flags of the CUDA kernels built for the CPU (default ``-O2``;
    e.g. ``-O1 -fsanitize=address``)."""
    return os.environ.get("PAGEDINFER_CPU_CXXFLAGS", "-O2").split()


def cuda_cpu_probes() -> int:
    """``PAGEDINFER_CPU_REVERSE=1`` / ``PAGEDINFER_CPU_EAGER_COPIES=1``: the CUDA-on-CPU shim runs a
    block's threads in reverse order / makes asynchronous copies eager (tests: races show up)."""
    return int(os.environ.get("PAGEDINFER_CPU_REVERSE") == "1") | 2 * int(
        os.environ.get("PAGEDINFER_CPU_EAGER_COPIES") == "1"
    )


def gguf_cache() -> Path:
    """``PAGEDINFER_GGUF_CACHE``: where GGUF files' converted configs, tokenizers and packed panels are
    kept, one folder per file content hash, beside the files' digests by identity (``digests/``)
    (default ``~/.cache/pagedinfer/gguf``)."""
    return Path(os.environ.get("PAGEDINFER_GGUF_CACHE", Path.home() / ".cache" / "pagedinfer" / "gguf"))


def tokenizer_cache() -> Path:
    """``PAGEDINFER_TOKENIZER_CACHE``: where the snapshots of tokenizers transformers loaded are kept
    (`model.tokenizer_snapshot`), one folder per content of the files read and versions (default
    ``~/.cache/pagedinfer/tokenizers``)."""
    default = Path.home() / ".cache" / "pagedinfer" / "tokenizers"
    return Path(os.environ.get("PAGEDINFER_TOKENIZER_CACHE", default))


def kill_in_resume_write() -> int | None:
    """``PAGEDINFER_TEST_KILL_IN_RESUME_WRITE=N`` (tests): the run's Nth write of unfinished lines'
    tokens (``<output>.resume.lines``) stops half way through and the process kills itself (SIGKILL)."""
    value = os.environ.get("PAGEDINFER_TEST_KILL_IN_RESUME_WRITE", "")
    return int(value) if value.isdigit() else None
