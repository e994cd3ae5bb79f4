"""One ``pagedinfer run``: validate, load the model, generate while streaming the input, write, report.

The input is read as a stream (memory does not grow with the number of lines), the engine is fed
from a bounded window of pending requests, and every finished line is written to the (locked)
output at once; the file is put in input order when the run completes. Exit codes (docs/cli.md):

* 0 every line succeeded, 1 some lines failed (or ``--strict`` found bad lines),
* 2 the invocation is unusable (bad file, output path, option or model; the output is locked),
* 74 writing the output failed (disk full, I/O error): the lines on disk are kept, ``--resume`` completes,
* 130 / 143 / 129 stopped by SIGINT (Ctrl-C) / SIGTERM / SIGHUP: the current step finishes, every
  finished line is on disk, ``--resume`` completes the rest. A second signal stops at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from pagedinfer.cli.jsonl_input import (
    InputFile,
    InputFileError,
    LineError,
    LineParser,
    LineRequest,
    parse_file,
    read_lines,
    scan_input,
)
from pagedinfer.cli.jsonl_output import (
    OutputError,
    OutputFile,
    OutputWriteError,
    StdoutOutput,
    default_output_path,
)

EXIT_OK, EXIT_LINES_FAILED, EXIT_USAGE, EXIT_OUTPUT_FAILED = 0, 1, 2, 74
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # exit code 128 + the signal's number
SHOW_REASONS = 10  # failed lines listed in the summary


class UsageError(Exception):
    """The invocation cannot run; the message is one line (exit code 2)."""


class Interrupted(Exception):
    """A stop signal arrived during generation; raised between engine steps."""


class Stopped(BaseException):
    """A stop signal that ends the run at once (before generation, or a second signal)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


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
    data_parallel: int = 0  # N > 0: N engine replicas on Ray (pagedinfer/ray)
    ray_address: str | None = None  # join this Ray cluster (default: a local Ray for the run)


@dataclass
class Outcome:
    lines: int = 0
    skipped: int = 0  # already in the output (--resume)
    ok: int = 0
    failed: int = 0
    failed_lines: list[int] = field(default_factory=list)
    shown: list[LineError] = field(default_factory=list)  # the failures with the lowest line numbers
    kept: int = 0  # records already in the output file when this run began (--resume)
    dropped: int = 0  # unreadable lines --resume removed from the output
    signal: int | None = None  # the signal that stopped the run
    write_error: str | None = None

    def fail(self, error: LineError) -> None:
        self.failed += 1
        self.failed_lines.append(error.line)
        self.shown.append(error)
        if len(self.shown) > 2 * SHOW_REASONS:
            self.shown = sorted(self.shown, key=lambda e: e.line)[:SHOW_REASONS]


class StopSignals:
    """SIGINT, SIGTERM and SIGHUP: during generation the first one finishes the current engine step
    (then everything finished is on disk and the report is printed); otherwise, or a second time,
    the run stops at once."""

    def __init__(self) -> None:
        self.requested: int | None = None
        self.generating = False
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if self.generating and self.requested is None:
            self.requested = signum
            return
        raise Stopped(signum)

    def __enter__(self) -> StopSignals:
        with contextlib.suppress(ValueError):  # not the main thread: keep the default behaviour
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


def execute(opts: RunOptions, out: Console, err: Console) -> int:
    run = _Run(opts, out, err)
    with run.signals:
        try:
            return run.execute()
        except (UsageError, InputFileError, OutputError) as e:
            err.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
            return EXIT_USAGE
        except (Stopped, KeyboardInterrupt) as e:
            signum = e.signum if isinstance(e, Stopped) else signal.SIGINT
            err.print(
                f"[bold yellow]stopped by {signal.Signals(signum).name}[/] at once: {run.on_disk_words()}",
                highlight=False,
                soft_wrap=True,
            )
            return 128 + signum
        finally:
            run.close()


