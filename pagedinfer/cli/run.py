"""One ``pagedinfer run``: read the input once, generate while streaming it, write, report.

This module puts the run's parts in order: its options (`cli.run_options`), ``--resume``
(`cli.resume`), ``--strict`` (`cli.strict`), the model (`cli.engines`), the lines' answers
(`lines.runner`: each line read and parsed once, prepared and run only when the engine has room, so
memory does not grow with the number of lines), the output (`cli.jsonl_output`: every answer written
at once, in one place, the file put in input order when the run completes), the stop signals
(`cli.signals`) and the report and summary (`cli.report`, `cli.outcome`). The model is loaded when
the first line that can run is reached (a file of bad lines gets its error records without it).
Exit codes (docs/cli.md):

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
import os
import signal
import stat
from collections.abc import Iterator
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape

from pagedinfer.cli import engines, strict
from pagedinfer.cli.jsonl_output import (
    OutputClosed,
    OutputError,
    OutputFile,
    OutputWriteError,
    Paths,
    StreamOutput,
    plan_paths,
)
from pagedinfer.cli.line_journal import LineJournal, Resumed
from pagedinfer.cli.outcome import Outcome, run_summary, summary
from pagedinfer.cli.resume import keep_system_fingerprint, resume, run_options
from pagedinfer.cli.run_options import RunOptions, UsageError
from pagedinfer.cli.signals import Interrupted, Stopped, StopSignals
from pagedinfer.config import LLMConfig, engine_option_words
from pagedinfer.lines.line import LineError, LineRequest
from pagedinfer.lines.parse import LineParser
from pagedinfer.lines.source import InputFileError, InputLines
from pagedinfer.terminal import keep, say

if TYPE_CHECKING:
    from pagedinfer.lines.runner import Answer

EXIT_OK, EXIT_LINES_FAILED, EXIT_USAGE, EXIT_OUTPUT_FAILED = 0, 1, 2, 74
EXIT_OUTPUT_CLOSED = 128 + signal.SIGPIPE


def execute(opts: RunOptions, out: Console, err: Console) -> int:
    if opts.threads is not None:
        import torch

        torch.set_num_threads(opts.threads)
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
        self.config: LLMConfig | None = None  # the model's and the engine's settings, checked
        self.llm = None  # the model: an LLM, or the --data-parallel replicas
        self.lines = None  # what answers the rows on it: a LineRunner, or the replicas
        self.parser: LineParser | None = None
        self.kept_fingerprint: str | None = None  # --resume: the system_fingerprint of the records kept
        self.journal: LineJournal | None = None  # the unfinished lines' tokens (resume inside a line)
        self.resumed: Resumed | None = None  # --resume: what the journal kept of unfinished lines

    def close(self) -> None:
        if self.journal is not None:
            self.journal.close()
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
            found = resume(self.output, self.source, opts, self.paths, self.err)
            outcome.kept, outcome.kept_errors, outcome.dropped = len(found.keys), found.errors, found.dropped
            self.kept_fingerprint = found.system_fingerprint if found.keys else None
            done = found.keys
        adapters = frozenset(name for name, _ in opts.loras)  # loaded with the model; lines may name them
        self.parser = LineParser(opts.sampling, opts.seed, openai_file=None, adapters=adapters)
        if opts.strict and (code := strict.check(self.source, opts, done, adapters, self._load, self.err)):
            return code  # nothing written, nothing truncated
        if self.output is None:
            self._open_output()
        if isinstance(self.output, OutputFile):  # an output with no records takes this run's options
            self.output.start(truncate=not opts.resume, options=None if done else run_options(opts))
            self._start_journal(done)
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
            if self.journal is not None:
                self.journal.remove()
        self._finish()
        if outcome.signal is not None:
            return 128 + outcome.signal
        if outcome.closed:
            return EXIT_OUTPUT_CLOSED
        if outcome.write_error is not None:
            return EXIT_OUTPUT_FAILED
        return EXIT_LINES_FAILED if outcome.failed or outcome.kept_errors else EXIT_OK

    def _check_options(self) -> None:
        from pagedinfer.sampling_params import BeamSearchParams, SamplingParams

        sampling = {k: v for k, v in self.opts.sampling.items() if k != "beam_width"}
        try:
            SamplingParams(**sampling)
            if self.opts.sampling.get("beam_width"):
                BeamSearchParams(self.opts.sampling["beam_width"], sampling.get("max_tokens") or 16)
        except ValueError as e:
            raise UsageError(f"invalid sampling option: {e}") from None
        try:
            self.config = LLMConfig.of(self.opts.model, seed=self.opts.seed, **self.opts.engine)
        except ValueError as e:
            raise UsageError(engine_option_words(str(e))) from None

    def _start_journal(self, done: set[str]) -> None:
        """Keep the unfinished lines' tokens beside the output (not with --resume-every-tokens 0, nor
        across --data-parallel replicas); a resumed run first takes what the earlier one kept."""
        opts = self.opts
        if not opts.resume_every_tokens or opts.data_parallel:
            return
        mode = stat.S_IMODE(os.stat(self.paths.output).st_mode)
        journal = LineJournal(self.paths.journal, opts.resume_every_tokens, opts.resume_every_seconds, mode)
        if opts.resume:
            self.resumed = self.outcome.resumed = journal.load(done)
        journal.start(self.resumed)
        self.journal = journal

    def _keep_unfinished(self) -> None:
        """A stop: keep every unfinished line's tokens now (once), and count them for the summary."""
        if self.journal is None or self.outcome.unfinished_kept is not None:
            return
        lines = self.lines.generating()
        self.journal.step(lines, force=True)
        self.outcome.unfinished_kept = self.journal.kept_tokens({key for key, _ in lines})

    def _open_output(self) -> None:
        paths = self.paths
        self.output = StreamOutput(paths.output) if paths.stream else OutputFile(paths.output, paths.resume)

    def _load(self):
        """The model and what answers rows on it, loaded once (``--strict`` may have loaded them)."""
        if self.lines is None:
            self.llm, self.lines = engines.start(self.opts, self.config, self.err)
            self.signals.install()  # Ray's driver takes SIGTERM for itself: the run keeps its own handling
            engines.note_capped_context(self.opts, self.llm, self.err)
        return self.lines

    # -- generation -----------------------------------------------------------------------------------
    def _generate(self, done: set[str]) -> None:
        """Every line's answer, written as it comes: the lines before the first that can run without
        the model, the rest from what runs them (`lines.runner`)."""
        from pagedinfer.cli.progress import RunProgress

        opts, outcome = self.opts, self.outcome
        progress = RunProgress(self.err, self.source, _progress_mode(opts, self.err), opts.progress_interval)
        try:
            with progress:
                rows = self._rows(done, progress)
                first = self._first_request(rows, progress)
                if first is not None:
                    self._load()
                    if self.resumed is not None:
                        self.lines.kept = dict(self.resumed.lines)  # taken as its lines start
                    fingerprint = self.llm.system_fingerprint()
                    keep_system_fingerprint(
                        self.output, fingerprint, self.kept_fingerprint, self.paths, self.err
                    )
                    progress.start()
                    self.signals.generating = True
                    answers = self._answers(itertools.chain([first], rows), progress)
                    try:
                        for answer in answers:
                            self._write(answer, progress)
                    finally:
                        with contextlib.suppress(OutputWriteError):
                            self._keep_unfinished()  # a failed write (a stop kept them already)
                        answers.close()  # the engine drops unfinished requests and frees their blocks
                        outcome.unfinished = self.lines.dropped  # none unless the run stopped early
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

    def _rows(self, done: set[str], progress) -> Iterator[tuple[int, LineRequest | LineError]]:
        """Each line not done yet, as parsed, with its output position: read once, parsed once."""
        for position, (number, text) in enumerate(self.source):
            self.signals.interrupt()
            item = self.parser.parse(number, text)
            if item.key in done:
                self.outcome.skipped += 1
                progress.advance(ran=False)
            else:
                yield position, item

    def _first_request(self, rows: Iterator[tuple[int, LineRequest | LineError]], progress) -> tuple | None:
        """The first line that can run, once the error records of the lines before it are written
        (they need no model: a file of bad lines gets its records without loading one)."""
        from pagedinfer.lines.runner import Answer

        for position, item in rows:
            if isinstance(item, LineRequest):
                return position, item
            self._write(Answer(position, item.key, item), progress)
        return None

    def _answers(self, rows: Iterator[tuple[int, LineRequest | LineError]], progress):
        """The answers of ``rows``: from the one engine, made durable before each step, or from the replicas."""

        def on_step(llm) -> None:  # after every engine step, or replica reply
            progress.on_step(llm)
            if self.signals.requested is not None and not self.opts.data_parallel:
                self._keep_unfinished()  # before the stop drops them
            self.signals.interrupt()

        if self.opts.trace is not None:
            self.llm.enable_trace()
        if self.opts.data_parallel:
            return self.lines.run(rows, on_step)

        def before_step() -> None:  # the finished lines durable, then the unfinished ones' tokens
            self.output.sync(self.source.fingerprint())
            if self.journal is not None:
                self.journal.step(self.lines.generating())

        return self.lines.run(rows, before_step, on_step, self.signals.interrupt)

    def _write(self, answer: Answer, progress) -> None:
        """One line's record, written (counted once written: a failed write is no record)."""
        self.output.write(answer.record, answer.position, answer.key)
        if self.journal is not None:
            self.journal.finished(answer.key)
        if isinstance(answer.result, LineError):
            self.outcome.fail(answer.result)
        else:
            self.outcome.succeed(answer.result)
        progress.advance()

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

            doc = report.report_dict(stats, run_summary(opts, outcome, self.paths, stats))
            if opts.data_parallel and llm is not None:
                doc["data_parallel"] = llm.report_dict()
            self.paths.report_json.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        if opts.trace is not None and llm is not None:
            from pagedinfer.cli.blocks_view import save_trace

            save_trace(self.paths.trace, llm)
        where = str(self.paths.output) if self.paths.output is not None else "stdout"
        summary(outcome, where, stats, self.out, self.on_disk_words())
        if outcome.write_error is not None:
            left = outcome.not_run()
            tail = "; make room and run again with --resume" if isinstance(self.output, OutputFile) else ""
            say(
                self.err,
                f"[bold red]{'stopped' if outcome.closed else 'error'}:[/] {escape(outcome.write_error)}; "
                f"{self.on_disk_words()}" + (f", {outcome.not_run_words()}" if left else "") + tail,
            )


def _progress_mode(opts: RunOptions, err: Console) -> str:
    """--progress: auto is a bar on a terminal, the log elsewhere, nothing with --quiet."""
    if opts.progress != "auto":
        return opts.progress
    return "none" if opts.quiet else "bar" if err.is_terminal else "log"
