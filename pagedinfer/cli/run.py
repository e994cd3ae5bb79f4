"""One ``pagedinfer run``: validate the input, load the model, generate, write, report; return the exit code.

Exit codes: 0 every line succeeded, 1 some lines failed (or ``--strict`` found bad lines),
2 the invocation is unusable (bad file, output path, option or model), 130 interrupted by Ctrl-C
(everything finished so far is written; ``--resume`` completes the rest).
"""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from pagedinfer.cli.jsonl_input import InputFileError, LineError, LineRequest, parse_lines, read_input
from pagedinfer.cli.jsonl_output import (
    JsonlSink,
    OrderedWriter,
    OutputError,
    default_output_path,
    read_done,
    reorder,
)

EXIT_OK, EXIT_LINES_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
SHOW_REASONS = 10  # failed lines listed in the summary


class UsageError(Exception):
    """The invocation cannot run; the message is one line (exit code 2)."""


class Interrupted(Exception):
    """Ctrl-C, raised between engine steps."""


@dataclass
class RunOptions:
    prompts: Path
    output: str | None = None  # None: next to the input; "-": stdout
    model: str | None = None
    sampling: dict = field(default_factory=dict)  # SamplingParams defaults (lines override)
    seed: int = 0
    engine: dict = field(default_factory=dict)  # LLM keyword arguments
    report: bool | None = None  # None: unless --quiet
    report_json: Path | None = None
    trace: Path | None = None
    resume: bool = False
    strict: bool = False
    quiet: bool = False


@dataclass
class Outcome:
    lines: int = 0
    skipped: int = 0
    ok: int = 0
    failed: list[LineError] = field(default_factory=list)
    interrupted: bool = False
    reordered: bool = False


def execute(opts: RunOptions, out: Console, err: Console) -> int:
    try:
        return _execute(opts, out, err)
    except (UsageError, InputFileError, OutputError) as e:
        err.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        return EXIT_USAGE
    except KeyboardInterrupt:
        err.print(
            "[bold yellow]interrupted[/] before generation started; nothing was written", soft_wrap=True
        )
        return EXIT_INTERRUPTED


def _execute(opts: RunOptions, out: Console, err: Console) -> int:
    from pagedinfer.config import EngineConfig
    from pagedinfer.sampling_params import BeamSearchParams, SamplingParams

    lines = read_input(opts.prompts)
    sampling = {k: v for k, v in opts.sampling.items() if k != "beam_width"}
    try:
        SamplingParams(**sampling)
        if opts.sampling.get("beam_width"):
            BeamSearchParams(opts.sampling["beam_width"], sampling.get("max_tokens", 16))
    except ValueError as e:
        raise UsageError(f"invalid sampling option: {e}") from None
    config_keys = ("block_size", "num_blocks", "kv_cache_memory", "max_num_seqs", "max_num_batched_tokens")
    try:
        EngineConfig(**{k: opts.engine[k] for k in config_keys if k in opts.engine})
    except ValueError as e:
        raise UsageError(_option_words(str(e))) from None
    out_path = _output_path(opts)
    for extra in (opts.report_json, opts.trace):
        if extra is not None:
            _check_can_create(extra, opts.prompts, "file")

    items = parse_lines(lines, opts.sampling, opts.seed)
    order = {item.key: i for i, item in enumerate(items)}
    done: set[str] = set()
    if opts.resume:
        done = set(read_done(out_path))
    todo = [item for item in items if item.key not in done]
    outcome = Outcome(lines=len(items), skipped=len(items) - len(todo))
    if opts.resume and not opts.quiet:
        err.print(
            f"resume: {outcome.skipped} of {len(items)} lines already in {escape(str(out_path))}; "
            f"{len(todo)} to run",
            soft_wrap=True,
        )
    bad = [item for item in todo if isinstance(item, LineError)]
    if opts.strict and bad:
        return _strict_stop(bad, err, before="loading the model")

    llm = None
    resolved: dict[int, object] = {}  # position in todo -> Resolved
    if any(isinstance(item, LineRequest) for item in todo):
        llm = _load(opts, err)
        from pagedinfer.cli.resolve import resolve

        for pos, item in enumerate(todo):
            if isinstance(item, LineRequest):
                res = resolve(item, llm.engine)
                if isinstance(res, LineError):
                    todo[pos] = res
                else:
                    resolved[pos] = res
        bad = [item for item in todo if isinstance(item, LineError)]
        if opts.strict and bad:
            return _strict_stop(bad, err, before="generating")

    sink = JsonlSink(out_path, truncate=not opts.resume)
    try:
        writer = OrderedWriter(sink, len(todo))
        _generate(opts, llm, todo, resolved, writer, outcome, out if opts.output != "-" else err, err)
    finally:
        sink.close()
    if opts.resume and out_path is not None and not outcome.interrupted:
        outcome.reordered = reorder(out_path, order)
    _finish(opts, llm, outcome, out_path, out if opts.output != "-" else err)
    if outcome.interrupted:
        return EXIT_INTERRUPTED
    return EXIT_LINES_FAILED if outcome.failed else EXIT_OK