class _Run:
    def __init__(self, opts: RunOptions, out: Console, err: Console) -> None:
        self.opts = opts
        self.err = err
        self.out = out if opts.output != "-" else err  # report and summary
        self.signals = StopSignals()
        self.outcome = Outcome()
        self.output: OutputFile | StdoutOutput | None = None
        self.out_path: Path | None = None
        self.llm = None

    def close(self) -> None:
        if isinstance(self.output, OutputFile):
            self.output.close()

    def on_disk_words(self) -> str:
        if isinstance(self.output, OutputFile):
            n = self.outcome.kept + self.output.written
            return f"{n} line{'s' if n != 1 else ''} on disk in {escape(str(self.out_path))}"
        if isinstance(self.output, StdoutOutput):
            return f"{self.output.written} lines printed"
        return "nothing was written"

    def execute(self) -> int:
        opts, outcome = self.opts, self.outcome
        source = scan_input(opts.prompts)
        outcome.lines = source.lines
        self._check_options()
        self.out_path = _output_path(opts)
        for extra in (opts.report_json, opts.trace):
            if extra is not None:
                _check_can_create(extra, opts.prompts, "file")

        done: set[str] = set()
        if opts.resume:
            self._open_output()
            done, outcome.dropped = self.output.load_done()
            outcome.kept = len(done)
            if not opts.quiet or outcome.dropped:
                dropped = (
                    f"; dropped {outcome.dropped} unreadable line{'s' if outcome.dropped != 1 else ''} "
                    "(their input lines run again)"
                    if outcome.dropped
                    else ""
                )
                self.err.print(
                    f"resume: {len(done)} records already in {escape(str(self.out_path))}{dropped}",
                    soft_wrap=True,
                )
        if opts.strict:
            items = parse_file(source, opts.sampling, opts.seed)
            bad = [i for i in items if isinstance(i, LineError) and i.key not in done]
            if bad:
                return _strict_stop(bad, self.err, before="loading the model")
        if self.output is None:
            self._open_output()
        runnable = any(
            isinstance(i, LineRequest) and i.key not in done
            for i in parse_file(source, opts.sampling, opts.seed)
        )
        if runnable and opts.data_parallel:
            self.llm = _start_replicas(opts, self.err)  # the replicas resolve each line themselves
            if opts.strict and (code := self._strict_check_replicas(source, done)) is not None:
                return code
        elif runnable:
            self.llm = _load(opts, self.err)
            if opts.strict and (code := self._strict_resolve(source, done)) is not None:
                return code
        if isinstance(self.output, OutputFile):
            self.output.start(truncate=not opts.resume)
        try:
            self._generate(source, done)
        finally:
            if opts.data_parallel and self.llm is not None:
                self.llm.close()  # reads the replicas' figures, ends them, stops the Ray this run started
        if outcome.signal is None and outcome.write_error is None and isinstance(self.output, OutputFile):
            try:
                self.output.reorder(self._rank)
            except OutputWriteError as e:
                outcome.write_error = (
                    f"{e}; every line is on disk, out of input order: --resume puts it in order"
                )
        self._finish()
        if outcome.signal is not None:
            return 128 + outcome.signal
        if outcome.write_error is not None:
            return EXIT_OUTPUT_FAILED
        return EXIT_LINES_FAILED if outcome.failed else EXIT_OK

    def _check_options(self) -> None:
        from pagedinfer.config import EngineConfig
        from pagedinfer.sampling_params import BeamSearchParams, SamplingParams

        sampling = {k: v for k, v in self.opts.sampling.items() if k != "beam_width"}
        try:
            SamplingParams(**sampling)
            if self.opts.sampling.get("beam_width"):
                BeamSearchParams(self.opts.sampling["beam_width"], sampling.get("max_tokens", 16))
        except ValueError as e:
            raise UsageError(f"invalid sampling option: {e}") from None
        engine = self.opts.engine
        keys = ("block_size", "num_blocks", "kv_cache_memory", "max_num_seqs", "max_num_batched_tokens")
        try:
            EngineConfig(**{k: engine[k] for k in keys if k in engine})
        except ValueError as e:
            raise UsageError(_option_words(str(e))) from None
        if engine.get("max_model_len") is not None and engine["max_model_len"] < 1:
            raise UsageError("--max-model-len must be >= 1")

    def _open_output(self) -> None:
        self.output = OutputFile(self.out_path) if self.out_path is not None else StdoutOutput()

    def _strict_resolve(self, source: InputFile, done: set[str]) -> int | None:
        """--strict: tokenize and check every line before generating anything (nothing is kept)."""
        from pagedinfer.cli.resolve import resolve

        bad = []
        for item in parse_file(source, self.opts.sampling, self.opts.seed):
            if isinstance(item, LineRequest) and item.key not in done:
                res = resolve(item, self.llm.engine)
                if isinstance(res, LineError):
                    bad.append(res)
        return _strict_stop(bad, self.err, before="generating") if bad else None

    def _strict_check_replicas(self, source: InputFile, done: set[str]) -> int | None:
        """--strict with --data-parallel: the replicas check every line before any runs."""
        rows = [
            (pos, item)
            for pos, item in enumerate(parse_file(source, self.opts.sampling, self.opts.seed))
            if isinstance(item, LineRequest) and item.key not in done
        ]
        bad = [failure for _, failure in self.llm.check(rows)]
        if bad:
            self.llm.close()
            return _strict_stop(bad, self.err, before="generating")
        return None

    def _rank(self, key: str | None) -> int | None:
        return self._first_line.get(key) if key is not None else None

    # -- generation -----------------------------------------------------------------------------------
    def _generate(self, source: InputFile, done: set[str]) -> None:
        from pagedinfer.cli.progress import RunProgress
        from pagedinfer.cli.records import TokenText, error_record, success_record
        from pagedinfer.cli.resolve import resolve

        opts, outcome, output, llm = self.opts, self.outcome, self.output, self.llm
        parser = LineParser(opts.sampling, opts.seed, source.openai)
        self._first_line = parser.first_line
        pending: dict[int, tuple[object, int]] = {}  # engine index -> (Resolved, output position)
        show = self.err.is_terminal and not opts.quiet
        progress = RunProgress(self.err, source.lines, show)

        def fail(error: LineError, position: int) -> None:
            outcome.fail(error)
            output.write(error_record(error), position)
            progress.advance()

        def jobs():
            """Each runnable line in turn, read, checked and tokenized only when the engine has room."""
            for position, (number, text) in enumerate(read_lines(source.path)):
                if self.signals.requested is not None:
                    raise Interrupted
                item = parser.parse(number, text)
                if item.key in done:
                    outcome.skipped += 1
                    progress.advance()
                    continue
                res = resolve(item, llm.engine) if isinstance(item, LineRequest) else item
                if isinstance(res, LineError):
                    fail(res, position)
                    continue
                pending[self._fed] = (res, position)  # the engine numbers the requests it reads 0, 1, ...
                self._fed += 1
                yield res.engine_prompt, res.item.params, str(res.item.id)

        self._fed = 0
        self.signals.generating = True
        try:
            with progress:
                if llm is None:  # no line can run: only error records to write
                    for _ in jobs():
                        raise AssertionError("a runnable line without a model")
                    return
                if opts.data_parallel:  # pagedinfer/ray: the replicas resolve, run and build the records
                    self._generate_data_parallel(parser, source, done, progress, fail)
                    return
                token_text = TokenText(llm.tokenizer)
                model_name = opts.model or "pagedinfer-demo"
                if opts.trace is not None:
                    llm.engine.enable_trace()

                def on_step(engine) -> None:
                    progress.on_step(engine)
                    if self.signals.requested is not None:
                        raise Interrupted

                stream = llm.stream(jobs(), on_step=on_step, before_step=output.sync)
                try:
                    for index, result in stream:
                        res, position = pending.pop(index)
                        if result.error:
                            fail(_failure(res.item, result.error), position)
                            continue
                        try:
                            record = success_record(res, result, token_text, model_name)
                        except Exception as e:  # noqa: BLE001 - one line's bad output must not end the run
                            fail(
                                _failure(res.item, f"could not build the output: {type(e).__name__}: {e}"),
                                position,
                            )
                            continue
                        outcome.ok += 1
                        output.write(record, position)
                        progress.advance()
                finally:
                    stream.close()  # the engine drops unfinished requests and frees their blocks
        except Interrupted:
            outcome.signal = self.signals.requested
        except OutputWriteError as e:
            outcome.write_error = str(e)
        finally:
            self.signals.generating = False
        if isinstance(output, StdoutOutput):
            output.flush_held()  # interrupted: records that finished ahead of an earlier line
        else:
            try:
                output.sync()
            except OutputWriteError as e:
                outcome.write_error = outcome.write_error or str(e)

    def _generate_data_parallel(self, parser, source: InputFile, done: set[str], progress, fail) -> None:
        """``_generate`` for ``--data-parallel``: each line's record or error as a replica returns it."""
        engines, outcome = self.llm, self.outcome

        def rows():
            for position, (number, text) in enumerate(read_lines(source.path)):
                item = parser.parse(number, text)
                if item.key in done:
                    outcome.skipped += 1
                    progress.advance()
                elif isinstance(item, LineError):
                    fail(item, position)
                else:
                    yield position, item

        def on_progress(samples: int) -> None:  # after every replica reply
            progress.on_step(engines.progress)
            if self.signals.requested is not None:
                raise Interrupted

        stream = engines.run(rows(), on_progress)
        try:
            for position, result in stream:
                if isinstance(result, LineError):
                    fail(result, position)
                else:
                    outcome.ok += 1
                    self.output.write(result, position)
                    progress.advance()
        finally:
            stream.close()

    # -- the end --------------------------------------------------------------------------------------
    def _finish(self) -> None:
        from pagedinfer.cli import report

        opts, outcome, llm = self.opts, self.outcome, self.llm
        stats = llm.stats if llm is not None else None
        if stats is not None and (opts.report if opts.report is not None else not opts.quiet):
            report.render(stats, self.out)
            if opts.data_parallel:
                llm.render_replicas(self.out)
        if opts.report_json is not None:
            import json

            doc = report.report_dict(stats, _run_summary(opts, outcome, self.out_path))
            if opts.data_parallel and llm is not None:
                doc["data_parallel"] = llm.report_dict()
            opts.report_json.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        if opts.trace is not None and llm is not None:
            from pagedinfer.cli.blocks_view import save_trace

            save_trace(opts.trace, llm.engine)
        _summary(outcome, self.out_path, stats, self.out, self.on_disk_words())
        if outcome.write_error is not None:
            left = outcome.lines - outcome.skipped - outcome.ok - outcome.failed
            self.err.print(
                f"[bold red]error:[/] {escape(outcome.write_error)}; {self.on_disk_words()}"
                + (f", {left} not run" if left else "")
                + "; make room and run again with --resume",
                highlight=False,
                soft_wrap=True,
            )


