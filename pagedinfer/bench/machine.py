"""What the benchmark ran on: the CPU, the GEMM rate of each dtype, the source tree, process memory."""

from __future__ import annotations

import math
import platform
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

GEMM_BUDGET_S = 5.0  # stop repeating a GEMM after this long (bfloat16 without AMX is slow)


@dataclass(frozen=True)
class GemmRate:
    """Best FLOP/s of a square matmul: per wall second, and per second of process CPU time (the
    steadier figure on a shared machine)."""

    dtype: str
    size: int
    flops: float
    flops_per_cpu_s: float


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def source_state() -> dict:
    """The git commit of the pagedinfer checkout and whether its working tree has changes (if a checkout)."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain"], capture_output=True, text=True
        )
    except OSError:
        return {}
    if head.returncode != 0:
        return {}
    return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip())}


def measure_gemm(size: int, dtype: str = "float32", repeats: int = 10) -> GemmRate:
    """Best of up to ``repeats`` ``size`` x ``size`` matmuls ``a @ w.T`` in ``dtype`` on this process's
    threads, after one warm-up, stopping once GEMM_BUDGET_S has passed. ``w.T`` is a linear layer's
    layout; without native bfloat16 instructions a bfloat16 ``a @ w`` is several times slower."""
    import torch

    dt = getattr(torch, dtype)
    a = torch.randn(size, size, dtype=dt)  # [size, size]
    b = torch.randn(size, size, dtype=dt).t()  # [size, size], transposed as nn.Linear's weight is used
    c = torch.empty(size, size, dtype=dt)  # [size, size]
    torch.matmul(a, b, out=c)  # warm-up
    wall = cpu = math.inf
    start = time.perf_counter()
    for _ in range(repeats):
        t, p = time.perf_counter(), time.process_time()
        torch.matmul(a, b, out=c)
        wall = min(wall, time.perf_counter() - t)
        cpu = min(cpu, time.process_time() - p)
        if time.perf_counter() - start > GEMM_BUDGET_S:
            break
    flops = 2 * size**3
    return GemmRate(dtype, size, flops / wall, flops / max(cpu, 1e-9))


def measure_read_rate(mb: int = 512, repeats: int = 5, clock=time.perf_counter) -> float:
    """GB/s of a float32 sum over ``mb`` MB (best of ``repeats``, timed by ``clock``): the memory's
    read rate on this process's threads (``mb`` must be well past the caches)."""
    import torch

    a = torch.ones(mb * (1 << 20) // 4)  # [mb MiB / 4 bytes]
    best = math.inf
    for _ in range(repeats):
        t = clock()
        a.sum()
        best = min(best, clock() - t)
    return a.numel() * 4 / best / 1e9


def rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def peak_rss_bytes() -> int:
    """This process's RSS high-water mark (VmHWM: reset by exec, unlike ru_maxrss, which keeps the parent's)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
