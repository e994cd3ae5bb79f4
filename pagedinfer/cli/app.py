"""The ``pagedinfer`` command line: ``run`` a prompts file, draw the KV ``blocks``, ``--version``.

Exit codes of ``run`` (docs/cli.md): 0 all lines succeeded, 1 some lines failed, 2 unusable
invocation (or the output is locked by another run), 74 the output could not be written (disk
full), 130 / 143 / 129 stopped by SIGINT / SIGTERM / SIGHUP (finished lines are on disk;
``--resume`` completes the rest).

The options of ``run`` and ``bench`` are made from the settings' declarations (`config`, `RunOptions`,
`BenchOptions`; `cli.options`): none is written here.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from pagedinfer.bench.options import BenchOptions
from pagedinfer.cli.help import HelpCommand, HelpGroup
from pagedinfer.cli.options import OptionError, build, declared, given, offering
from pagedinfer.cli.run_options import RunOptions, UsageError, from_command_line
from pagedinfer.config import LINE_DEFAULTS, EngineConfig, ModelConfig, settings
from pagedinfer.errors import first_line
from pagedinfer.terminal import note, say

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


@app.command(cls=HelpCommand)
@offering(LINE_DEFAULTS, settings(RunOptions), settings(ModelConfig), settings(EngineConfig))
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
    **values,
) -> None:
    """Generate for every line of PROMPTS.jsonl; write one output line per input line, in input order.

    Each line is written the moment it finishes (the file is put in input order at the end); bad
    lines get an error record naming the line and the reason, and the other lines still run.
    The output is locked for the run. Exit code: 0 all lines succeeded, 1 some failed, 2 unusable
    invocation, 74 the output could not be written, 130/143/129 stopped by SIGINT/SIGTERM/SIGHUP
    (SIGTERM and SIGHUP act like Ctrl-C). See docs/cli.md.
    """
    try:
        from pagedinfer.cli.run import execute
    except KeyboardInterrupt:
        _interrupted_at_start()

    try:
        opts = from_command_line(prompts, given(run, ctx, values))
    except (OptionError, UsageError) as e:
        _usage_error(str(e))
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
        from pagedinfer.hf_logging import quiet_transformers
        from pagedinfer.model.loader import ModelLoadError

        quiet_transformers()
        try:
            doc = blocks_view.builtin_trace(model, block_size, prompt_tokens, n, max_tokens, num_blocks)
        except (ModelLoadError, ValueError) as e:
            _usage_error(first_line(e), err)
        title = (
            f"built-in example: one {prompt_tokens}-token prompt, n={n} completions of {max_tokens} tokens, "
            f"block size {block_size}, {num_blocks} blocks"
        )
    say(console, f"[bold]{escape(title)}[/]")
    blocks_view.render(doc, console, max_steps)


@app.command(cls=HelpCommand)
@offering(declared(BenchOptions))
def bench(ctx: typer.Context, **values) -> None:
    """Throughput: pagedinfer vs transformers generate and generate_batch, same prompts and model.

    Prints one table per workload and dtype (method: docs/bench.md).
    """
    import os

    from pagedinfer.bench.runner import run_bench

    def names(text: str | None) -> tuple[str, ...] | None:
        return None if text is None else tuple(x.strip() for x in text.split(",") if x.strip())

    values = given(bench, ctx, values)
    if values["device"] == "auto":
        _usage_error("--device: choose cpu or cuda")
    default = "G1,G2" if values["device"] == "cuda" else "W0,W1,W2"
    opts = build(
        BenchOptions,
        values,
        workloads=names(values["workloads"] or default) or (),
        systems=names(values["systems"]),
        dtypes=names(values["dtypes"]),
        threads=values["threads"] or os.cpu_count() or 1,
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


def _interrupted_at_start() -> None:
    note("pagedinfer: interrupted while starting; nothing was run or written")
    raise typer.Exit(130)


def _usage_error(message: str, err: Console | None = None) -> None:
    say(err or Console(file=sys.stderr), f"[bold red]error:[/] {escape(message)}")
    raise typer.Exit(2)


if __name__ == "__main__":  # pragma: no cover
    app()
