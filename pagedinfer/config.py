"""Engine settings and the sizing of the KV pool."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pagedinfer.sampling_params import MAX_SEED, MIN_SEED

if TYPE_CHECKING:  # torch is imported where a dtype or a device is used: the CLI's options need none
    import torch

CPU_DEFAULT_KV_BYTES = 2 << 30  # like vLLM's CPU default space, capped by what the run can use
GPU_MEMORY_FRACTION = 0.85

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9}
_UNITS.update({"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "t": 10**12, "tb": 10**12, "tib": 1 << 40})


def parse_size(text: str | int) -> int:
    """'512MiB', '2GB', '1.5g' or a plain byte count -> bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size: use e.g. 512MiB, 2GB or a byte count")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


@dataclass(frozen=True)
class PoolSize:
    """How many KV blocks the pool has, and what decided it (shown in the memory report)."""

    num_blocks: int
    origin: Literal["num_blocks", "kv_cache_memory", "gpu_memory_utilization", "default_cpu", "default_gpu"]
    kv_cache_memory: int | None = None  # the byte budget, when it decided
    gpu_memory_utilization: float = GPU_MEMORY_FRACTION  # the share of free GPU memory, on CUDA

    def __str__(self) -> str:
        """The ``pool.source`` value of ``--report-json`` (documented)."""
        if self.origin == "num_blocks":
            return f"num_blocks={self.num_blocks}"
        if self.origin == "kv_cache_memory":
            return f"kv_cache_memory={self.kv_cache_memory} bytes"
        if self.origin == "gpu_memory_utilization":
            return (
                f"gpu_memory_utilization={self.gpu_memory_utilization}: {self.gpu_memory_utilization:.0%} of "
                "free GPU memory, capped at max_num_seqs x max_model_len"
            )
        if self.origin == "default_gpu":
            return f"default: {GPU_MEMORY_FRACTION:.0%} of free GPU memory, capped at max_num_seqs x max_model_len"
        return "default: 2 GiB on the CPU, capped at max_num_seqs x max_model_len"


SCHEDULE_POLICIES = ("lpm", "fcfs")  # the scheduler's admission orders (core/scheduler.py)


@dataclass(frozen=True)
class Quantization:
    """Weight-only quantization of a float checkpoint's linears at load (``--quantization``, CPU): int8
    per output row, or int4 per ``group`` inputs with float32 scales and optional zero points."""

    name: str  # int8, int4, int4-zp, int4-g128, int4-g128-zp
    bits: int
    group: int = 0  # int4: 32 or 128
    zero_points: bool = False

    @property
    def description(self) -> str:
        if self.bits == 8:
            return "int8 per output channel"
        zp = "zero points" if self.zero_points else "symmetric"
        return f"int4 per group of {self.group} inputs (float32 scales, {zp})"


def _int4_name(group: int, zero_points: bool) -> str:
    return f"int4{'' if group == 32 else f'-g{group}'}{'-zp' if zero_points else ''}"


QUANTIZATIONS = {
    "int8": Quantization("int8", 8),
    **{
        _int4_name(g, zp): Quantization(_int4_name(g, zp), 4, g, zp)
        for g in (32, 128)
        for zp in (False, True)
    },
}

# the dtype names --dtype and --kv-cache-dtype take (with the usual aliases) -> torch's name of the dtype
DTYPE_NAMES = {
    "float32": "float32",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "fp32": "float32",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
}


def torch_dtype(name: str) -> torch.dtype | None:
    """The torch dtype a `DTYPE_NAMES` name stands for (None for any other name)."""
    import torch

    return getattr(torch, DTYPE_NAMES[name]) if name in DTYPE_NAMES else None