# -- steps --------------------------------------------------------------------------------------------
def _output_path(opts: RunOptions) -> Path | None:
    if opts.output == "-":
        if opts.resume:
            raise UsageError("--resume needs an output file, not stdout (-o -)")
        return None
    path = Path(opts.output) if opts.output else default_output_path(opts.prompts)
    _check_can_create(path, opts.prompts, "output file")
    return path


def _check_can_create(path: Path, input_path: Path, what: str) -> None:
    """Fail early (before the model loads) on a path that cannot be written; creates nothing."""
    if path.exists() and path.resolve() == input_path.resolve():
        raise OutputError(f"{what} {path} is the input file")
    if path.is_dir():
        raise OutputError(f"{what} {path} is a directory")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise OutputError(f"cannot write {what} {path}: directory {parent} does not exist")
    if path.exists() and not os.access(path, os.W_OK):
        raise OutputError(f"cannot write {what} {path}: permission denied")
    if not path.exists() and not os.access(parent, os.W_OK):
        raise OutputError(f"cannot write {what} {path}: directory {parent} is not writable")


def _strict_stop(bad: list[LineError], err: Console, before: str) -> int:
    err.print(
        f"[bold red]--strict:[/] {len(bad)} bad line{'s' if len(bad) > 1 else ''}; stopping before {before}:",
        soft_wrap=True,
    )
    for item in bad:
        err.print(f"  {escape(item.message)}", highlight=False, soft_wrap=True)
    return EXIT_LINES_FAILED


def _option_words(message: str) -> str:
    """Engine setting names -> the command-line options that set them."""
    for name, option in (
        ("kv_cache_memory", "--kv-memory"),
        ("num_blocks", "--num-blocks"),
        ("block_size", "--block-size"),
        ("max_num_batched_tokens", "--max-batched-tokens"),
        ("max_num_seqs", "--max-num-seqs"),
        ("max_model_len", "--max-model-len"),
    ):
        message = message.replace(name, option)
    return message


def _load(opts: RunOptions, err: Console):
    from transformers.utils import logging as hf_logging

    from pagedinfer.llm import LLM
    from pagedinfer.model.loader import ModelLoadError

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    status = (
        err.status(f"loading {opts.model or 'the demo model'}")
        if err.is_terminal and not opts.quiet
        else None
    )
    with status or contextlib.nullcontext():
        try:
            return LLM(opts.model, seed=opts.seed, **opts.engine)
        except ModelLoadError as e:
            hint = "; pass --model" if opts.model is None else ""
            raise UsageError(f"{e}{hint}") from None
        except ValueError as e:
            raise UsageError(_option_words(str(e).splitlines()[0])) from None


