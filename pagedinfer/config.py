"""The settings of an `LLM` (`ModelConfig`, `EngineConfig`) and of a run's lines, and the sizing of the KV pool.

Each setting is declared once, as a dataclass field: its type and default, and in its metadata
(`option`) how it is offered (the command line's flag, help text and help panel, vLLM's name for
it, and whether it decides what a record holds, so that ``--resume`` keeps it). Everything else is
made from the declarations: `LLM`'s keyword arguments, the typer options of ``pagedinfer run`` and
``pagedinfer bench`` (`cli.options`), the options ``--resume`` keeps (`cli.resume`), the option
words of the engine's messages and of the report, and the configuration a Ray replica is sent.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pagedinfer.sampling_params import MAX_SEED, MIN_SEED, BeamSearchParams, SamplingParams

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
    layer_groups: int = 1  # num_blocks given: the pool holds that many blocks per layer group

    def __str__(self) -> str:
        """The ``pool.source`` value of ``--report-json`` (documented)."""
        if self.origin == "num_blocks":
            groups = f" x {self.layer_groups} layer groups" if self.layer_groups > 1 else ""
            return f"num_blocks={self.num_blocks // self.layer_groups}{groups}"
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
DEVICES = ("auto", "cpu", "cuda")  # what the command line offers (the API also takes "cuda:1"...)
MODEL_IMPLS = ("auto", "pagedinfer", "transformers")  # vLLM's --model-impl names
MATMUL_NUMERICS = ("exact", "llama.cpp")  # how quantized weights multiply (model/packed_linear.py)
LOAD_FORMATS = ("auto", "dummy")  # vLLM's --load-format names: the checkpoint's weights, or random ones


@dataclass(frozen=True)
class Option:
    """How a setting is offered, beside its field's name, type and default.

    ``flags``: the command line's names; ``()`` derives ``--name-with-dashes``, None keeps the
    setting to the Python API (one the command line sets another way says how in ``help``).
    ``panel``: the help panel that lists it (`cli.options.PANELS`; None: the first, "Options").
    ``choices``: the values the command line offers (what they mean is checked where they are used).
    ``cli_default`` and ``cli_type``: the command line's own default and value type, where they
    differ from the field's (None standing for "not given", a file for a text). ``old_flag``: a
    former name, still taken, not shown. ``vllm``: vLLM's name for the setting where it has one.
    ``resume``: the setting changes what a record holds, so ``--resume`` keeps it and refuses another
    value (the words it is shown with are its flag).
    """

    help: str
    flags: tuple[str, ...] | None = ()
    panel: str | None = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    show_default: bool = True
    cli_default: Any = ...  # ...: the field's
    cli_type: Any = None
    old_flag: str | None = None
    vllm: str | None = None
    resume: bool = False


def option(default: Any, help: str, **how: Any) -> Any:
    """A dataclass field with ``default``, offered as `Option` (``help`` and ``how``) says."""
    return dataclasses.field(default=default, metadata={"option": Option(help, **how)})


@dataclass(frozen=True)
class Setting:
    """A declared setting: the field's name, type and default, and how it is offered."""

    name: str
    type: Any  # the field's annotation, resolved
    default: Any
    option: Option

    @property
    def flags(self) -> tuple[str, ...]:
        """The command line's names (none: the Python API alone)."""
        if self.option.flags is None:
            return ()
        return self.option.flags or ("--" + self.name.replace("_", "-"),)

    @property
    def flag(self) -> str | None:
        """The name the command line knows it by: its first long flag (``--prefix-caching``)."""
        names = [f.split("/")[0] for f in self.flags]
        return next((f for f in names if f.startswith("--")), names[0] if names else None)

    @property
    def cli_default(self) -> Any:
        return self.default if self.option.cli_default is ... else self.option.cli_default


@functools.cache
def settings(cls: type) -> tuple[Setting, ...]:
    """The settings a dataclass declares, in its field order (fields without `option` are not settings)."""
    hints = typing.get_type_hints(cls)
    return tuple(
        Setting(f.name, hints[f.name], f.default, f.metadata["option"])
        for f in dataclasses.fields(cls)
        if "option" in f.metadata
    )


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
DTYPES = ("auto", *dict.fromkeys(DTYPE_NAMES.values()))  # what --dtype and --kv-cache-dtype offer


