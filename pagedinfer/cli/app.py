"""The ``pagedinfer`` command line: ``run`` a prompts file, draw the KV ``blocks``, ``--version``.

Exit codes of ``run`` (docs/cli.md): 0 all lines succeeded, 1 some lines failed, 2 unusable
invocation (or the output is locked by another run), 74 the output could not be written (disk
full), 130 / 143 / 129 stopped by SIGINT / SIGTERM / SIGHUP (finished lines are on disk;
``--resume`` completes the rest).

Option defaults come from `EngineConfig` and `SamplingParams`, never repeated here.
"""

from __future__ import annotations

import sys
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from pagedinfer.cli.help import HelpCommand, HelpGroup
from pagedinfer.cli.progress import PROGRESS_INTERVAL_S
from pagedinfer.config import GPU_MEMORY_FRACTION, QUANTIZATIONS, EngineConfig
from pagedinfer.sampling_params import SamplingParams
from pagedinfer.terminal import note, say


def _default(cls: type, name: str):
    """The dataclass field default of ``cls.name``: the one place each default is written."""
    return cls.__dataclass_fields__[name].default


app = typer.Typer(
    name="pagedinfer",
    help="Offline batch LLM inference on a paged KV cache, with a memory-usage report.",
    cls=HelpGroup,
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


class Device(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class ModelImpl(str, Enum):
    auto = "auto"
    pagedinfer = "pagedinfer"
    transformers = "transformers"


class SchedulePolicy(str, Enum):
    lpm = "lpm"
    fcfs = "fcfs"


class DType(str, Enum):
    auto = "auto"
    float32 = "float32"
    float16 = "float16"
    bfloat16 = "bfloat16"


class ProgressMode(str, Enum):
    auto = "auto"
    bar = "bar"
    log = "log"
    none = "none"


# --quantization's choices: config.QUANTIZATIONS' names (int8, int4, int4-zp, int4-g128, int4-g128-zp)
Quantization = Enum("Quantization", {name.replace("-", "_"): name for name in QUANTIZATIONS}, type=str)


def _version(value: bool) -> None:
    if value:
        from pagedinfer import __version__

        typer.echo(f"pagedinfer {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool | None,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit."),
    ] = None,
) -> None:
    """Offline batch LLM inference on a paged KV cache, with a memory-usage report.

    [bold]pagedinfer run PROMPTS.jsonl[/] generates for every line of a JSONL file;
    [bold]pagedinfer blocks[/] draws the KV pool and block tables step by step.
    """


SAMPLING = "Sampling (defaults; per-line fields override)"
POOL = "KV cache and scheduling"
OUTPUT = "Output and reporting"
LORA = "LoRA adapters"
SCALE = r"Data parallel on Ray (pip install 'pagedinfer\[ray]')"  # \[: not rich markup


