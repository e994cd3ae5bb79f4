"""The options a record depends on, kept beside the output so that ``--resume`` can refuse others.

A resumed run appends to the records an earlier run wrote. Had it another model, seed, sampling
default or an engine setting that changes outputs, one file would hold records made two ways with
nothing in them to tell which. So the run keeps these options in the output's resume file when it
starts writing (`OutputFile.start`), and ``--resume`` compares them with its own (`differing`).
Settings that change only speed or memory (the pool, batching, prefix caching, scheduling, CUDA
graphs, threads, replicas) are not kept: a resumed run may change them; nor is the device (another
CPU, or a GPU, rounds differently too, and no run can check that). Values are kept as given
(a model's name or path, not its files; a chat template's path and its text's SHA-256), each under
the option that sets it, so that the refusal can name it.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedinfer.cli.run import RunOptions

# the engine settings that change what a record holds -> the option that sets each
ENGINE_OPTIONS = {
    "dtype": "--dtype",
    "quantization": "--quantization",
    "kv_cache_dtype": "--kv-cache-dtype",
    "max_model_len": "--max-model-len",
    "model_impl": "--model-impl",
    "max_line_tokens": "--max-line-tokens",
    "line_timeout": "--line-timeout",
    "max_logprobs": "--max-logprobs",  # a line above it is an error record, below it a success
}
SAMPLING_OPTIONS = {"n": "-n", "max_tokens": "--max-tokens", "top_p": "--top-p", "top_k": "--top-k"}


def run_options(opts: RunOptions) -> dict[str, object]:
    """The options of ``opts`` that decide what a record holds, as they read back from JSON."""
    options: dict[str, object] = {"--model": opts.model, "--seed": opts.seed}
    sampling = dict(opts.sampling)
    sampling.setdefault("max_tokens", None)  # not given is kept too: giving it later differs
    options |= {_sampling_option(name): value for name, value in sampling.items()}
    options |= {option: opts.engine.get(name) for name, option in ENGINE_OPTIONS.items()}
    options["--chat-template"] = _chat_template(opts)
    options["--lora"] = sorted(f"{name}={path}" for name, path in opts.loras)  # order changes nothing
    return json.loads(json.dumps(options))


def differing(kept: dict, current: dict[str, object]) -> list[str]:
    """The options whose values differ. One the earlier run did not keep (a newer option) is not
    compared: its records cannot say what it was."""
    return [option for option, value in current.items() if option in kept and kept[option] != value]


def describe(options: dict, names: list[str]) -> str:
    """``names`` with their values in ``options``, as on a command line: ``--seed 0 --stop a --stop b``."""
    return " ".join(_words(name, options[name]) for name in names)


def _sampling_option(name: str) -> str:
    return SAMPLING_OPTIONS.get(name, "--" + name.replace("_", "-"))


def _chat_template(opts: RunOptions) -> dict | None:
    """--chat-template: its path as given and its text's digest (an edited file differs)."""
    text = opts.engine.get("chat_template")
    if text is None:
        return None
    path = None if opts.chat_template is None else str(opts.chat_template)
    return {"file": path, "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest()}


def _words(option: str, value: object) -> str:
    if isinstance(value, list):
        return " ".join(f"{option} {_value(v)}" for v in value) if value else f"{option} (none)"
    return f"{option} {_value(value)}"


def _value(value: object) -> str:
    if value is None:
        return "(default)"
    if isinstance(value, dict):  # a chat template
        digest = f"sha256 {str(value.get('sha256'))[:12]}"
        return f"{_value(value['file'])} ({digest})" if value.get("file") else f"({digest})"
    if isinstance(value, str):
        return value if value and shlex.quote(value) == value else json.dumps(value, ensure_ascii=False)
    return json.dumps(value)