def _failure(item: LineRequest, reason: str) -> LineError:
    return LineError(item.line, item.key, item.id, reason, item.openai, item.openai is not None)


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
    if path.exists() and input_path.exists() and os.path.samefile(path, input_path):
        raise OutputError(f"{what} {path} is the input file (the same file, through a link or not)")
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
        ("kv_cache_dtype", "--kv-cache-dtype"),
        ("num_blocks", "--num-blocks"),
        ("block_size", "--block-size"),
        ("max_num_batched_tokens", "--max-batched-tokens"),
        ("max_num_seqs", "--max-num-seqs"),
        ("max_model_len", "--max-model-len"),
    ):
        message = message.replace(name, option)
    return message


def _status(opts: RunOptions, err: Console, what: str):
    """A spinner with ``what`` on a terminal (not with --quiet); else nothing."""
    return err.status(what) if err.is_terminal and not opts.quiet else contextlib.nullcontext()


def _load(opts: RunOptions, err: Console):
    from transformers.utils import logging as hf_logging

    from pagedinfer.llm import LLM
    from pagedinfer.model.loader import ModelLoadError

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    with _status(opts, err, f"loading {opts.model or 'the demo model'}"):
        try:
            return LLM(opts.model, seed=opts.seed, **opts.engine)
        except ModelLoadError as e:
            hint = "; pass --model" if opts.model is None else ""
            raise UsageError(f"{e}{hint}") from None
        except ValueError as e:
            raise UsageError(_option_words(str(e).splitlines()[0])) from None