@app.command(cls=HelpCommand)
def run(
    ctx: typer.Context,
    prompts: Annotated[
        Path,
        typer.Argument(
            help="JSONL file: one request per line ({'prompt': ...}, {'messages': [...]}, "
            "{'prompt_token_ids': [...]} or an OpenAI Batch API request line).",
            show_default=False,
            metavar="PROMPTS.jsonl",
        ),
    ],
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            "-m",
            metavar="MODEL",
            help="Hugging Face hub id, local model directory or .gguf file. Default: the embedded demo model.",
            show_default=False,
        ),
    ] = None,
    n: Annotated[
        int, typer.Option("-n", help="Completions per prompt.", rich_help_panel=SAMPLING)
    ] = _default(SamplingParams, "n"),
    max_tokens: Annotated[
        int | None,
        typer.Option(
            "--max-tokens",
            help="Most tokens generated per completion. Default: 16 for prompt and token-id lines; chat and "
            "OpenAI lines generate to the end of the context, as OpenAI and vLLM's server do.",
            show_default=False,
            rich_help_panel=SAMPLING,
        ),
    ] = None,
    max_line_tokens: Annotated[
        int | None,
        typer.Option(
            "--max-line-tokens",
            metavar="N",
            help="Cap every completion of every line at N tokens, whatever its own max_tokens (the lower "
            'wins); a capped completion ends with finish_reason length and "capped_by": "max_line_tokens".',
            show_default=False,
            rich_help_panel=SAMPLING,
        ),
    ] = None,
    line_timeout: Annotated[
        float | None,
        typer.Option(
            "--line-timeout",
            metavar="SECONDS",
            help="End a line still generating this long after it started: its completions end at their next "
            'token with finish_reason length and "capped_by": "line_timeout" (output depends on the '
            "machine's speed).",
            show_default=False,
            rich_help_panel=SAMPLING,
        ),
    ] = None,
    temperature: Annotated[
        float,
        typer.Option(
            "--temperature", help="0 = greedy; else at least 0.01 (docs/cli.md).", rich_help_panel=SAMPLING
        ),
    ] = _default(SamplingParams, "temperature"),
    top_p: Annotated[
        float, typer.Option("--top-p", help="Nucleus sampling mass in (0, 1].", rich_help_panel=SAMPLING)
    ] = _default(SamplingParams, "top_p"),
    top_k: Annotated[
        int,
        typer.Option(
            "--top-k", help="Keep the k most likely tokens (0 or -1: off).", rich_help_panel=SAMPLING
        ),
    ] = _default(SamplingParams, "top_k"),
    min_p: Annotated[
        float,
        typer.Option(
            "--min-p", help="Drop tokens below min_p × the top probability.", rich_help_panel=SAMPLING
        ),
    ] = _default(SamplingParams, "min_p"),
    beam_width: Annotated[
        int,
        typer.Option(
            "--beam-width",
            help="Beam search with this many beams (0: off). Output: the beams with their cumulative "
            "log-probabilities, best first. Plain lines only; a line's beam_width overrides it.",
            rich_help_panel=SAMPLING,
        ),
    ] = 0,
    seed: Annotated[
        int,
        typer.Option(
            "--seed",
            help="Base seed: a line without its own seed samples with a seed derived from this and the "
            "line's id, so its output does not depend on the other lines (or on --resume).",
            rich_help_panel=SAMPLING,
        ),
    ] = _default(EngineConfig, "seed"),
    stop: Annotated[
        list[str] | None,
        typer.Option(
            "--stop", help="Stop string (repeat for several).", rich_help_panel=SAMPLING, show_default=False
        ),
    ] = None,
    block_size: Annotated[
        int,
        typer.Option(
            "--block-size", help="Tokens per KV block (1..128, power of two).", rich_help_panel=POOL
        ),
    ] = _default(EngineConfig, "block_size"),
    num_blocks: Annotated[
        int | None,
        typer.Option(
            "--num-blocks",
            help="Exact number of KV blocks in the pool.",
            show_default=False,
            rich_help_panel=POOL,
        ),
    ] = None,
    kv_cache_memory: Annotated[
        str | None,
        typer.Option(
            "--kv-cache-memory",
            metavar="SIZE",
            help="KV pool size in bytes, e.g. 512MiB, 2GB. Default: 2 GiB on the CPU, "
            "--gpu-memory-utilization of free GPU memory (both capped at what --max-num-seqs sequences "
            "of the model's context can use).",
            show_default=False,
            rich_help_panel=POOL,
        ),
    ] = None,
    kv_memory: Annotated[str | None, typer.Option("--kv-memory", hidden=True)] = None,  # the old name
    gpu_memory_utilization: Annotated[
        float | None,
        typer.Option(
            "--gpu-memory-utilization",
            help=f"CUDA only: the fraction of free GPU memory (after the weights) the KV pool takes. "
            f"Default: {GPU_MEMORY_FRACTION}.",
            show_default=False,
            rich_help_panel=POOL,
        ),
    ] = None,
    max_num_seqs: Annotated[
        int, typer.Option("--max-num-seqs", help="Most sequences running at once.", rich_help_panel=POOL)
    ] = _default(EngineConfig, "max_num_seqs"),
    max_num_batched_tokens: Annotated[
        int,
        typer.Option(
            "--max-num-batched-tokens", help="Most tokens computed per engine step.", rich_help_panel=POOL
        ),
    ] = _default(EngineConfig, "max_num_batched_tokens"),
    max_batched_tokens: Annotated[
        int | None, typer.Option("--max-batched-tokens", hidden=True)  # the old name
    ] = None,
    max_model_len: Annotated[
        int | None,
        typer.Option(
            "--max-model-len",
            help="Context length limit (default: the model's).",
            show_default=False,
            rich_help_panel=POOL,
        ),
    ] = None,
    prefix_caching: Annotated[
        bool,
        typer.Option(
            "--prefix-caching/--no-prefix-caching",
            help="Reuse the K/V of prompt blocks that earlier requests computed (same leading tokens).",
            rich_help_panel=POOL,
        ),
    ] = True,
    schedule_policy: Annotated[
        SchedulePolicy,
        typer.Option(
            "--schedule-policy",
            help="Which waiting line is admitted first: lpm = the longest cached prompt prefix "
            "(lines sharing a prefix run while it is cached), fcfs = input order.",
            rich_help_panel=POOL,
        ),
    ] = SchedulePolicy.lpm,
    device: Annotated[
        Device, typer.Option("--device", help="Where to run.", rich_help_panel=POOL)
    ] = Device.auto,
    enforce_eager: Annotated[
        bool,
        typer.Option(
            "--enforce-eager",
            help="On CUDA: no CUDA graphs; decode steps run eagerly (default: graphs captured at startup, "
            "one per batch-size bucket). No effect on the CPU.",
            rich_help_panel=POOL,
        ),
    ] = _default(EngineConfig, "enforce_eager"),
    dtype: Annotated[
        DType,
        typer.Option(
            "--dtype",
            help="Weight and KV dtype (auto: float32 on the CPU unless bfloat16 is measured faster; half on a GPU).",
            rich_help_panel=POOL,
        ),
    ] = DType.auto,
    quantization: Annotated[
        Quantization | None,
        typer.Option(
            "--quantization",
            help="Weight-only quantization of a float checkpoint on the CPU: int8 = every linear's weight in "
            "int8 with a float32 scale per output channel; int4 = 4 bits per weight with a float32 scale per "
            "group of 32 inputs (-g128: of 128; -zp: with zero points). Activations float32, or bfloat16 with "
            "--dtype bfloat16; outputs close to the unquantized model's, not equal. A GGUF "
            "file keeps its own types without it. Default: none.",
            show_default=False,
            rich_help_panel=POOL,
        ),
    ] = None,
    kv_cache_dtype: Annotated[
        DType,
        typer.Option(
            "--kv-cache-dtype",
            help="The KV pool's dtype: auto = the model's; bfloat16 or float16 under float32 activations = "
            "twice the tokens per byte of pool and half the bytes read by decode attention (K/V rounded as "
            "written: outputs close to a float32 pool's, not equal).",
            rich_help_panel=POOL,
        ),
    ] = DType.auto,
    model_impl: Annotated[
        ModelImpl,
        typer.Option(
            "--model-impl",
            help="Modeling code: pagedinfer's own (llama, mistral, qwen2, qwen3), transformers', or auto "
            "(pagedinfer's where it applies, on the CPU).",
            rich_help_panel=POOL,
        ),
    ] = ModelImpl.auto,
    threads: Annotated[
        int | None,
        typer.Option(
            "--threads",
            help="Torch threads (and the C kernels' OpenMP threads). Default: torch's, one per core.",
            show_default=False,
            rich_help_panel=POOL,
        ),
    ] = None,
    lora: Annotated[
        list[str] | None,
        typer.Option(
            "--lora",
            metavar="NAME=PATH",
            help="A PEFT LoRA adapter directory, named (repeat for several); a line's 'lora' field (or an "
            "OpenAI body's 'model') naming it runs with it. Lines with different adapters share batches.",
            show_default=False,
            rich_help_panel=LORA,
        ),
    ] = None,
    max_loras: Annotated[
        int | None,
        typer.Option(
            "--max-loras",
            help="Most adapters in one step (their deltas held at once): lines of other adapters wait, "
            "and adapters are swapped in and out. Default: the number of --lora.",
            show_default=False,
            rich_help_panel=LORA,
        ),
    ] = None,
    max_cpu_loras: Annotated[
        int | None,
        typer.Option(
            "--max-cpu-loras",
            help="Most adapters kept in memory (at least --max-loras); the others are read again when "
            "their lines run. Default: the number of --lora.",
            show_default=False,
            rich_help_panel=LORA,
        ),
    ] = None,
    max_lora_rank: Annotated[
        int,
        typer.Option("--max-lora-rank", help="Highest adapter rank accepted.", rich_help_panel=LORA),
    ] = _default(EngineConfig, "max_lora_rank"),
    chat_template: Annotated[
        Path | None,
        typer.Option(
            "--chat-template",
            help="A Jinja chat template file for chat lines, instead of the tokenizer's.",
            show_default=False,
            metavar="FILE",
            rich_help_panel=SAMPLING,
        ),
    ] = None,
    output: Annotated[
        str | None,
        typer.Option(
            "--output",
            "-o",
            metavar="FILE",
            help="Output JSONL. Default: next to the input (prompts.jsonl -> prompts.out.jsonl); '-' for stdout.",
            show_default=False,
            rich_help_panel=OUTPUT,
        ),
    ] = None,
    max_logprobs: Annotated[
        int,
        typer.Option(
            "--max-logprobs",
            help="Most logprobs a line may ask per token (logprobs, an OpenAI chat body's top_logprobs, "
            "prompt_logprobs); a line above it fails with its error. -1: no limit.",
            rich_help_panel=OUTPUT,
        ),
    ] = _default(EngineConfig, "max_logprobs"),
    report: Annotated[
        bool | None,
        typer.Option(
            "--report/--no-report",
            help="Print the memory-usage report at the end. Default: on, unless --quiet.",
            show_default=False,
            rich_help_panel=OUTPUT,
        ),
    ] = None,
    report_json: Annotated[
        Path | None,
        typer.Option(
            "--report-json",
            metavar="FILE",
            help="Also write the report's figures as JSON to FILE.",
            show_default=False,
            rich_help_panel=OUTPUT,
        ),
    ] = None,
    trace: Annotated[
        Path | None,
        typer.Option(
            "--trace",
            metavar="FILE",
            help="Record every step's pool and block tables to FILE (small runs; view with `pagedinfer blocks FILE`).",
            show_default=False,
            rich_help_panel=OUTPUT,
        ),
    ] = None,
    resume: Annotated[
        bool,
        typer.Option(
            "--resume",
            help="Skip lines whose id is already in the output file (in any order), drop unreadable "
            "lines from it, and append the rest. Refused when the input changed or an option that "
            "changes outputs (model, seed, sampling, dtype...) differs from the output's.",
            rich_help_panel=OUTPUT,
        ),
    ] = False,
    strict: Annotated[
        bool,
        typer.Option(
            "--strict",
            help="Stop with the list of bad lines instead of running the good ones (exit 1).",
            rich_help_panel=OUTPUT,
        ),
    ] = False,
    quiet: Annotated[
        bool,
        typer.Option(
            "--quiet", "-q", help="No progress bar or report; only the final summary.", rich_help_panel=OUTPUT
        ),
    ] = False,
    progress: Annotated[
        ProgressMode,
        typer.Option(
            "--progress",
            help="auto: a live bar on a terminal, else a progress record on stderr every --progress-interval "
            "(none with --quiet); bar, log or none.",
            rich_help_panel=OUTPUT,
        ),
    ] = ProgressMode.auto,
    progress_interval: Annotated[
        float,
        typer.Option(
            "--progress-interval",
            metavar="SECONDS",
            help="Seconds between two progress records of the log.",
            rich_help_panel=OUTPUT,
        ),
    ] = PROGRESS_INTERVAL_S,
    data_parallel: Annotated[
        int,
        typer.Option(
            "--data-parallel",
            help="Run N engine replicas as Ray actors (one GPU each, or the CPUs split evenly); same output.",
            show_default=False,
            rich_help_panel=SCALE,
        ),
    ] = 0,
    ray_address: Annotated[
        str | None,
        typer.Option(
            "--ray-address",
            metavar="ADDR",
            help="Join this Ray cluster (host:port, or 'auto') instead of starting a local Ray for the run.",
            show_default=False,
            rich_help_panel=SCALE,
        ),
    ] = None,
) -> None:
    """Generate for every line of PROMPTS.jsonl; write one output line per input line, in input order.

    Each line is written the moment it finishes (the file is put in input order at the end); bad
    lines get an error record naming the line and the reason, and the other lines still run.
    The output is locked for the run. Exit code: 0 all lines succeeded, 1 some failed, 2 unusable
    invocation, 74 the output could not be written, 130/143/129 stopped by SIGINT/SIGTERM/SIGHUP
    (SIGTERM and SIGHUP act like Ctrl-C). See docs/cli.md.
    """
    try:
        from pagedinfer.cli.run import RunOptions, execute
    except KeyboardInterrupt:
        _interrupted_at_start()

    if not progress_interval > 0:
        _usage_error(f"--progress-interval takes a number of seconds > 0, not {progress_interval}")
    if data_parallel < 0:
        _usage_error(f"--data-parallel takes a number of replicas (1 or more), not {data_parallel}")
    if ray_address is not None and not data_parallel:
        _usage_error("--ray-address needs --data-parallel N")
    kv_cache_memory = _renamed(ctx, "kv_cache_memory", kv_memory, "--kv-memory")
    max_num_batched_tokens = _renamed(
        ctx, "max_num_batched_tokens", max_batched_tokens, "--max-batched-tokens"
    )
    if gpu_memory_utilization is not None and device == Device.cpu:
        _usage_error(
            "--gpu-memory-utilization sizes the KV pool on CUDA only; on the CPU use --kv-cache-memory "
            "or --num-blocks"
        )
    if threads is not None and threads < 1:
        _usage_error(f"--threads takes a number of threads (1 or more), not {threads}")
    if threads is not None and data_parallel:
        _usage_error(
            "--threads sets this process's threads; --data-parallel splits the CPUs among its replicas"
        )
    if model is not None and not data_parallel:  # a hub id without a network: said now, not in 50 s
        from pagedinfer.model.hub import HubUnavailable, local_only

        try:
            local_only(model)
        except HubUnavailable as e:
            _usage_error(str(e))
    adapters, lora_engine = _lora_options(lora or [], max_loras, max_cpu_loras, max_lora_rank)
    template = None
    if chat_template is not None:
        from pagedinfer.chat_template import ChatTemplateError, read_chat_template

        try:
            template = read_chat_template(chat_template)
        except ChatTemplateError as e:
            _usage_error(str(e))
    opts = RunOptions(
        prompts=prompts,
        output=output,
        model=model,
        sampling={
            "n": n,
            **({} if max_tokens is None else {"max_tokens": max_tokens}),
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "min_p": min_p,
            "stop": list(stop or []),
            "beam_width": beam_width,
        },
        seed=seed,
        engine={
            "block_size": block_size,
            "num_blocks": num_blocks,
            "kv_cache_memory": kv_cache_memory,
            "gpu_memory_utilization": gpu_memory_utilization,
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens,
            "max_model_len": max_model_len,
            "enable_prefix_caching": prefix_caching,
            "schedule_policy": schedule_policy.value,
            "device": device.value,
            "enforce_eager": enforce_eager,
            "dtype": dtype.value,
            "quantization": None if quantization is None else quantization.value,
            "kv_cache_dtype": kv_cache_dtype.value,
            "model_impl": model_impl.value,
            "chat_template": template,
            "max_line_tokens": max_line_tokens,
            "line_timeout": line_timeout,
            **lora_engine,
            "max_logprobs": max_logprobs,
        },
        loras=adapters,
        chat_template=chat_template,
        report=report,
        report_json=report_json,
        trace=trace,
        resume=resume,
        strict=strict,
        quiet=quiet,
        progress=progress.value,
        progress_interval=progress_interval,
        data_parallel=data_parallel,
        ray_address=ray_address,
    )
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    out = Console(file=sys.stdout, highlight=False, soft_wrap=True)
    err = Console(file=sys.stderr, highlight=False, soft_wrap=True)
    raise typer.Exit(execute(opts, out, err))