def _generate(
    opts, llm, todo, resolved, writer: OrderedWriter, outcome: Outcome, out: Console, err: Console
) -> None:
    from pagedinfer.cli.progress import RunProgress
    from pagedinfer.cli.records import TokenText, error_record, success_record

    for pos, item in enumerate(todo):
        if isinstance(item, LineError):
            outcome.failed.append(item)
            writer.put(pos, error_record(item))
    if llm is None or not resolved:
        return
    positions = sorted(resolved)
    jobs = [resolved[p] for p in positions]
    token_text = TokenText(llm.tokenizer)
    model_name = opts.model or "pagedinfer-demo"
    if opts.trace is not None:
        llm.engine.enable_trace()
    total = sum(r.item.params.n for r in jobs)
    show = err.is_terminal and not opts.quiet
    stop = _CtrlC()
    with RunProgress(err, total, show) as progress, stop:

        def on_step(engine) -> None:
            progress.on_step(engine)
            if stop.requested:
                raise Interrupted

        stream = llm.generate_iter(
            [r.engine_prompt for r in jobs],
            [r.item.params for r in jobs],
            request_ids=[str(r.item.id) for r in jobs],
            on_step=on_step,
        )
        try:
            for index, result in stream:
                res, pos = jobs[index], positions[index]
                if result.error:
                    failure = LineError(
                        res.item.line,
                        res.item.key,
                        res.item.id,
                        result.error,
                        res.item.openai,
                        res.item.openai is not None,
                    )
                    outcome.failed.append(failure)
                    writer.put(pos, error_record(failure))
                else:
                    outcome.ok += 1
                    writer.put(pos, success_record(res, result, token_text, model_name))
                progress.advance(res.item.params.n)
        except (Interrupted, KeyboardInterrupt):
            stream.close()  # the engine drops unfinished requests and frees their blocks
            writer.flush_held()
            outcome.interrupted = True


class _CtrlC:
    """First Ctrl-C: stop after the current engine step. Second: stop at once."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> _CtrlC:
        with contextlib.suppress(ValueError):  # not the main thread: keep the default behaviour
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def _finish(opts: RunOptions, llm, outcome: Outcome, out_path: Path | None, out: Console) -> None:
    from pagedinfer.cli import report

    stats = llm.stats if llm is not None else None
    if stats is not None and (opts.report if opts.report is not None else not opts.quiet):
        report.render(stats, out)
    if opts.report_json is not None:
        import json

        doc = report.report_dict(stats, _run_summary(opts, outcome, out_path))
        opts.report_json.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    if opts.trace is not None and llm is not None:
        from pagedinfer.cli.blocks_view import save_trace

        save_trace(opts.trace, llm.engine)
    _summary(outcome, out_path, stats, out)


def _run_summary(opts: RunOptions, outcome: Outcome, out_path: Path | None) -> dict:
    return {
        "input": str(opts.prompts),
        "output": str(out_path) if out_path is not None else "-",
        "model": opts.model or "pagedinfer-demo",
        "lines": outcome.lines,
        "skipped": outcome.skipped,
        "succeeded": outcome.ok,
        "failed": len(outcome.failed),
        "failed_lines": sorted(e.line for e in outcome.failed),
        "interrupted": outcome.interrupted,
    }


def _summary(outcome: Outcome, out_path: Path | None, stats, console: Console) -> None:
    where = str(out_path) if out_path is not None else "stdout"
    failed = sorted(outcome.failed, key=lambda e: e.line)
    parts = [f"[green]{outcome.ok} ok[/]"]
    if failed:
        shown = ", ".join(str(e.line) for e in failed[:SHOW_REASONS]) + (
            ", …" if len(failed) > SHOW_REASONS else ""
        )
        parts.append(f"[red]{len(failed)} failed[/] (line{'s' if len(failed) > 1 else ''} {shown})")
    if outcome.skipped:
        parts.append(f"{outcome.skipped} already done (--resume)")
    tail = ""
    if stats is not None and stats.steps:
        tail = f" · {stats.generated_tokens:,} tokens generated in {stats.wall_time_s:.2f} s"
    console.print(
        f"[bold]pagedinfer:[/] {outcome.lines} line{'s' if outcome.lines != 1 else ''} → {escape(where)}: "
        + ", ".join(parts)
        + tail,
        highlight=False,
        soft_wrap=True,
    )
    for e in failed[:SHOW_REASONS]:
        console.print(f"  [red]✗[/] {escape(e.message)}", highlight=False, soft_wrap=True)
    if len(failed) > SHOW_REASONS:
        console.print(
            f"  … {len(failed) - SHOW_REASONS} more; every failed line has an error record in the output",
            soft_wrap=True,
        )
    if outcome.interrupted:
        left = outcome.lines - outcome.skipped - outcome.ok - len(outcome.failed)
        console.print(
            f"[bold yellow]interrupted:[/] {left} line{'s' if left != 1 else ''} not run; "
            "run again with --resume to complete them",
            highlight=False,
            soft_wrap=True,
        )