def torch_dtype(name: str) -> torch.dtype | None:
    """The torch dtype a `DTYPE_NAMES` name stands for (None for any other name)."""
    import torch

    return getattr(torch, DTYPE_NAMES[name]) if name in DTYPE_NAMES else None


# ngram: drafts with no second model (core/speculative.py); draft_model: a small decoder's greedy
# tokens (engine/draft_model.py)
SPECULATIVE_METHODS = ("ngram", "draft_model")
SPECULATIVE_KEYS = (
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "suffix_decoding_max_cached_requests",
)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``speculative_config`` keys): each step, a decoding sequence may
    have up to ``num_speculative_tokens`` drafted tokens verified after its own; ``ngram`` drafts copy
    what followed the sequence's last ``prompt_lookup_min``..``prompt_lookup_max`` tokens earlier in its
    prompt and output, in its sibling completions or in the lines finished earlier in the run (the last
    ``suffix_decoding_max_cached_requests`` of them); ``draft_model`` drafts ``model``'s greedy
    tokens (a small decoder with the target's vocabulary). A grammar's forced tokens are drafts under
    either (docs/speculative.md). Outputs are unchanged."""

    num_speculative_tokens: int
    method: str = "ngram"
    # vLLM's defaults: neither given, both 5; one given, the other takes its value
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    # finished lines whose tokens later lines may copy (oldest dropped first; 0: none kept)
    suffix_decoding_max_cached_requests: int = 256
    model: str | None = None  # the draft model (method draft_model): a path, hub id or .gguf file

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
        model = value.get("model")
        method = value.get("method", "ngram" if model is None else "draft_model")  # vLLM infers it
        if method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {', '.join(SPECULATIVE_METHODS)}, not {method!r}"
            )
        if "num_speculative_tokens" not in value:
            raise ValueError(
                "speculative_config needs num_speculative_tokens (the most drafted tokens a step)"
            )
        if (method == "draft_model") != (model is not None):
            raise ValueError(
                "speculative_config: method draft_model needs model (the draft model's path or id)"
                if model is None
                else f"speculative_config.model is for method draft_model, not {method!r}"
            )
        if model is not None and (not isinstance(model, str) or not model):
            raise ValueError(f"speculative_config.model must be a model path or id, not {model!r}")
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
        cached = value.get("suffix_decoding_max_cached_requests", cls.suffix_decoding_max_cached_requests)
        if isinstance(cached, bool) or not isinstance(cached, int) or cached < 0:
            raise ValueError(
                f"speculative_config.suffix_decoding_max_cached_requests must be an integer >= 0, not {cached!r}"
            )
        return cls(value["num_speculative_tokens"], method, lo, hi, cached, model)


@dataclass
class ModelConfig:
    """What an `LLM` loads and runs (`model.loader.load_model`'s arguments): ``model`` is a local
    Hugging Face model directory, a hub id or a ``.gguf`` file (None: the embedded demo model). No
    check here: the loader refuses what it cannot load, in its own words."""

    model: str | None = option(
        None,
        "Hugging Face hub id, local model directory or .gguf file. Default: the embedded demo model.",
        flags=("--model", "-m"),
        metavar="MODEL",
        show_default=False,
        vllm="model",
        resume=True,
    )
    device: str = option("auto", "Where to run.", panel="pool", choices=DEVICES)
    dtype: str = option(
        "auto",
        "Weight and KV dtype (auto: float32 on the CPU unless bfloat16 is measured faster; half on a GPU).",
        panel="pool",
        choices=DTYPES,
        vllm="dtype",
        resume=True,
    )
    quantization: str | None = option(
        None,
        "Weight-only quantization of a float checkpoint on the CPU: int8 = every linear's weight in "
        "int8 with a float32 scale per output channel; int4 = 4 bits per weight with a float32 scale per "
        "group of 32 inputs (-g128: of 128; -zp: with zero points). Activations float32, or bfloat16 with "
        "--dtype bfloat16; outputs close to the unquantized model's, not equal. A GGUF "
        "file keeps its own types without it. Default: none.",
        panel="pool",
        choices=tuple(QUANTIZATIONS),
        show_default=False,
        vllm="quantization",
        resume=True,
    )
    matmul_numerics: str = option(
        "exact",
        "Products of quantized weights: exact = the float32 products of the dequantized weights; "
        "llama.cpp = GGUF Q4_0, Q4_1 and Q8_0 weights, and --quantization int8 / int4 ones, times activations "
        "quantized per block of 32 to int8 (integer dot products, as llama.cpp computes them): faster, close "
        "to exact, not equal; "
        "float32 activations only.",
        panel="pool",
        choices=MATMUL_NUMERICS,
        resume=True,
    )
    model_impl: str = option(
        "auto",
        "Modeling code: pagedinfer's own (llama, mistral, qwen2, qwen3, qwen3_moe, qwen2_moe, mixtral, olmoe, "
        "gpt_oss), "
        "transformers', or auto "
        "(pagedinfer's where it applies, on the CPU).",
        panel="pool",
        choices=MODEL_IMPLS,
        vllm="model_impl",
        resume=True,
    )
    load_format: str = option(
        "auto",
        "auto: the checkpoint's weights; dummy: random ones drawn from the config (benchmarks).",
        flags=None,
        choices=LOAD_FORMATS,
        vllm="load_format",
    )
    # the Jinja text; the command line reads it from a file
    chat_template: str | None = option(
        None,
        "A Jinja chat template file for chat lines, instead of the tokenizer's.",
        panel="sampling",
        metavar="FILE",
        show_default=False,
        cli_type=Path,
        vllm="chat_template",
        resume=True,
    )
    # CUDA: the CuPy attention kernels (None: where they load) or torch's
    use_cuda_kernels: bool | None = option(None, "CUDA: the CuPy kernels or torch's attention.", flags=None)


@dataclass
class EngineConfig:
    block_size: int = option(
        16, "Tokens per KV block (1..128, power of two).", panel="pool", vllm="block_size"
    )
    # exact pool size; else from kv_cache_memory; else a default
    num_blocks: int | None = option(
        None,
        "Exact number of KV blocks in the pool (with windowed layers: per layer group).",
        panel="pool",
        show_default=False,
        vllm="num_gpu_blocks_override",
    )
    kv_cache_memory: int | str | None = option(  # bytes or '512MiB'
        None,
        "KV pool size in bytes, e.g. 512MiB, 2GB. Default: 2 GiB on the CPU, --gpu-memory-utilization of "
        "free GPU memory (both capped at what --max-num-seqs sequences of the model's context can use).",
        panel="pool",
        metavar="SIZE",
        show_default=False,
        cli_type=str,
        old_flag="--kv-memory",
        vllm="kv_cache_memory_bytes",
    )
    # CUDA: the share of free GPU memory (after the weights) the pool takes; None: the default
    gpu_memory_utilization: float | None = option(
        None,
        "CUDA only: the fraction of free GPU memory (after the weights) the KV pool takes. "
        f"Default: {GPU_MEMORY_FRACTION}.",
        panel="pool",
        show_default=False,
        vllm="gpu_memory_utilization",
    )
    max_num_seqs: int = option(256, "Most sequences running at once.", panel="pool", vllm="max_num_seqs")
    max_num_batched_tokens: int = option(
        4096,
        "Most tokens computed per engine step.",
        panel="pool",
        old_flag="--max-batched-tokens",
        vllm="max_num_batched_tokens",
    )
    max_model_len: int | None = option(  # default: the model's context length
        None,
        "Context length limit (default: the model's).",
        panel="pool",
        show_default=False,
        vllm="max_model_len",
        resume=True,
    )
    seed: int = option(  # seeds the per-request seeds of requests that give none
        0,
        "Base seed: a line without its own seed samples with a seed derived from this and the line's id, "
        "so its output does not depend on the other lines (or on --resume).",
        panel="sampling",
        vllm="seed",
        resume=True,
    )
    enable_prefix_caching: bool = option(  # reuse the K/V of full prompt blocks across requests
        True,
        "Reuse the K/V of prompt blocks that earlier requests computed (same leading tokens).",
        flags=("--prefix-caching/--no-prefix-caching",),
        panel="pool",
        vllm="enable_prefix_caching",
    )
    schedule_policy: str = option(  # admission order: "lpm" longest cached prefix first, or "fcfs"
        "lpm",
        "Which waiting line is admitted first: lpm = the longest cached prompt prefix (lines sharing a "
        "prefix run while it is cached), fcfs = input order.",
        panel="pool",
        choices=SCHEDULE_POLICIES,
        vllm="scheduling_policy",
    )
    enforce_eager: bool = option(  # no CUDA graphs for decode steps; graphs exist on CUDA only
        False,
        "On CUDA: no CUDA graphs; decode steps run eagerly (default: graphs captured at startup, one per "
        "batch-size bucket). No effect on the CPU.",
        panel="pool",
        vllm="enforce_eager",
    )
    # the pool's dtype: "auto" (the model's), or one of DTYPE_NAMES
    kv_cache_dtype: str = option(
        "auto",
        "The KV pool's dtype: auto = the model's; bfloat16 or float16 under float32 activations = twice "
        "the tokens per byte of pool and half the bytes read by decode attention (K/V rounded as "
        "written: outputs close to a float32 pool's, not equal).",
        panel="pool",
        choices=DTYPES,
        vllm="kv_cache_dtype",
        resume=True,
    )
    # LoRA adapters per request: requests of at most max_loras distinct adapters run at once (the
    # adapters' slots), at most max_cpu_loras adapters stay in memory (None: max_loras), each of rank
    # <= max_lora_rank; the command line sets them from its --lora adapters
    enable_lora: bool = option(False, "Set by --lora NAME=PATH.", flags=None, vllm="enable_lora")
    max_loras: int = option(
        1,
        "Most adapters in one step (their deltas held at once): lines of other adapters wait, and adapters "
        "are swapped in and out. Default: the number of --lora.",
        panel="lora",
        cli_default=None,
        show_default=False,
        vllm="max_loras",
    )
    max_cpu_loras: int | None = option(
        None,
        "Most adapters kept in memory (at least --max-loras); the others are read again when their lines "
        "run. Default: the number of --lora.",
        panel="lora",
        show_default=False,
        vllm="max_cpu_loras",
    )
    max_lora_rank: int = option(16, "Highest adapter rank accepted.", panel="lora", vllm="max_lora_rank")
    # per-run bounds on every request (pagedinfer's own): at most max_line_tokens tokens per completion,
    # on top of its own max_tokens, and at most line_timeout seconds from its admission; either ends a
    # completion with finish_reason "length", marked (CompletionOutput.capped_by)
    max_line_tokens: int | None = option(
        None,
        "Cap every completion of every line at N tokens, whatever its own max_tokens (the lower wins); a "
        'capped completion ends with finish_reason length and "capped_by": "max_line_tokens".',
        panel="sampling",
        metavar="N",
        show_default=False,
        resume=True,
    )
    line_timeout: float | None = option(
        None,
        "End a line still generating this long after it started: its completions end at their next "
        'token with finish_reason length and "capped_by": "line_timeout" (output depends on the '
        "machine's speed).",
        panel="sampling",
        metavar="SECONDS",
        show_default=False,
        resume=True,
    )
    # most logprobs a request may ask per token (logprobs, prompt_logprobs; vLLM's default): a
    # record's size grows with them; -1: no limit. A line above it is an error record, below it a success
    max_logprobs: int = option(
        20,
        "Most logprobs a line may ask per token (logprobs, an OpenAI chat body's top_logprobs, "
        "prompt_logprobs); a line above it fails with its error. -1: no limit.",
        panel="output",
        vllm="max_logprobs",
        resume=True,
    )
    # speculative decoding (vLLM's name): a dict of `SpeculativeConfig`'s keys, or None (off); outputs
    # are unchanged with it, so --resume does not keep it
    speculative_config: SpeculativeConfig | dict | None = option(
        None,
        'Speculative decoding, as vLLM\'s: \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 3, "prompt_lookup_min": 1}\', or a draft model\'s: \'{"method": '
        '"draft_model", "model": "draft.gguf", "num_speculative_tokens": 4}\'. Outputs are '
        "byte-identical to a run without it. Default: off.",
        panel="pool",
        metavar="JSON",
        show_default=False,
        cli_type=dict,
        vllm="speculative_config",
    )

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

    def pool_size(
        self, bytes_per_block: int, device: torch.device, max_model_len: int, num_groups: int = 1
    ) -> PoolSize:
        """Number of blocks of the pool, and what decided it; a pool the device's free memory cannot
        hold is refused here, naming the setting, before anything is allocated. ``num_groups``: the
        model's layer groups, each taking its own blocks."""
        size = self._pool_size(bytes_per_block, device, max_model_len, num_groups)
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

    def _pool_size(
        self, bytes_per_block: int, device: torch.device, max_model_len: int, num_groups: int
    ) -> PoolSize:
        if self.num_blocks is not None:  # blocks of every layer: as many blocks of each group's layers
            return PoolSize(self.num_blocks * num_groups, "num_blocks", layer_groups=num_groups)
        if self.kv_cache_memory is not None:
            blocks = self.kv_cache_memory // bytes_per_block
            if blocks < 1:
                raise ValueError(
                    f"kv_cache_memory={self.kv_cache_memory} bytes is smaller than one block ({bytes_per_block} bytes)"
                )
            return PoolSize(blocks, "kv_cache_memory", self.kv_cache_memory)
        useful = -(-max_model_len // self.block_size) * self.max_num_seqs * num_groups  # more is never used
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


@dataclass(frozen=True)
class LLMConfig:
    """Everything an `LLM` is built from: its keyword arguments, split between what it loads and how
    its engine runs, and checked (`of`). Plain data, so a Ray replica is sent it whole."""

    model_config: ModelConfig
    engine_config: EngineConfig

    @classmethod
    def of(cls, model: str | None = None, **options: Any) -> LLMConfig:
        """`LLM`'s arguments as a config: a ValueError names a setting whose value is refused, a
        TypeError one that is not a setting (with ours, where vLLM's name for it was given)."""
        loaded = {s.name for s in settings(ModelConfig)}
        engine = {s.name for s in settings(EngineConfig)}
        for name in options:
            if name not in loaded | engine:
                ours = next((s.name for s in llm_settings() if s.option.vllm == name), None)
                hint = f" (vLLM's name; here it is {ours})" if ours else ""
                raise TypeError(f"LLM.__init__() got an unexpected keyword argument {name!r}{hint}")
        return cls(
            ModelConfig(model=model, **{k: v for k, v in options.items() if k in loaded}),
            EngineConfig(**{k: v for k, v in options.items() if k in engine}),
        )

    def options(self) -> dict[str, Any]:
        """The keyword arguments of `LLM` (and `of`) that make this config."""
        return dataclasses.asdict(self.model_config) | dataclasses.asdict(self.engine_config)


def llm_settings() -> tuple[Setting, ...]:
    """`LLM`'s keyword arguments, in its signature's order: what it loads, then how its engine runs."""
    return settings(ModelConfig) + settings(EngineConfig)


def line_default(name: str, help: str, params: type = SamplingParams, **how: Any) -> Setting:
    """A field of ``params`` (vLLM's name and meaning) that a run sets for every line that does not
    set it itself: its type and default are the field's; a run keeps it for ``--resume``."""
    field = params.__dataclass_fields__[name]
    how = {"panel": "sampling", "vllm": name, "resume": True} | how
    return Setting(name, typing.get_type_hints(params)[name], field.default, Option(help, **how))


# the sampling defaults of ``pagedinfer run``, a line's own fields override them (in the order
# ``--resume`` keeps them)
LINE_DEFAULTS = (
    line_default("n", "Completions per prompt.", flags=("-n",)),
    line_default(
        "max_tokens",
        "Most tokens generated per completion. Default: 16 for prompt and token-id lines; chat and OpenAI "
        "lines generate to the end of the context, as OpenAI and vLLM's server do.",
        cli_default=None,  # not given: each line's kind decides
        show_default=False,
    ),
    line_default("temperature", "0 = greedy; else at least 0.01 (docs/cli.md)."),
    line_default("top_p", "Nucleus sampling mass in (0, 1]."),
    line_default("top_k", "Keep the k most likely tokens (0 or -1: off)."),
    line_default("min_p", "Drop tokens below min_p × the top probability."),
    line_default("stop", "Stop string (repeat for several).", cli_type=list[str], show_default=False),
    line_default(
        "beam_width",
        "Beam search with this many beams (0: off). Output: the beams with their cumulative "
        "log-probabilities, best first. Plain lines only; a line's beam_width overrides it.",
        params=BeamSearchParams,
        cli_default=0,
    ),
)


def flag_of(name: str) -> str:
    """The command-line option that sets ``name`` (an `LLM` setting or a line default)."""
    return next(s.flag for s in (*llm_settings(), *LINE_DEFAULTS) if s.name == name)


def engine_option_words(message: str) -> str:
    """``message`` (an `EngineConfig` or engine error) with each engine setting's name replaced by the
    option that sets it (whole words only: ``seed`` names --seed, never a part of another word)."""
    for s in settings(EngineConfig):
        if s.flag is not None:
            message = re.sub(rf"(?<![\w-]){s.name}(?![\w-])", s.flag, message)
    return message


def _free_memory(device: torch.device) -> int:
    """Bytes the device can still give (the model's weights are loaded by now)."""
    if device.type == "cuda":
        import torch

        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available