@app.command(cls=HelpCommand)
def blocks(
    trace_file: Annotated[
        Path | None,
        typer.Argument(
            help="A trace recorded with `pagedinfer run --trace FILE`. Default: run the built-in example.",
            show_default=False,
        ),
    ] = None,
    block_size: Annotated[int, typer.Option("--block-size", help="Built-in example: tokens per block.")] = 4,
    prompt_tokens: Annotated[
        int, typer.Option("--prompt-tokens", help="Built-in example: prompt length in tokens.")
    ] = 6,
    n: Annotated[int, typer.Option("-n", help="Built-in example: completions of the prompt.")] = 2,
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", help="Built-in example: tokens per completion.")
    ] = 5,
    num_blocks: Annotated[
        int, typer.Option("--num-blocks", help="Built-in example: blocks in the pool.")
    ] = 8,
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            metavar="MODEL",
            help="Built-in example: run on this model (default: a tiny random Llama built in a temp dir, offline).",
            show_default=False,
        ),
    ] = None,
    max_steps: Annotated[
        int | None, typer.Option("--max-steps", help="Draw at most this many steps.", show_default=False)
    ] = None,
) -> None:
    """Draw the KV pool and the block tables, step by step.

    Shows the physical blocks P0..Pn with their reference counts and filled slots, each sequence's
    block table (L0 -> Pk), and every prefill, fork, copy-on-write and block returning to the pool.
    Without a trace file it runs a tiny offline example: a 6-token prompt, 2 completions, block size 4.
    """
    from pagedinfer.cli import blocks_view

    console = Console(highlight=False, soft_wrap=True)
    err = Console(file=sys.stderr, highlight=False, soft_wrap=True)
    if trace_file is not None:
        try:
            doc = blocks_view.load_trace(trace_file)
        except blocks_view.TraceError as e:
            _usage_error(str(e), err)
        title = f"trace {trace_file}"
    else:
        from transformers.utils import logging as hf_logging

        from pagedinfer.model.loader import ModelLoadError

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        try:
            doc = blocks_view.builtin_trace(model, block_size, prompt_tokens, n, max_tokens, num_blocks)
        except (ModelLoadError, ValueError) as e:
            _usage_error(str(e).splitlines()[0], err)
        title = (
            f"built-in example: one {prompt_tokens}-token prompt, n={n} completions of {max_tokens} tokens, "
            f"block size {block_size}, {num_blocks} blocks"
        )
    say(console, f"[bold]{escape(title)}[/]")
    blocks_view.render(doc, console, max_steps)


