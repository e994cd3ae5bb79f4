"""The GPU side of `pagedinfer bench --device cuda`: the device's measured peaks, and where GPU time goes.

The peaks are measured at the start of the run (a large bfloat16 matmul, a device-to-device copy)
and printed, and each system's FLOP rate and HBM traffic are read as fractions of what this device
reached in the same run: no datasheet is assumed, so the same figures mean the same on any GPU.
The time split comes from a short `torch.profiler` window of a few steps
in the middle of an untimed second run, each GPU kernel classed as attention, GEMM or other by its
name (`classify`; on the CPU the same classes apply to aten op names, which the tests use).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

# first match wins: fused attention kernels may carry "cutlass" or "gemm" in their names too
ATTENTION_MARKERS = (
    "paged_decode",
    "paged_prefill",
    "reshape_and_cache",
    "attention",
    "attn",
    "flash",
    "fmha",
)
GEMM_MARKERS = (
    "gemm",
    "gemv",
    "nvjet",  # cuBLAS's Hopper kernels
    "xmma",
    "cutlass",
    "cublas",
    "splitk",
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::baddbmm",
    "aten::_addmm_activation",
    "mkldnn_linear",
)
CLASSES = ("attention", "gemm", "other")
PROFILE_STEPS = 5  # steps in each system's profiler window


def classify(name: str) -> str:
    """``attention``, ``gemm`` or ``other`` for a GPU kernel's (or a CPU aten op's) name."""
    low = name.lower()
    if any(m in low for m in ATTENTION_MARKERS):
        return "attention"
    if any(m in low for m in GEMM_MARKERS):
        return "gemm"
    return "other"


def split_times(events: Iterable[tuple[str, float]]) -> dict:
    """Microseconds per class over ``(name, us)`` events, their shares, and the top kernels of each."""
    us = dict.fromkeys(CLASSES, 0.0)
    per_name: dict[str, float] = {}
    for name, t in events:
        us[classify(name)] += t
        per_name[name] = per_name.get(name, 0.0) + t
    total = sum(us.values())
    top = sorted(per_name.items(), key=lambda kv: -kv[1])[:8]
    return {
        "us": us,
        "share": {c: (us[c] / total if total else 0.0) for c in CLASSES},
        "total_us": total,
        "top": [{"name": n[:120], "class": classify(n), "us": t} for n, t in top],
    }


def profiled_split(run: Callable[[Callable[[], None]], None], device: str, wait: int, active: int) -> dict:
    """Profile ``active`` steps after ``wait`` steps of ``run(step)``, which must call ``step()`` once
    per engine (or generate) step; returns `split_times` of the GPU kernels (CPU: of aten ops' self
    time) in the window, with the window's size. ``run`` may stop once ``step`` raises `WindowDone`."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    calls = 0
    with profile(activities=activities, schedule=schedule(wait=wait, warmup=1, active=active)) as prof:

        def step() -> None:
            nonlocal calls
            calls += 1
            prof.step()
            if calls >= wait + 1 + active:
                raise WindowDone

        with contextlib.suppress(WindowDone):
            run(step)
    if calls < wait + 1 + active:
        return {
            "error": f"the run ended after {calls} steps, before the profile window ({wait} + 1 + {active})"
        }
    if device == "cuda":
        events = [
            (e.name, e.time_range.elapsed_us()) for e in prof.events() if e.device_type == DeviceType.CUDA
        ]
    else:
        events = [(e.key, e.self_cpu_time_total) for e in prof.key_averages() if e.key.startswith("aten::")]
    return {**split_times(events), "window_steps": active, "after_steps": wait + 1}


class WindowDone(Exception):
    """Raised by the profiler's step callback once the window is recorded: the run may stop."""


@dataclass(frozen=True)
class GpuRates:
    """The device and its measured peaks (best of several timed runs, CUDA events)."""

    name: str
    memory_bytes: int
    matmul_size: int
    bf16_flops: float  # a square bfloat16 matmul, FLOP/s
    copy_bytes: int
    copy_bytes_per_s: float  # a device-to-device copy, bytes read + written per second


def cuda_problem() -> str | None:
    """Why ``--device cuda`` cannot run here (None: it can)."""
    import torch

    if not torch.cuda.is_available():
        return "--device cuda: torch sees no CUDA device (the GPU workloads G1, G2 need one)"
    return None


def measure_gpu(matmul_size: int = 8192, copy_bytes: int = 2 << 30, repeats: int = 10) -> GpuRates:
    """The bfloat16 matmul rate and the copy bandwidth this GPU reaches, after a warm-up each."""
    import torch

    def best_ms(fn: Callable[[], object]) -> float:
        fn()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end))
        return best

    def matmul_ms(n: int) -> float:
        a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")  # [n, n]
        w = torch.randn(n, n, dtype=torch.bfloat16, device="cuda").t()  # [n, n], a linear layer's layout
        c = torch.empty(n, n, dtype=torch.bfloat16, device="cuda")  # [n, n]
        return best_ms(lambda: torch.matmul(a, w, out=c))

    def copy_ms(size: int) -> float:
        src = torch.empty(size, dtype=torch.uint8, device="cuda")  # [size]
        dst = torch.empty_like(src)  # [size]
        return best_ms(lambda: dst.copy_(src))

    n = matmul_size
    flops = 2 * n**3 / (matmul_ms(n) / 1e3)
    copy_rate = 2 * copy_bytes / (copy_ms(copy_bytes) / 1e3)
    props = torch.cuda.get_device_properties(0)
    return GpuRates(
        name=props.name,
        memory_bytes=props.total_memory,
        matmul_size=n,
        bf16_flops=flops,
        copy_bytes=copy_bytes,
        copy_bytes_per_s=copy_rate,
    )
