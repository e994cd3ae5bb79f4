"""One ``pagedinfer run``: read the input once, generate while streaming it, write, report.

Each line is read, parsed (`lines.parse`), then prepared (tokenized and checked, `engine.intake`) and
run only when the engine has room (`engine.loop`), so memory does not grow with the number of lines;
every finished line is written to the (locked) output at once and the file is put in input order
when the run completes. The model is loaded when the first line that can run is reached (a file of
bad lines gets its error records without it). Exit codes (docs/cli.md):

* 0 every line of the input has a success record, 1 some lines failed (this run or, with
  ``--resume``, an earlier one), or ``--strict`` found bad lines,
* 2 the invocation is unusable (bad file, path, option or model; the output is locked; ``--resume``
  on an input that changed, or with options other than those the output was written with),
* 74 writing the output failed (disk full, I/O error): the lines on disk are kept, ``--resume`` completes,
* 130 / 143 / 129 stopped by SIGINT (Ctrl-C) / SIGTERM / SIGHUP: the current step finishes, every
  finished line is on disk, ``--resume`` completes the rest. A second signal stops at once.
* 141 the output was a pipe whose reader went away (``-o - | head``): the run stops there.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import signal
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape

from pagedinfer.cli.jsonl_output import (
    Done,
    OutputClosed,
    OutputError,
    OutputFile,
    OutputWriteError,
    Paths,
    StreamOutput,
    plan_paths,
)
from pagedinfer.cli.progress import PROGRESS_INTERVAL_S
from pagedinfer.cli.run_options import describe, differing, run_options
from pagedinfer.lines.line import LineError, LineRequest
from pagedinfer.lines.parse import LineParser, parse_lines
from pagedinfer.lines.source import InputFileError, InputLines
from pagedinfer.terminal import keep, say

if TYPE_CHECKING:
    from pagedinfer.engine.llm_engine import StartedRequest

EXIT_OK, EXIT_LINES_FAILED, EXIT_USAGE, EXIT_OUTPUT_FAILED = 0, 1, 2, 74
EXIT_OUTPUT_CLOSED = 128 + signal.SIGPIPE
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # exit code 128 + the signal's number
SHOW_REASONS = 10  # failed lines listed in the summary
CAP_OPTIONS = {
    "max_line_tokens": "--max-line-tokens",
    "line_timeout": "--line-timeout",
}  # a record's capped_by


class UsageError(Exception):
    """The invocation cannot run; the message is one line (exit code 2)."""


class Interrupted(BaseException):
    """A stop signal arrived during generation; raised between engine steps (and during a line's chat
    template: a BaseException, so no ``except Exception`` on its way takes it for the line's failure)."""


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
    progress: str = "auto"  # bar, log, none; auto: a bar on a terminal, a log elsewhere, none with --quiet
    progress_interval: float = PROGRESS_INTERVAL_S  # seconds between two records of the log
    data_parallel: int = 0  # N > 0: N engine replicas on Ray (pagedinfer/ray)
    ray_address: str | None = None  # join this Ray cluster (default: a local Ray for the run)
    loras: list[tuple[str, str]] = field(default_factory=list)  # --lora NAME=PATH, loaded with the model
    chat_template: Path | None = None  # --chat-template FILE as given (engine["chat_template"]: its text)


@dataclass
class Outcome:
    lines: int = 0
    skipped: int = 0  # already in the output (--resume)
    ok: int = 0
    failed: int = 0
    failed_lines: list[int] = field(default_factory=list)
    shown: list[LineError] = field(default_factory=list)  # the failures with the lowest line numbers
    kept: int = 0  # records already in the output file when this run began (--resume)
    kept_errors: int = 0  # of them, error records
    dropped: int = 0  # unreadable lines --resume removed from the output
    signal: int | None = None  # the signal that stopped the run
    write_error: str | None = None
    closed: bool = False  # the output's reader went away
    capped: Counter = field(default_factory=Counter)  # lines a per-run cap ended (CAP_OPTIONS), per cap
    unfinished: list[StartedRequest] = field(default_factory=list)  # lines started, not finished, at the end

    def not_run(self) -> int:
        """Lines with no record from this run or an earlier one: --resume's kept records stand for
        their lines whether this run reached them or not."""
        return max(0, self.lines - max(self.skipped, self.kept) - self.ok - self.failed)

    def not_run_words(self) -> str:
        """``N lines not run``, split into the lines a stop interrupted mid-generation (with the
        tokens they had, lost) and those not started."""
        left, cut = self.not_run(), len(self.unfinished)
        words = f"{keep(f'{left} line' + ('s' if left != 1 else ''))} not run"  # counts kept with their words
        if not cut:
            return words
        tokens = sum(x.tokens for x in self.unfinished)
        parts = [
            f"{keep(f'{cut} interrupted')} mid-generation ({keep(f'{tokens:,} token' + ('s' if tokens != 1 else ''))} "
            "generated, not kept)"
        ]
        if left > cut:
            parts.append(f"{keep(f'{left - cut} not')} started")
        return f"{words}: {', '.join(parts)}"

    def succeed(self, record: dict) -> None:
        from pagedinfer.lines.records import caps_of

        self.ok += 1
        self.capped.update(caps_of(record))

    def fail(self, error: LineError) -> None:
        self.failed += 1
        self.failed_lines.append(error.line)
        self.shown.append(error)
        if len(self.shown) > 2 * SHOW_REASONS:
            self.shown = sorted(self.shown, key=lambda e: e.line)[:SHOW_REASONS]


class StopSignals:
    """SIGINT, SIGTERM and SIGHUP: during generation the first one finishes the current engine step
    (then everything finished is on disk and the report is printed); otherwise, or a second time,
    the run stops at once. `install` again takes them back from a library that replaced them (Ray)."""

    def __init__(self) -> None:
        self.requested: int | None = None
        self.generating = False
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if self.generating and self.requested is None:
            self.requested = signum
            return
        raise Stopped(signum)

    def install(self) -> None:
        with contextlib.suppress(ValueError):  # not the main thread: keep the default behaviour
            for sig in STOP_SIGNALS:
                previous = signal.signal(sig, self._handle)
                self._previous.setdefault(sig, previous)

    def __enter__(self) -> StopSignals:
        self.install()
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
            say(err, f"[bold red]error:[/] {escape(str(e))}")
            return EXIT_USAGE
        except (Stopped, KeyboardInterrupt) as e:
            signum = e.signum if isinstance(e, Stopped) else signal.SIGINT
            say(
                err,
                f"[bold yellow]stopped by {signal.Signals(signum).name}[/] at once: {run.on_disk_words()}",
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
        self.output: OutputFile | StreamOutput | None = None
        self.paths: Paths | None = None
        self.source: InputLines | None = None
        self.llm = None
        self.parser: LineParser | None = None
        self.kept_fingerprint: str | None = None  # --resume: the system_fingerprint of the records kept

    def close(self) -> None:
        if self.output is not None:
            self.output.close()
        if self.source is not None:
            self.source.close()

    def on_disk_words(self) -> str:
        if isinstance(self.output, OutputFile):
            n = self.outcome.kept + self.output.written
            return f"{n} line{'s' if n != 1 else ''} on disk in {escape(keep(str(self.output.path)))}"
        if isinstance(self.output, StreamOutput):
            return f"{self.output.written} lines written to {escape(keep(str(self.output.path or 'stdout')))}"
        return "nothing was written"

    def execute(self) -> int:
        opts, outcome = self.opts, self.outcome
        self._check_options()
        self.source = InputLines(opts.prompts)
        self.paths = plan_paths(opts.output, opts.prompts, opts.report_json, opts.trace)
        if opts.resume and self.paths.stream:
            raise UsageError(f"--resume needs an output file, not {self.paths.output or 'stdout (-o -)'}")
        if opts.trace is not None and opts.data_parallel:
            raise UsageError("--trace records one engine; it cannot be used with --data-parallel")
        done: set[str] = set()
        if opts.resume:
            self._open_output()
            done = self._resume()
        self.parser = LineParser(opts.sampling, opts.seed, openai_file=None, adapters=self._adapters())
        if opts.strict and (code := self._strict(done)) is not None:
            return code  # nothing written, nothing truncated
        if self.output is None:
            self._open_output()
        if isinstance(self.output, OutputFile):  # an output with no records takes this run's options
            self.output.start(truncate=not opts.resume, options=None if done else run_options(opts))
        try:
            self._generate(done)
        finally:
            if opts.data_parallel and self.llm is not None:
                self.llm.close()  # reads the replicas' figures, ends them, stops the Ray this run started
        outcome.lines = self.source.count
        if outcome.signal is not None or outcome.write_error is not None:  # stopped before the input's end
            outcome.lines += self.source.count_unread()
        if outcome.signal is None and outcome.write_error is None and isinstance(self.output, OutputFile):
            try:
                self.output.reorder(self.parser.first_line.get)  # each record's rank: its line number
            except OutputWriteError as e:
                outcome.write_error = (
                    f"{e}; every line is on disk, out of input order: --resume puts it in order"
                )
        self._finish()
        if outcome.signal is not None:
            return 128 + outcome.signal
        if outcome.closed:
            return EXIT_OUTPUT_CLOSED
        if outcome.write_error is not None:
            return EXIT_OUTPUT_FAILED
        return EXIT_LINES_FAILED if outcome.failed or outcome.kept_errors else EXIT_OK

    def _check_options(self) -> None:
        from pagedinfer.config import EngineConfig
        from pagedinfer.sampling_params import BeamSearchParams, SamplingParams

        sampling = {k: v for k, v in self.opts.sampling.items() if k != "beam_width"}
        try:
            SamplingParams(**sampling)
            if self.opts.sampling.get("beam_width"):
                BeamSearchParams(self.opts.sampling["beam_width"], sampling.get("max_tokens") or 16)
        except ValueError as e:
            raise UsageError(f"invalid sampling option: {e}") from None
        engine = self.opts.engine
        keys = ("block_size", "num_blocks", "kv_cache_memory", "gpu_memory_utilization", "max_num_seqs")
        keys += ("max_num_batched_tokens", "max_model_len", "max_line_tokens", "line_timeout", "max_logprobs")
        keys += ("speculative_config",)
        try:
            EngineConfig(seed=self.opts.seed, **{k: engine[k] for k in keys if k in engine})
        except ValueError as e:
            raise UsageError(_option_words(str(e))) from None

    def _adapters(self) -> frozenset[str]:
        """The names of the ``--lora`` adapters (loaded with the model), which lines may name."""
        return frozenset(name for name, _ in self.opts.loras)

    def _open_output(self) -> None:
        paths = self.paths
        self.output = StreamOutput(paths.output) if paths.stream else OutputFile(paths.output, paths.resume)

    def _resume(self) -> set[str]:
        """--resume: what the output already answers; refuse an input that changed since."""
        found = self.output.load_done()
        if found.fingerprint is not None and (why := self.source.check_fingerprint(found.fingerprint)):
            raise UsageError(
                f"--resume: input file {self.opts.prompts} changed since {self.paths.output} was written ({why}); "
                "restore it, or run without --resume to start over"
            )
        if found.keys and found.options is not None:
            self._refuse_other_options(found.options)
        outcome = self.outcome
        outcome.kept, outcome.kept_errors, outcome.dropped = len(found.keys), found.errors, found.dropped
        self.kept_fingerprint = found.system_fingerprint if found.keys else None
        unchecked = self._unchecked_words(found)
        if not self.opts.quiet or found.dropped or unchecked:
            words = [f"resume: {len(found.keys)} records already in {escape(str(self.paths.output))}"]
            if found.dropped:
                s = "s" if found.dropped != 1 else ""
                words.append(f"dropped {found.dropped} unreadable line{s} (their input lines run again)")
            if unchecked:
                words.append(unchecked)
            say(self.err, "; ".join(words))
        return found.keys

    def _refuse_other_options(self, kept: dict) -> None:
        """--resume: the records on disk were made with ``kept``; appending records made with other
        options would leave one file mixing both, with nothing in it to tell which is which."""
        current = run_options(self.opts)
        names = differing(kept, current)
        if names:
            raise UsageError(
                f"--resume: {self.paths.output} was written with {describe(kept, names)}; "
                f"this run has {describe(current, names)}: give the same options, "
                "or run without --resume to start over"
            )

    def _unchecked_words(self, found: Done) -> str | None:
        """What --resume could not check for want of a resume file, or of its options (an older
        version kept the fingerprint alone); None when all was checked, or no record is kept."""
        name = escape(self.paths.resume.name)
        if not found.keys:
            return None
        if found.fingerprint is None and found.options is None:
            return f"no {name} beside it, so neither the input nor the options can be checked"
        if found.fingerprint is None:
            return f"{name} keeps no fingerprint, so the input cannot be checked unchanged"
        if found.options is None:
            return f"{name} keeps no options (an older version wrote it), so they cannot be checked"
        return None

    def _strict(self, done: set[str]) -> int | None:
        """--strict: check every line without the model, then with it, before generating anything
        (three reads of the input: the checks keep nothing in memory)."""
        bad = [i for i in self._parsed(done) if isinstance(i, LineError)]
        if bad:
            return _strict_stop(bad, self.err, before="loading the model")
        self.source.rewind()
        requests = (i for i in self._parsed(done) if isinstance(i, LineRequest))
        first = next(requests, None)
        if first is not None:
            self._load()
            bad = self._strict_with_model(itertools.chain([first], requests))
        self.source.rewind()
        return _strict_stop(bad, self.err, before="generating") if bad else None

    def _parsed(self, done: set[str]) -> Iterator[LineRequest | LineError]:
        return (
            item
            for item in parse_lines(self.source, self.opts.sampling, self.opts.seed, self._adapters())
            if item.key not in done
        )

    def _strict_with_model(self, requests: Iterator[LineRequest]) -> list[LineError]:
        if self.opts.data_parallel:
            bad = [failure for _, failure in self.llm.check(list(enumerate(requests)))]
            if bad:
                self.llm.close()
            return bad
        from pagedinfer.engine.intake import Rejected

        intake = self.llm.engine.intake
        checked = ((i, intake.prepare(i.prompt, i.params, str(i.id), i.lora)) for i in requests)
        return [i.failed(p.reason) for i, p in checked if isinstance(p, Rejected)]

    # -- generation -----------------------------------------------------------------------------------
    def _items(self, done: set[str], progress) -> Iterator[tuple[int, LineRequest]]:
        """The lines that run, in order: read once, parsed once; error records and done lines handled here."""
        for position, (number, text) in enumerate(self.source):
            if self.signals.requested is not None:
                raise Interrupted
            item = self.parser.parse(number, text)
            if item.key in done:
                self.outcome.skipped += 1
                progress.advance(ran=False)
            elif isinstance(item, LineError):
                self._fail(item, position, progress)
            else:
                yield position, item

    def _fail(self, error: LineError, position: int, progress) -> None:
        from pagedinfer.lines.records import error_record

        # counted once written: a failed write is no record
        self.output.write(error_record(error), position, error.key)
        self.outcome.fail(error)
        progress.advance()

    def _generate(self, done: set[str]) -> None:
        from pagedinfer.cli.progress import RunProgress

        opts, outcome = self.opts, self.outcome
        progress = RunProgress(self.err, self.source, _progress_mode(opts, self.err), opts.progress_interval)
        try:
            with progress:
                items = self._items(done, progress)
                first = next(items, None)  # the error records of the lines before it are written meanwhile
                if first is not None:
                    if self.llm is None:
                        self._load()
                    self._keep_system_fingerprint()
                    progress.start()
                    self.signals.generating = True
                    rows = itertools.chain([first], items)
                    if opts.data_parallel:
                        self._run_replicas(rows, progress)
                    else:
                        self._run_engine(rows, progress)
        except Interrupted:
            pass  # the stop it answers is recorded below
        except OutputClosed as e:
            outcome.closed, outcome.write_error = True, str(e)
        except OutputWriteError as e:
            outcome.write_error = str(e)
        finally:
            self.signals.generating = False
        # a stop that arrived during generation ends the run as stopped, also when no step boundary
        # came after it to raise Interrupted (the last lines all refused at intake)
        outcome.signal = self.signals.requested
        if isinstance(self.output, StreamOutput):
            with contextlib.suppress(OutputWriteError):
                self.output.flush_held()  # interrupted: records that finished ahead of an earlier line
        else:
            try:
                self.output.sync(self.source.fingerprint())
            except OutputWriteError as e:
                outcome.write_error = outcome.write_error or str(e)

    def _run_engine(self, rows: Iterator[tuple[int, LineRequest]], progress) -> None:
        """The lines through the one generation loop (as `LLM.stream` runs), each written as it finishes."""
        from pagedinfer.engine.loop import GenerationLoop
        from pagedinfer.lines.records import TokenText, success_record

        llm, output, outcome = self.llm, self.output, self.outcome
        token_text = TokenText(llm.tokenizer)
        model_name = self.opts.model or "pagedinfer-demo"
        if self.opts.trace is not None:
            llm.engine.enable_trace()

        def interrupt() -> None:
            if self.signals.requested is not None:
                raise Interrupted

        def on_step(engine) -> None:
            progress.on_step(engine)
            interrupt()

        feed = (  # each request tagged with its line and the line's output position
            (
                (item, position),
                llm.engine.intake.prepare(item.prompt, item.params, str(item.id), item.lora, interrupt),
            )
            for position, item in rows
        )
        loop = GenerationLoop(llm.engine, lambda: output.sync(self.source.fingerprint()), on_step)
        stream = loop.stream(feed)
        try:
            for (item, position), result in stream:
                if result.error:
                    self._fail(item.failed(result.error), position, progress)
                    continue
                try:
                    fingerprint = llm.engine.system_fingerprint(item.lora)
                    record = success_record(item, result, token_text, model_name, fingerprint)
                except Exception as e:  # noqa: BLE001 - one line's bad output must not end the run
                    self._fail(
                        item.failed(f"could not build the output: {type(e).__name__}: {e}"),
                        position,
                        progress,
                    )
                    continue
                output.write(record, position, item.key)
                outcome.succeed(record)
                progress.advance()
        finally:
            stream.close()  # the engine drops unfinished requests and frees their blocks
            outcome.unfinished = loop.dropped  # none unless the run stopped early

    def _run_replicas(self, rows: Iterator[tuple[int, LineRequest]], progress) -> None:
        """``--data-parallel``: each line's record or error as a replica returns it."""
        from pagedinfer.lines.records import record_key

        engines, outcome = self.llm, self.outcome

        def on_progress(completions: int) -> None:  # after every replica reply
            progress.on_step(engines.progress)
            if self.signals.requested is not None:
                raise Interrupted

        stream = engines.run(rows, on_progress)
        try:
            for position, result in stream:
                if isinstance(result, LineError):
                    self._fail(result, position, progress)
                else:
                    self.output.write(result, position, record_key(result))
                    outcome.succeed(result)
                    progress.advance()
        finally:
            outcome.unfinished = engines.progress.started_requests()  # as of each replica's last reply
            stream.close()

    def _load(self) -> None:
        self.llm = (
            _start_replicas(self.opts, self.err) if self.opts.data_parallel else _load(self.opts, self.err)
        )
        self.signals.install()  # Ray's driver takes SIGTERM for itself: the run keeps its own handling
        self._note_capped_context()

    def _keep_system_fingerprint(self) -> None:
        """The run's system_fingerprint beside the output (docs/reproducibility.md); --resume says when
        the records kept were made under another one (their bytes need not match this run's)."""
        llm = self.llm
        infos = (
            llm.infos
            if self.opts.data_parallel
            else [{"system_fingerprint": llm.engine.system_fingerprint()}]
        )
        value = ",".join(sorted({i["system_fingerprint"] for i in infos}))
        if isinstance(self.output, OutputFile):
            self.output.keep_system_fingerprint(value)
        if self.kept_fingerprint is not None and self.kept_fingerprint != value:
            self.err.print(
                f"note: --resume: the records kept in {escape(str(self.paths.output))} were made under "
                f"system_fingerprint {self.kept_fingerprint}, this run's is {value} (other model files, dtype, "
                "kernels or numerics): the two parts of the output need not match one run's",
                highlight=False,
                soft_wrap=True,
            )

    def _note_capped_context(self) -> None:
        """--max-model-len above the model's context runs capped: said once, here, on stderr (even
        with --quiet: the run does not do what the option asked). The engine's own warning is
        silenced in `_load`; replicas' are not shown (Ray does not forward their output)."""
        from pagedinfer.engine.llm_engine import capped_context_words

        llm = self.llm
        context = llm.infos[0]["context"] if self.opts.data_parallel else llm.engine.loaded.max_model_len
        words = capped_context_words("--max-model-len", self.opts.engine.get("max_model_len"), context)
        if words is not None:
            say(self.err, f"note: {escape(words)}")

    # -- the end --------------------------------------------------------------------------------------
    def _finish(self) -> None:
        from pagedinfer.cli import report

        opts, outcome, llm = self.opts, self.outcome, self.llm
        stats = llm.stats if llm is not None else None
        if stats is not None and (opts.report if opts.report is not None else not opts.quiet):
            report.render(stats, self.out)
            if opts.data_parallel:
                report.render_replicas(llm.replica_rows(), self.out)
        if opts.report_json is not None:
            import json

            doc = report.report_dict(stats, _run_summary(opts, outcome, self.paths))
            if opts.data_parallel and llm is not None:
                doc["data_parallel"] = llm.report_dict()
            self.paths.report_json.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        if opts.trace is not None and llm is not None:
            from pagedinfer.cli.blocks_view import save_trace

            save_trace(self.paths.trace, llm.engine)
        where = str(self.paths.output) if self.paths.output is not None else "stdout"
        _summary(outcome, where, stats, self.out, self.on_disk_words())
        if outcome.write_error is not None:
            left = outcome.not_run()
            tail = "; make room and run again with --resume" if isinstance(self.output, OutputFile) else ""
            say(
                self.err,
                f"[bold red]{'stopped' if outcome.closed else 'error'}:[/] {escape(outcome.write_error)}; "
                f"{self.on_disk_words()}" + (f", {outcome.not_run_words()}" if left else "") + tail,
            )


def _strict_stop(bad: list[LineError], err: Console, before: str) -> int:
    say(
        err,
        f"[bold red]--strict:[/] {len(bad)} bad line{'s' if len(bad) > 1 else ''}; stopping before {before}:",
    )
    for item in bad:
        say(err, f"  {escape(item.message)}")
    return EXIT_LINES_FAILED


def _option_words(message: str) -> str:
    """Engine setting names -> the command-line options that set them (whole words only: ``seed``
    names --seed, never a part of another word)."""
    for name, option in (
        ("kv_cache_memory", "--kv-cache-memory"),
        ("gpu_memory_utilization", "--gpu-memory-utilization"),
        ("kv_cache_dtype", "--kv-cache-dtype"),
        ("num_blocks", "--num-blocks"),
        ("block_size", "--block-size"),
        ("max_num_batched_tokens", "--max-num-batched-tokens"),
        ("max_num_seqs", "--max-num-seqs"),
        ("max_model_len", "--max-model-len"),
        ("max_line_tokens", "--max-line-tokens"),
        ("line_timeout", "--line-timeout"),
        ("max_logprobs", "--max-logprobs"),
        ("speculative_config", "--speculative-config"),
        ("seed", "--seed"),
    ):
        message = re.sub(rf"(?<![\w-]){name}(?![\w-])", option, message)
    return message


def _progress_mode(opts: RunOptions, err: Console) -> str:
    """--progress: auto is a bar on a terminal, the log elsewhere, nothing with --quiet."""
    if opts.progress != "auto":
        return opts.progress
    return "none" if opts.quiet else "bar" if err.is_terminal else "log"


def _status(opts: RunOptions, err: Console, what: str):
    """A spinner with ``what`` on a terminal (not with --quiet); else nothing."""
    return err.status(what) if err.is_terminal and not opts.quiet else contextlib.nullcontext()


def _demo_model_hint(opts: RunOptions, error: Exception) -> str:
    """ "; pass --model" when the embedded demo model itself could not be loaded; not after an error
    that another model would meet as well (a device, a dtype), where the hint would mislead."""
    from pagedinfer.model.loader import DEMO_MODEL

    return "; pass --model" if opts.model is None and str(DEMO_MODEL) in str(error) else ""


def _load(opts: RunOptions, err: Console):
    from transformers.utils import logging as hf_logging

    from pagedinfer.engine.llm_engine import MaxModelLenCapped
    from pagedinfer.llm import LLM
    from pagedinfer.lora.adapter import AdapterError
    from pagedinfer.lora.request import LoRARequest
    from pagedinfer.model.loader import ModelLoadError

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    with _status(opts, err, f"loading {opts.model or 'the demo model'}"):
        try:
            with warnings.catch_warnings():  # the run says it in its own words (`_note_capped_context`)
                warnings.simplefilter("ignore", MaxModelLenCapped)
                llm = LLM(opts.model, seed=opts.seed, **opts.engine)
        except ModelLoadError as e:
            raise UsageError(f"{e}{_demo_model_hint(opts, e)}") from None
        except ValueError as e:
            raise UsageError(_option_words(str(e).splitlines()[0])) from None
        for i, (name, path) in enumerate(opts.loras, start=1):
            try:
                llm.engine.add_lora(LoRARequest(name, i, path))
            except AdapterError as e:
                raise UsageError(f"--lora {name}={path}: {e}") from None
        return llm


def _start_replicas(opts: RunOptions, err: Console):
    """``--data-parallel N``: N engine replicas on Ray (local, or the cluster at ``--ray-address``).
    The ``--lora`` adapters' files are read here first, so an unreadable one is refused as a
    single-process run refuses it, before Ray starts; each replica checks them against its model."""
    from pagedinfer.lora.adapter import AdapterError, read_adapter
    from pagedinfer.ray.driver import DataParallelEngines, RayUnavailable, ReplicaSpec

    for name, path in opts.loras:
        try:
            read_adapter(name, path)
        except AdapterError as e:
            raise UsageError(f"--lora {name}={path}: {e}") from None
    spec = ReplicaSpec(
        opts.model,
        opts.engine,
        opts.seed,
        opts.data_parallel,
        opts.ray_address,
        opts.model or "pagedinfer-demo",
        loras=tuple(opts.loras),
    )
    with _status(
        opts, err, f"starting {opts.data_parallel} replicas of {opts.model or 'the demo model'} on Ray"
    ):
        try:
            return DataParallelEngines(spec)
        except RayUnavailable as e:
            raise UsageError(str(e)) from None


def _run_summary(opts: RunOptions, outcome: Outcome, paths: Paths) -> dict:
    return {
        "input": str(opts.prompts),
        "output": str(paths.output) if paths.output is not None else "-",
        "model": opts.model or "pagedinfer-demo",
        "lines": outcome.lines,
        "skipped": outcome.skipped,
        "succeeded": outcome.ok,
        "failed": outcome.failed,
        "failed_lines": sorted(outcome.failed_lines),
        **{f"capped_by_{cap}": outcome.capped[cap] for cap in CAP_OPTIONS},
        "interrupted": outcome.signal is not None,
        "interrupted_lines": len(outcome.unfinished),
        "interrupted_tokens": sum(x.tokens for x in outcome.unfinished),
    }


def _summary(outcome: Outcome, where: str, stats, console: Console, on_disk: str) -> None:
    failed = sorted(outcome.shown, key=lambda e: e.line)[:SHOW_REASONS]
    caps = [
        f"{keep(f'{outcome.capped[cap]} capped')} by {option}"
        for cap, option in CAP_OPTIONS.items()
        if outcome.capped[cap]
    ]
    # a count stays with its word (terminal.keep)
    parts = [f"[green]{keep(f'{outcome.ok} ok')}[/]" + (f" ({', '.join(caps)})" if caps else "")]
    if outcome.failed:
        lines = sorted(outcome.failed_lines)
        shown = ", ".join(str(n) for n in lines[:SHOW_REASONS]) + (", …" if len(lines) > SHOW_REASONS else "")
        parts.append(
            f"[red]{keep(f'{outcome.failed} failed')}[/] (line{'s' if outcome.failed > 1 else ''} {shown})"
        )
    if outcome.skipped:
        earlier = f", {outcome.kept_errors} of them error records" if outcome.kept_errors else ""
        parts.append(f"{keep(f'{outcome.skipped} already done')} (--resume{earlier})")
    tail = ""
    if stats is not None and stats.steps:
        n = stats.completion_tokens  # what the records hold (beam search samples more than it returns)
        tokens, seconds = f"{n:,} token{'s' if n != 1 else ''}", f"{stats.wall_time_s:.2f} s"
        tail = f" · {keep(tokens)} generated in {keep(seconds)}"
    say(
        console,
        f"[bold]pagedinfer:[/] {keep(f'{outcome.lines} line' + ('s' if outcome.lines != 1 else ''))} → "
        f"{escape(keep(where))}: " + ", ".join(parts) + tail,
    )
    for e in failed:
        say(console, f"  [red]✗[/] {escape(e.message)}")
    if outcome.failed > SHOW_REASONS:
        say(
            console,
            f"  … {outcome.failed - SHOW_REASONS} more; every failed line has an error record in the output",
        )
    if outcome.signal is not None:
        say(
            console,
            f"[bold yellow]interrupted by {signal.Signals(outcome.signal).name}:[/] {on_disk}; "
            f"{outcome.not_run_words()}; run again with --resume to complete them",
        )