SPECULATIVE_METHODS = ("ngram",)  # drafts with no second model (core/speculative.py)
SPECULATIVE_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``speculative_config`` keys): each step, a decoding sequence may
    have up to ``num_speculative_tokens`` drafted tokens verified after its own; ``ngram`` drafts copy
    what followed the sequence's last ``prompt_lookup_min``..``prompt_lookup_max`` tokens earlier in its
    prompt and output, or in its sibling completions (docs/speculative.md). Outputs are unchanged."""

    num_speculative_tokens: int
    method: str = "ngram"
    # vLLM's defaults: neither given, both 5; one given, the other takes its value
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict) -> SpeculativeConfig:
        """From ``speculative_config``'s dict (or as it is); ValueError names the key that is wrong."""
        if isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(
                f"speculative_config must be a dict of {', '.join(SPECULATIVE_KEYS)}, not {value!r}"
            )
        if unknown := sorted(set(value) - set(SPECULATIVE_KEYS)):
            raise ValueError(
                f"speculative_config: unknown key {unknown[0]!r} (known: {', '.join(SPECULATIVE_KEYS)})"
            )
        method = value.get("method", "ngram")
        if method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {', '.join(SPECULATIVE_METHODS)}, not {method!r}"
            )
        if "num_speculative_tokens" not in value:
            raise ValueError(
                "speculative_config needs num_speculative_tokens (the most drafted tokens a step)"
            )
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        lo, hi = (
            (5, 5)
            if lo is None and hi is None
            else (lo if lo is not None else hi, hi if hi is not None else lo)
        )
        for name, v in (
            ("num_speculative_tokens", value["num_speculative_tokens"]),
            ("prompt_lookup_min", lo),
            ("prompt_lookup_max", hi),
        ):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"speculative_config.{name} must be an integer >= 1, not {v!r}")
        if lo > hi:
            raise ValueError(
                f"speculative_config: prompt_lookup_min ({lo}) is above prompt_lookup_max ({hi})"
            )
        return cls(value["num_speculative_tokens"], method, lo, hi)