@app.command(cls=HelpCommand)
def bench(
    workloads: Annotated[
        str | None,
        typer.Option(
            "--workloads",
            "-w",
            metavar="LIST",
            help="Comma list: W0 overhead-bound, W1 parallel sampling, W2 mixed lengths, W3 shared prefix, "
            "W4 beam search, W5 Llama-3.2-1B shape (bfloat16 and float32); with --device cuda G1 "
            "Llama-3.2-1B shape, G2 Llama-3.1-8B shape. Default: W0,W1,W2 (cuda: G1,G2).",
            show_default=False,
        ),
    ] = None,
    device: Annotated[
        Device,
        typer.Option(
            "--device",
            help="cpu (the W workloads) or cuda (the G workloads: every system on the GPU, random weights "
            "drawn there, GPU peaks measured, each system's GPU time profiled).",
        ),
    ] = Device.cpu,
    systems: Annotated[
        str | None,
        typer.Option(
            "--systems",
            metavar="LIST",
            help="Comma list of pagedinfer, pagedinfer_no_prefix_cache, hf_generate, hf_generate_batch "
            "(default: every system each workload names).",
            show_default=False,
        ),
    ] = None,
    dtype: Annotated[
        str | None,
        typer.Option(
            "--dtype",
            metavar="LIST",
            help="Comma list of float32, bfloat16, float16: run each workload in each, every system in "
            "that dtype (default: float32; W5 bfloat16,float32).",
            show_default=False,
        ),
    ] = None,
    quick: Annotated[bool, typer.Option("--quick", help="Scaled-down workloads: a smoke test.")] = False,
    prompts: Annotated[
        int | None,
        typer.Option("--prompts", help="Keep only each workload's first N prompts.", show_default=False),
    ] = None,
    max_prompt_len: Annotated[
        int | None,
        typer.Option(
            "--max-prompt-len",
            help="Cut each prompt (W3: the shared prefix and each question) to its first N tokens.",
            show_default=False,
        ),
    ] = None,
    max_tokens: Annotated[
        int | None,
        typer.Option("--max-tokens", help="Cap every prompt's new tokens at N.", show_default=False),
    ] = None,
    hf_prompts: Annotated[
        int | None,
        typer.Option(
            "--hf-prompts",
            help="The transformers systems run only the first N prompts (slow on a GPU); their tok/s is "
            "over those (the table says so).",
            show_default=False,
        ),
    ] = None,
    threads: Annotated[
        int | None,
        typer.Option(
            "--threads", help="Torch threads in every process (default: all cores).", show_default=False
        ),
    ] = None,
    block_size: Annotated[int, typer.Option("--block-size", help="KV block size (both paged systems).")] = 16,
    num_blocks: Annotated[
        int | None,
        typer.Option(
            "--num-blocks",
            help="KV pool blocks for both paged systems (default: every completion at full length without "
            "sharing, so neither preempts).",
            show_default=False,
        ),
    ] = None,
    max_num_batched_tokens: Annotated[
        int, typer.Option("--max-num-batched-tokens", help="Token budget per step (both paged systems).")
    ] = 2048,
    max_num_seqs: Annotated[int, typer.Option("--max-num-seqs", help="Sequences per step.")] = 256,
    hf_batch_size: Annotated[
        int | None,
        typer.Option("--hf-batch-size", help="Prompts per hf_generate batch (override).", show_default=False),
    ] = None,
    hf_cb_max_requests: Annotated[
        int | None,
        typer.Option(
            "--hf-cb-max-requests",
            help="max_requests_per_batch of hf_generate_batch (default: --max-num-seqs).",
            show_default=False,
        ),
    ] = None,
    repeats: Annotated[
        int, typer.Option("--repeats", help="Timed runs per system, taking turns; the fastest is kept.")
    ] = 1,
    gemm_size: Annotated[
        int, typer.Option("--gemm-size", help="Square matmul size of the GEMM rates.")
    ] = 2048,
    model_cache: Annotated[
        Path | None,
        typer.Option(
            "--model-cache",
            metavar="DIR",
            help="Save the random models here once and reuse them.",
            show_default=False,
        ),
    ] = None,
    in_process: Annotated[
        bool, typer.Option("--in-process", help="Run the systems in this process (profilers; RSS is shared).")
    ] = False,
    json_file: Annotated[
        Path | None,
        typer.Option(
            "--json", metavar="FILE", help="Also write the results as JSON to FILE.", show_default=False
        ),
    ] = None,
) -> None:
    """Throughput: pagedinfer vs transformers generate and generate_batch, same prompts and model.

    Prints one table per workload and dtype (method: docs/bench.md).
    """
    import os

    from pagedinfer.bench.runner import BenchOptions, run_bench
    from pagedinfer.bench.workloads import Shrink

    def names(text: str | None) -> tuple[str, ...] | None:
        return None if text is None else tuple(x.strip() for x in text.split(",") if x.strip())

    if device == Device.auto:
        _usage_error("--device: choose cpu or cuda")
    default = "G1,G2" if device == Device.cuda else "W0,W1,W2"
    opts = BenchOptions(
        workloads=names(workloads or default) or (),
        systems=names(systems),
        dtypes=names(dtype),
        quick=quick,
        shrink=Shrink(prompts, max_prompt_len, max_tokens, hf_prompts),
        threads=threads or os.cpu_count() or 1,
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        hf_batch_size=hf_batch_size,
        hf_cb_max_requests=hf_cb_max_requests,
        repeats=repeats,
        gemm_size=gemm_size,
        model_cache=model_cache,
        in_process=in_process,
        json=json_file,
        device=device.value,
    )
    try:
        opts.check()
    except ValueError as e:
        _usage_error(str(e))
    result = run_bench(opts)
    failed = [
        f"{name} {dtype}: {', '.join(res['errors'])}"
        for name, per in result["workloads"].items()
        for dtype, res in per.items()
        if res.get("errors")
    ]
    if failed:  # a GPU workload's system failed (its row says why); the others' tables are printed
        say(Console(file=sys.stderr), f"[bold red]error:[/] systems failed: {escape('; '.join(failed))}")
        raise typer.Exit(1)


