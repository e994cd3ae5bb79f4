"""Which dtype a run uses, and why: ``--dtype auto`` decides by device, CPU instructions and a measurement.

On the CPU, bfloat16 halves the weight and K/V bytes streamed per step, but only CPUs with native
bfloat16 matrix instructions (AMX, AVX512-BF16) multiply it faster than float32; elsewhere (AVX2)
oneDNN converts every operand and bfloat16 GEMMs run slower. So ``auto`` keeps float32 unless the
CPU has those instructions, the model is stored in 16 bits (a float32 checkpoint in bfloat16 would
change its outputs for no saving the user asked for) and a GEMM of the model's own width runs at
least `MIN_SPEEDUP` times faster in bfloat16 on this machine, measured at load time (a fraction of a
second).

An explicit 16-bit choice on a CPU without that type's native matrix instructions runs emulated:
every product converts its operands to float32 and runs slower than float32 itself (docs/models.md
has the figures). It runs as asked, and says so: a note on stderr naming the faster choice
(`emulated_note`) and the report's dtype line.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pagedinfer.config import DTYPE_NAMES, Quantization, torch_dtype
from pagedinfer.kernels.build import cpu_flags

BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")
NATIVE_CPU_FLAGS = {torch.bfloat16: BF16_CPU_FLAGS, torch.float16: ("amx_fp16", "avx512_fp16")}
MIN_SPEEDUP = 1.2  # bfloat16 must beat float32 by this much: below it, noise could pick the slower one
GEMM_ROWS = 64  # a decode batch's rows: the GEMM shape a serving step runs


class DTypeError(ValueError):
    """An unknown dtype name (the message says which names work)."""


@dataclass(frozen=True)
class DTypeChoice:
    dtype: torch.dtype
    reason: str  # one phrase, shown in the report: "--dtype bfloat16", "auto: ..."
    emulated: bool = False  # a 16-bit dtype this CPU has no native matrix instructions for

    @property
    def name(self) -> str:
        return dtype_name(self.dtype)


def dtype_name(dtype: torch.dtype) -> str:
    """``float32`` for ``torch.float32``: how reports and messages name a dtype."""
    return str(dtype).removeprefix("torch.")


def stored_dtype(config) -> torch.dtype | None:
    """The dtype the checkpoint's config says its weights are stored in (None when it does not say).

    transformers >= 5 reads an old config's ``torch_dtype`` into ``dtype``; asking for ``torch_dtype``
    itself only printed its deprecation warning (on every GGUF load, whose config has no dtype)."""
    stored = getattr(config, "dtype", None)
    return stored if isinstance(stored, torch.dtype) else torch_dtype(str(stored).removeprefix("torch."))


def cpu_bf16_flags() -> list[str]:
    """The native bfloat16 matrix instructions the CPU has (none on AVX2-only CPUs)."""
    return cpu_flags(BF16_CPU_FLAGS)


def emulated_words(dtype: torch.dtype, device: torch.device) -> str | None:
    """``emulated on this CPU (no amx_bf16/avx512_bf16)`` when ``dtype`` has native matrix
    instructions on some CPUs but not on this one, else None."""
    flags = NATIVE_CPU_FLAGS.get(dtype)
    if device.type != "cpu" or flags is None or cpu_flags(flags):
        return None
    return f"emulated on this CPU (no {'/'.join(flags)})"


def emulated_note(choice: DTypeChoice) -> str:
    """The one line a run with an emulated dtype prints on stderr: what, why, and the faster choice."""
    why = emulated_words(choice.dtype, torch.device("cpu"))
    return (
        f"pagedinfer: note: {choice.name} runs {why}: float32 is faster here (--dtype float32), "
        "or --quantization int8"
    )


def _explicit(dtype: torch.dtype, reason: str, device: torch.device) -> DTypeChoice:
    why = emulated_words(dtype, device)
    return DTypeChoice(dtype, reason if why is None else f"{reason}; {why}", emulated=why is not None)


def gemm_speedup(width: int, repeats: int = 3) -> float:
    """float32 time / bfloat16 time of a ``[64, width] x [width, 4 * width]`` GEMM (best of ``repeats``)."""
    best = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(GEMM_ROWS, width).to(dtype)  # [64, W]
        b = torch.randn(width, 4 * width).to(dtype)  # [W, 4W]
        a @ b  # warm-up: oneDNN picks and caches its kernel
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - start)
        best[dtype] = min(times)
    return best[torch.float32] / max(best[torch.bfloat16], 1e-9)


def choose_dtype(
    dtype: str | torch.dtype, config, device: torch.device, quantization: Quantization | None = None
) -> DTypeChoice:
    """The run's dtype and the reason for it (explicit, or what ``auto`` found). With ``quantization``
    (int8 or int4 weights, on the CPU) the activations are float32, or bfloat16 when asked for."""
    if dtype != "auto" and not isinstance(dtype, torch.dtype) and dtype not in DTYPE_NAMES:
        raise DTypeError(f"unknown dtype {dtype!r}: use auto, float32, float16 or bfloat16")
    if quantization:
        if device.type != "cpu":
            raise DTypeError(
                f"--quantization {quantization.name} runs on the CPU only (the device is {device.type})"
            )
        wanted = DTYPE_NAMES.get(dtype, dtype)
        if wanted not in ("auto", "float32", "bfloat16", torch.float32, torch.bfloat16):
            raise DTypeError(
                f"--quantization {quantization.name} runs under float32 or bfloat16 activations: use --dtype "
                "auto, float32 or bfloat16"
            )
        act = torch.bfloat16 if wanted in ("bfloat16", torch.bfloat16) else torch.float32
        return DTypeChoice(act, f"{dtype_name(act)} activations; linear weights {quantization.description}")
    if isinstance(dtype, torch.dtype):
        return _explicit(dtype, "given", device)
    if dtype != "auto":
        return _explicit(torch_dtype(dtype), f"--dtype {dtype}", device)
    stored = stored_dtype(config)
    if device.type != "cpu":
        if stored in (torch.float16, torch.bfloat16):
            return DTypeChoice(stored, f"auto: the model is stored in {dtype_name(stored)}")
        return DTypeChoice(torch.float16, "auto: half precision on the GPU (the model is stored in float32)")
    if stored not in (torch.float16, torch.bfloat16):
        return DTypeChoice(torch.float32, "auto: float32 on the CPU (the model is not stored in 16 bits)")
    flags = cpu_bf16_flags()
    if not flags:
        return DTypeChoice(
            torch.float32,
            "auto: float32 on the CPU (no amx_bf16/avx512_bf16: bfloat16 GEMMs are slower here)",
        )
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    width = int(getattr(text, "hidden_size", 0) or 2048)
    speedup = gemm_speedup(width)
    if speedup < MIN_SPEEDUP:
        return DTypeChoice(
            torch.float32,
            f"auto: float32 on the CPU (bfloat16 GEMM measured {speedup:.2f}x float32 here, "
            f"under {MIN_SPEEDUP}x)",
        )
    return DTypeChoice(
        torch.bfloat16,
        f"auto: bfloat16 on the CPU ({'/'.join(flags)}; a {GEMM_ROWS}x{width}x{4 * width} GEMM measured "
        f"{speedup:.2f}x float32)",
    )