@dataclass
class EngineConfig:
    block_size: int = 16
    num_blocks: int | None = None  # exact pool size; else from kv_cache_memory; else a default
    kv_cache_memory: int | str | None = None  # bytes or '512MiB'
    # CUDA: the share of free GPU memory (after the weights) the pool takes (vLLM's name); None: the default
    gpu_memory_utilization: float | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    max_model_len: int | None = None  # default: the model's context length
    seed: int = 0  # seeds the per-request seeds of requests that give none
    enable_prefix_caching: bool = True  # reuse the K/V of full prompt blocks across requests
    schedule_policy: str = "lpm"  # admission order: "lpm" longest cached prefix first, or "fcfs"
    enforce_eager: bool = False  # no CUDA graphs for decode steps (vLLM's name); graphs exist on CUDA only
    # the pool's dtype (vLLM's name): "auto" (the model's), or one of DTYPE_NAMES
    kv_cache_dtype: str = "auto"
    # LoRA adapters per request (vLLM's names): requests of at most max_loras distinct adapters run at
    # once (the adapters' slots), at most max_cpu_loras adapters stay in memory (None: max_loras), each
    # of rank <= max_lora_rank
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # per-run bounds on every request (pagedinfer's own): at most max_line_tokens tokens per completion,
    # on top of its own max_tokens, and at most line_timeout seconds from its admission; either ends a
    # completion with finish_reason "length", marked (CompletionOutput.capped_by)
    max_line_tokens: int | None = None
    line_timeout: float | None = None
    # most logprobs a request may ask per token (logprobs, prompt_logprobs; vLLM's name and default):
    # a record's size grows with them; -1: no limit
    max_logprobs: int = 20
    # speculative decoding (vLLM's name): a dict of `SpeculativeConfig`'s keys, or None (off)
    speculative_config: SpeculativeConfig | dict | None = None

    def __post_init__(self) -> None:
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError("block_size must be a power of two from 1 to 128")
        if self.num_blocks is not None and self.kv_cache_memory is not None:
            raise ValueError("give num_blocks or kv_cache_memory, not both")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_size(self.kv_cache_memory)
        if self.gpu_memory_utilization is not None:
            if self.num_blocks is not None or self.kv_cache_memory is not None:
                which = "num_blocks" if self.num_blocks is not None else "kv_cache_memory"
                raise ValueError(f"give {which} or gpu_memory_utilization, not both")
            fraction = self.gpu_memory_utilization
            if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
                raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1], not {fraction!r}")
        if (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not MIN_SEED <= self.seed <= MAX_SEED
        ):
            # a request's own seed has this range (SamplingParams): the base seed takes the same one
            raise ValueError(f"seed must be an integer from -2**63 to 2**64 - 1, not {self.seed!r}")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in DTYPE_NAMES:
            raise ValueError(
                f"kv_cache_dtype must be auto, float32, float16 or bfloat16, not {self.kv_cache_dtype!r}"
            )
        length = self.max_model_len  # 0 read as "not set" would silently mean the model's whole context
        if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 1):
            raise ValueError(
                f"max_model_len must be an integer >= 1, not {length!r} (unset: the model's context)"
            )
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_loras", "max_lora_rank"):
            value = getattr(self, name)  # each checked alone, so an error names the one setting that is wrong
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, not {value!r}")
        cap = self.max_line_tokens
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ValueError(f"max_line_tokens must be an integer >= 1, not {cap!r} (unset: no cap)")
        timeout = self.line_timeout
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf
        ):
            raise ValueError(f"line_timeout must be a number of seconds > 0, not {timeout!r} (unset: none)")
        if self.max_cpu_loras is not None:
            value = self.max_cpu_loras
            if isinstance(value, bool) or not isinstance(value, int) or value < self.max_loras:
                raise ValueError(
                    f"max_cpu_loras must be an integer >= max_loras ({self.max_loras}), not {value!r}"
                )
        limit = self.max_logprobs
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < -1:
            raise ValueError(f"max_logprobs must be an integer >= 0, or -1 for no limit, not {limit!r}")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(
                f"schedule_policy must be one of {', '.join(SCHEDULE_POLICIES)}, not {self.schedule_policy!r}"
            )

    def kv_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The pool's dtype: the model's (``auto``), or a 16-bit one under float32 activations (half the
        K/V bytes to hold and to read per decode step; keys and values rounded as they are written)."""
        import torch

        if self.kv_cache_dtype == "auto":
            return model_dtype
        kv = torch_dtype(self.kv_cache_dtype)
        if kv != model_dtype and model_dtype != torch.float32:
            model = str(model_dtype).removeprefix("torch.")
            raise ValueError(
                f"kv_cache_dtype {self.kv_cache_dtype} under {model} activations: a pool of another dtype "
                "than the model's is served under float32 activations only; use auto"
            )
        return kv

    def pool_size(self, bytes_per_block: int, device: torch.device, max_model_len: int) -> PoolSize:
        """Number of blocks of the pool, and what decided it; a pool the device's free memory cannot
        hold is refused here, naming the setting, before anything is allocated."""
        size = self._pool_size(bytes_per_block, device, max_model_len)
        need, free = size.num_blocks * bytes_per_block, _free_memory(device)
        if need > free:
            if size.origin == "num_blocks":
                setting, fix = f"num_blocks={size.num_blocks:,}", "give num_blocks a smaller value"
            elif size.origin == "kv_cache_memory":
                setting, fix = (
                    f"kv_cache_memory={self.kv_cache_memory:,} bytes",
                    "give kv_cache_memory a smaller value",
                )
            else:
                setting, fix = "the default pool size", "set num_blocks or kv_cache_memory"
            where = "GPU memory" if device.type == "cuda" else "memory"
            raise ValueError(
                f"{setting} needs {need / 2**30:,.1f} GiB of KV cache but only {free / 2**30:,.1f} GiB of "
                f"{where} is free; {fix}"
            )
        return size

    def _pool_size(self, bytes_per_block: int, device: torch.device, max_model_len: int) -> PoolSize:
        if self.num_blocks is not None:
            return PoolSize(self.num_blocks, "num_blocks")
        if self.kv_cache_memory is not None:
            blocks = self.kv_cache_memory // bytes_per_block
            if blocks < 1:
                raise ValueError(
                    f"kv_cache_memory={self.kv_cache_memory} bytes is smaller than one block ({bytes_per_block} bytes)"
                )
            return PoolSize(blocks, "kv_cache_memory", self.kv_cache_memory)
        useful = -(-max_model_len // self.block_size) * self.max_num_seqs  # more can never be used
        if device.type == "cuda":
            import torch

            fraction = self.gpu_memory_utilization or GPU_MEMORY_FRACTION
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * fraction)  # weights are loaded; the rest is for activations
            origin = "default_gpu" if self.gpu_memory_utilization is None else "gpu_memory_utilization"
            return PoolSize(max(1, min(useful, budget // bytes_per_block)), origin, None, fraction)
        if self.gpu_memory_utilization is not None:
            raise ValueError(
                "gpu_memory_utilization sizes the KV pool on CUDA only; on the CPU give kv_cache_memory or "
                "num_blocks"
            )
        return PoolSize(max(1, min(useful, CPU_DEFAULT_KV_BYTES // bytes_per_block)), "default_cpu")


def _free_memory(device: torch.device) -> int:
    """Bytes the device can still give (the model's weights are loaded by now)."""
    if device.type == "cuda":
        import torch

        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available
