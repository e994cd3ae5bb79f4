"""The command line: `pagedinfer run` (JSONL in, JSONL out, the memory report), `blocks`, `bench`.

`main` is the console script and `python -m pagedinfer`: it starts the Typer `app`.
"""

import sys


def main() -> None:
    """Start the command line; a Ctrl-C while the libraries load exits 130 with one line."""
    try:
        from pagedinfer.cli.app import app
    except KeyboardInterrupt:
        from pagedinfer.terminal import note

        note("pagedinfer: interrupted while starting; nothing was run or written")
        sys.exit(130)
    app(prog_name="pagedinfer")