def _renamed(ctx: typer.Context, name: str, old_value, old: str):
    """The value of option ``name``, or of ``old``, its former name (hidden, kept so that scripts still run)."""
    if old_value is None:
        return ctx.params[name]
    if ctx.get_parameter_source(name).name == "COMMANDLINE":
        _usage_error(f"{old} is the old name of --{name.replace('_', '-')}: give one of them")
    return old_value


def _lora_options(
    given: list[str], max_loras: int | None, max_cpu_loras: int | None, max_lora_rank: int
) -> tuple[list[tuple[str, str]], dict]:
    """``--lora NAME=PATH`` pairs, checked as far as they can be without the model (the adapters
    themselves are checked against it when it loads), and the engine's LoRA settings. By default
    every adapter has a slot and stays in memory (each is read at startup anyway)."""
    for option, value in (("--max-loras", max_loras), ("--max-cpu-loras", max_cpu_loras)):
        if value is not None and not given:
            _usage_error(f"{option} needs --lora NAME=PATH")
        if value is not None and value < 1:
            _usage_error(f"{option} takes a number of adapters (1 or more), not {value}")
    slots = max_loras or len(given)
    if max_cpu_loras is not None and max_cpu_loras < slots:
        _usage_error(f"--max-cpu-loras {max_cpu_loras} is below --max-loras {slots}")
    if max_lora_rank < 1:
        _usage_error(f"--max-lora-rank takes a rank (1 or more), not {max_lora_rank}")
    pairs: list[tuple[str, str]] = []
    for text in given:
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            _usage_error(f"--lora takes NAME=PATH (an adapter's name and its directory), not {text!r}")
        if name in dict(pairs):
            _usage_error(f"--lora {name} is given twice")
        if not (Path(path).expanduser() / "adapter_config.json").is_file():
            _usage_error(
                f"--lora {name}={path}: no adapter_config.json there (a PEFT LoRA adapter directory)"
            )
        pairs.append((name, path))
    if not pairs:
        return pairs, {}
    in_memory = max(slots, len(pairs)) if max_cpu_loras is None else max_cpu_loras
    engine = {"max_loras": slots, "max_cpu_loras": in_memory, "max_lora_rank": max_lora_rank}
    return pairs, {"enable_lora": True, **engine}


def _interrupted_at_start() -> None:
    note("pagedinfer: interrupted while starting; nothing was run or written")
    raise typer.Exit(130)


def _usage_error(message: str, err: Console | None = None) -> None:
    say(err or Console(file=sys.stderr), f"[bold red]error:[/] {escape(message)}")
    raise typer.Exit(2)


if __name__ == "__main__":  # pragma: no cover
    app()
