"""``--resume``: the options a record depends on, kept beside the output (`run_options`), and the
checks a resumed run makes before appending (`resume`).

A resumed run appends to the records an earlier run wrote. Had it another model, seed, sampling
default or an engine setting that changes outputs, one file would hold records made two ways with
nothing in them to tell which. So the run keeps these options (the settings declared with
``resume``, `config.option`) in the output's resume file when it starts writing
(`OutputFile.start`), and ``--resume`` compares them with its own (`differing`). Settings that
change only speed or memory (the pool, batching, prefix caching, scheduling, CUDA graphs, threads,
replicas) are not kept: a resumed run may change them; nor is the device (another CPU, or a GPU,
rounds differently too, and no run can check that). Values are kept as given (a model's name or
path, not its files; a chat template's path and its text's SHA-256), each under the option that
sets it, so that the refusal can name it.
"""

from __future__ import annotations

import hashlib
import json
import shlex

from rich.console import Console
from rich.markup import escape

from pagedinfer.cli.jsonl_output import Done, OutputFile, Paths
from pagedinfer.cli.run_options import RunOptions, UsageError
from pagedinfer.config import LINE_DEFAULTS, EngineConfig, ModelConfig, settings
from pagedinfer.lines.source import InputLines
from pagedinfer.terminal import say


def resume(output: OutputFile, source: InputLines, opts: RunOptions, paths: Paths, err: Console) -> Done:
    """What the output already answers; a `UsageError` when the input changed since it was written,
    or the options differ from those its records were made with."""
    found = output.load_done()
    if found.fingerprint is not None and (why := source.check_fingerprint(found.fingerprint)):
        raise UsageError(
            f"--resume: input file {opts.prompts} changed since {paths.output} was written ({why}); "
            "restore it, or run without --resume to start over"
        )
    if found.keys and found.options is not None:
        _refuse_other_options(found.options, opts, paths)
    unchecked = _unchecked_words(found, paths)
    if not opts.quiet or found.dropped or unchecked:
        words = [f"resume: {len(found.keys)} records already in {escape(str(paths.output))}"]
        if found.dropped:
            s = "s" if found.dropped != 1 else ""
            words.append(f"dropped {found.dropped} unreadable line{s} (their input lines run again)")
        if unchecked:
            words.append(unchecked)
        say(err, "; ".join(words))
    return found


def keep_system_fingerprint(output, value: str, kept: str | None, paths: Paths, err: Console) -> None:
    """The run's system_fingerprint ``value`` beside the output (docs/reproducibility.md); --resume
    says when the records ``kept`` were made under another one (their bytes need not match this run's)."""
    if isinstance(output, OutputFile):
        output.keep_system_fingerprint(value)
    if kept is not None and kept != value:
        err.print(
            f"note: --resume: the records kept in {escape(str(paths.output))} were made under "
            f"system_fingerprint {kept}, this run's is {value} (other model files, dtype, "
            "kernels or numerics): the two parts of the output need not match one run's",
            highlight=False,
            soft_wrap=True,
        )


def _refuse_other_options(kept: dict, opts: RunOptions, paths: Paths) -> None:
    """The records on disk were made with ``kept``; appending records made with other options would
    leave one file mixing both, with nothing in it to tell which is which."""
    current = run_options(opts)
    names = differing(kept, current)
    if names:
        raise UsageError(
            f"--resume: {paths.output} was written with {describe(kept, names)}; "
            f"this run has {describe(current, names)}: give the same options, "
            "or run without --resume to start over"
        )


def _unchecked_words(found: Done, paths: Paths) -> str | None:
    """What --resume could not check for want of a resume file, or of its options (an older
    version kept the fingerprint alone); None when all was checked, or no record is kept."""
    name = escape(paths.resume.name)
    if not found.keys:
        return None
    if found.fingerprint is None and found.options is None:
        return f"no {name} beside it, so neither the input nor the options can be checked"
    if found.fingerprint is None:
        return f"{name} keeps no fingerprint, so the input cannot be checked unchanged"
    if found.options is None:
        return f"{name} keeps no options (an older version wrote it), so they cannot be checked"
    return None


def run_options(opts: RunOptions) -> dict[str, object]:
    """The options of ``opts`` that decide what a record holds (the settings declared with ``resume``),
    under the option that sets each, as they read back from JSON."""
    values = {**opts.engine, "model": opts.model, "seed": opts.seed, "chat_template": _chat_template(opts)}
    options = {
        s.flag: values.get(s.name)
        for s in (*settings(ModelConfig), *settings(EngineConfig))
        if s.option.resume
    }
    sampling = dict(opts.sampling)
    sampling.setdefault("max_tokens", None)  # not given is kept too: giving it later differs
    flags = {s.name: s.flag for s in LINE_DEFAULTS}
    options |= {flags.get(name, "--" + name.replace("_", "-")): value for name, value in sampling.items()}
    options["--lora"] = sorted(f"{name}={path}" for name, path in opts.loras)  # order changes nothing
    return json.loads(json.dumps(options))


def differing(kept: dict, current: dict[str, object]) -> list[str]:
    """The options whose values differ. One the earlier run did not keep (a newer option) is not
    compared: its records cannot say what it was."""
    return [option for option, value in current.items() if option in kept and kept[option] != value]


def describe(options: dict, names: list[str]) -> str:
    """``names`` with their values in ``options``, as on a command line: ``--seed 0 --stop a --stop b``."""
    return " ".join(_words(name, options[name]) for name in names)


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