def _start_replicas(opts: RunOptions, err: Console):
    """``--data-parallel N``: N engine replicas on Ray (local, or the cluster at ``--ray-address``)."""
    from pagedinfer.ray.driver import DataParallelEngines, RayUnavailable, ReplicaSpec

    if opts.trace is not None:
        raise UsageError("--trace records one engine; it cannot be used with --data-parallel")
    spec = ReplicaSpec(
        opts.model,
        opts.engine,
        opts.seed,
        opts.data_parallel,
        opts.ray_address,
        opts.model or "pagedinfer-demo",
    )
    with _status(
        opts, err, f"starting {opts.data_parallel} replicas of {opts.model or 'the demo model'} on Ray"
    ):
        try:
            return DataParallelEngines(spec)
        except RayUnavailable as e:
            raise UsageError(str(e)) from None


def _run_summary(opts: RunOptions, outcome: Outcome, out_path: Path | None) -> dict:
    return {
        "input": str(opts.prompts),
        "output": str(out_path) if out_path is not None else "-",
        "model": opts.model or "pagedinfer-demo",
        "lines": outcome.lines,
        "skipped": outcome.skipped,
        "succeeded": outcome.ok,
        "failed": outcome.failed,
        "failed_lines": sorted(outcome.failed_lines),
        "interrupted": outcome.signal is not None,
    }


def _summary(outcome: Outcome, out_path: Path | None, stats, console: Console, on_disk: str) -> None:
    where = str(out_path) if out_path is not None else "stdout"
    failed = sorted(outcome.shown, key=lambda e: e.line)[:SHOW_REASONS]
    parts = [f"[green]{outcome.ok} ok[/]"]
    if outcome.failed:
        lines = sorted(outcome.failed_lines)
        shown = ", ".join(str(n) for n in lines[:SHOW_REASONS]) + (", …" if len(lines) > SHOW_REASONS else "")
        parts.append(f"[red]{outcome.failed} failed[/] (line{'s' if outcome.failed > 1 else ''} {shown})")
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
    for e in failed:
        console.print(f"  [red]✗[/] {escape(e.message)}", highlight=False, soft_wrap=True)
    if outcome.failed > SHOW_REASONS:
        console.print(
            f"  … {outcome.failed - SHOW_REASONS} more; every failed line has an error record in the output",
            soft_wrap=True,
        )
    left = outcome.lines - outcome.skipped - outcome.ok - outcome.failed
    if outcome.signal is not None:
        console.print(
            f"[bold yellow]interrupted by {signal.Signals(outcome.signal).name}:[/] {on_disk}; "
            f"{left} line{'s' if left != 1 else ''} not run; run again with --resume to complete them",
            highlight=False,
            soft_wrap=True,
        )
