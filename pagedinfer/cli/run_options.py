"""What one ``pagedinfer run`` does (`RunOptions`), read from its command line (`from_command_line`).

The run's own options are declared here, on `RunOptions`' fields; the model's and the engine's
(`config.ModelConfig`, `config.EngineConfig`) and the lines' sampling defaults (`config.LINE_DEFAULTS`)
where they are used. The command line is made of all of them (`cli.options`); what ``--resume``
keeps of them, in `cli.resume`.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedinfer.cli.progress import PROGRESS_INTERVAL_S
from pagedinfer.config import LINE_DEFAULTS, EngineConfig, ModelConfig, option, settings

RESUME_EVERY_TOKENS = 256  # the defaults of --resume-every-tokens and --resume-every-seconds
RESUME_EVERY_SECONDS = 30.0


class UsageError(Exception):
    """The invocation cannot run; the message is one line (exit code 2)."""


@dataclass
class RunOptions:
    """One run: its input and output, the model (``model``, ``engine``: `LLM`'s arguments besides
    the seed), the lines' defaults (``sampling``, ``seed``), and the run's own options, declared here."""

    prompts: Path
    output: str | None = option(  # None: next to the input; "-": stdout
        None,
        "Output JSONL. Default: next to the input (prompts.jsonl -> prompts.out.jsonl); '-' for stdout.",
        flags=("--output", "-o"),
        panel="output",
        metavar="FILE",
        show_default=False,
    )
    model: str | None = None
    sampling: dict = field(default_factory=dict)  # SamplingParams defaults (lines override)
    seed: int = 0
    engine: dict = field(default_factory=dict)  # LLM keyword arguments
    report: bool | None = option(  # None: unless --quiet
        None,
        "Print the memory-usage report at the end. Default: on, unless --quiet.",
        flags=("--report/--no-report",),
        panel="output",
        show_default=False,
    )
    report_json: Path | None = option(
        None, "Also write the report's figures as JSON to FILE.", panel="output", metavar="FILE"
    )
    trace: Path | None = option(
        None,
        "Record every step's pool and block tables to FILE (small runs; view with `pagedinfer blocks FILE`).",
        panel="output",
        metavar="FILE",
    )
    resume: bool = option(
        False,
        "Skip lines whose id is already in the output file (in any order), drop unreadable lines from it, "
        "and append the rest. Refused when the input changed or an option that changes outputs (model, "
        "seed, sampling, dtype...) differs from the output's.",
        panel="output",
    )
    resume_every_tokens: int = option(
        RESUME_EVERY_TOKENS,
        "Keep the tokens of lines still generating beside the output at least every N tokens of any "
        "completion, so --resume continues them there (a kill costs at most N tokens of each); 0: "
        "keep finished lines only.",
        panel="output",
        metavar="N",
    )
    resume_every_seconds: float = option(
        RESUME_EVERY_SECONDS,
        "Keep the tokens of lines still generating at least every this many seconds too (whichever of "
        "this and --resume-every-tokens comes first).",
        panel="output",
        metavar="SECONDS",
    )
    strict: bool = option(
        False, "Stop with the list of bad lines instead of running the good ones (exit 1).", panel="output"
    )
    quiet: bool = option(
        False,
        "No progress bar or report; only the final summary.",
        flags=("--quiet", "-q"),
        panel="output",
    )
    # auto: a bar on a terminal, a log elsewhere, none with --quiet
    progress: str = option(
        "auto",
        "auto: a live bar on a terminal, else a progress record on stderr every --progress-interval (none "
        "with --quiet); bar, log or none.",
        panel="output",
        choices=("auto", "bar", "log", "none"),
    )
    progress_interval: float = option(
        PROGRESS_INTERVAL_S,
        "Seconds between two progress records of the log.",
        panel="output",
        metavar="SECONDS",
    )
    data_parallel: int = option(  # N > 0: N engine replicas on Ray (pagedinfer/ray)
        0,
        "Run N engine replicas as Ray actors (one GPU each, or the CPUs split evenly); same output.",
        panel="scale",
        show_default=False,
    )
    ray_address: str | None = option(  # join this Ray cluster (default: a local Ray for the run)
        None,
        "Join this Ray cluster (host:port, or 'auto') instead of starting a local Ray for the run.",
        panel="scale",
        metavar="ADDR",
    )
    loras: tuple[tuple[str, str], ...] = option(  # (name, directory), loaded with the model
        (),
        "A PEFT LoRA adapter directory, named (repeat for several); a line's 'lora' field (or an OpenAI "
        "body's 'model') naming it runs with it. Lines with different adapters share batches.",
        flags=("--lora",),
        panel="lora",
        metavar="NAME=PATH",
        cli_type=list[str],
        cli_default=None,
        show_default=False,
        resume=True,
    )
    chat_template: Path | None = None  # --chat-template FILE as given (engine["chat_template"]: its text)
    threads: int | None = option(  # None: torch's
        None,
        "Torch threads (and the C kernels' OpenMP threads). Default: torch's, one per core.",
        panel="pool",
    )


def from_command_line(prompts: Path, values: dict[str, Any]) -> RunOptions:
    """The run the command line's ``values`` (`cli.options.given`) ask for, after the checks that need
    neither the input nor the model: a `UsageError` names the option at fault."""
    if not values["progress_interval"] > 0:
        raise UsageError(
            f"--progress-interval takes a number of seconds > 0, not {values['progress_interval']}"
        )
    if values["resume_every_tokens"] < 0:
        raise UsageError(
            f"--resume-every-tokens takes a number of tokens (0: off), not {values['resume_every_tokens']}"
        )
    if not values["resume_every_seconds"] > 0:
        raise UsageError(
            f"--resume-every-seconds takes a number of seconds > 0, not {values['resume_every_seconds']}"
        )
    if values["data_parallel"] < 0:
        raise UsageError(
            f"--data-parallel takes a number of replicas (1 or more), not {values['data_parallel']}"
        )
    if values["ray_address"] is not None and not values["data_parallel"]:
        raise UsageError("--ray-address needs --data-parallel N")
    if values["gpu_memory_utilization"] is not None and values["device"] == "cpu":
        raise UsageError(
            "--gpu-memory-utilization sizes the KV pool on CUDA only; on the CPU use --kv-cache-memory "
            "or --num-blocks"
        )
    threads = values["threads"]
    if threads is not None and threads < 1:
        raise UsageError(f"--threads takes a number of threads (1 or more), not {threads}")
    if threads is not None and values["data_parallel"]:
        raise UsageError(
            "--threads sets this process's threads; --data-parallel splits the CPUs among its replicas"
        )
    model = values["model"]
    if model is not None and not values["data_parallel"]:  # a hub id without a network: said now, not in 50 s
        from pagedinfer.model.hub import HubUnavailable, local_only

        try:
            local_only(model)
        except HubUnavailable as e:
            raise UsageError(str(e)) from None
    adapters, lora_engine = _lora_options(values)
    template = None
    if values["chat_template"] is not None:
        from pagedinfer.chat_template import ChatTemplateError, read_chat_template

        try:
            template = read_chat_template(values["chat_template"])
        except ChatTemplateError as e:
            raise UsageError(str(e)) from None
    sampling = {}
    for s in LINE_DEFAULTS:
        value = list(values[s.name] or []) if typing.get_origin(s.option.cli_type) is list else values[s.name]
        if value is not None or s.cli_default is not None:  # not given: each line's kind decides
            sampling[s.name] = value
    own = {"model", "seed", "chat_template"} | {
        s.name for s in settings(EngineConfig) if s.option.panel == "lora"
    }
    engine = {
        s.name: values[s.name]
        for s in (*settings(ModelConfig), *settings(EngineConfig))
        if s.flags and s.name not in own
    }
    return RunOptions(
        prompts=prompts,
        model=model,
        sampling=sampling,
        seed=values["seed"],
        engine={**engine, "chat_template": template, **lora_engine},
        loras=adapters,
        chat_template=values["chat_template"],
        **{s.name: values[s.name] for s in settings(RunOptions) if s.name != "loras"},
    )


def _lora_options(values: dict[str, Any]) -> tuple[tuple[tuple[str, str], ...], dict]:
    """``--lora NAME=PATH`` pairs, checked as far as they can be without the model (the adapters
    themselves are checked against it when it loads), and the engine's LoRA settings. By default
    every adapter has a slot and stays in memory (each is read at startup anyway)."""
    given, max_loras, max_cpu_loras = values["loras"] or [], values["max_loras"], values["max_cpu_loras"]
    for flag, value in (("--max-loras", max_loras), ("--max-cpu-loras", max_cpu_loras)):
        if value is not None and not given:
            raise UsageError(f"{flag} needs --lora NAME=PATH")
        if value is not None and value < 1:
            raise UsageError(f"{flag} takes a number of adapters (1 or more), not {value}")
    slots = max_loras or len(given)
    if max_cpu_loras is not None and max_cpu_loras < slots:
        raise UsageError(f"--max-cpu-loras {max_cpu_loras} is below --max-loras {slots}")
    if values["max_lora_rank"] < 1:
        raise UsageError(f"--max-lora-rank takes a rank (1 or more), not {values['max_lora_rank']}")
    pairs: list[tuple[str, str]] = []
    for text in given:
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise UsageError(f"--lora takes NAME=PATH (an adapter's name and its directory), not {text!r}")
        if name in dict(pairs):
            raise UsageError(f"--lora {name} is given twice")
        if not (Path(path).expanduser() / "adapter_config.json").is_file():
            raise UsageError(
                f"--lora {name}={path}: no adapter_config.json there (a PEFT LoRA adapter directory)"
            )
        pairs.append((name, path))
    if not pairs:
        return (), {}
    in_memory = max(slots, len(pairs)) if max_cpu_loras is None else max_cpu_loras
    engine = {"max_loras": slots, "max_cpu_loras": in_memory, "max_lora_rank": values["max_lora_rank"]}
    return tuple(pairs), {"enable_lora": True, **engine}
