"""Count the functions and files a line passes through from ``pagedinfer run`` to its output record.

Runs ``pagedinfer run`` in this process (the demo model) on a one-line and on a three-line input
under a profile hook; a function is on a line's path when it runs more often for three lines than
for one. Left out: the model's compute (``model/``, ``attention/``, the kernels), the scheduler and
block pool (``core/``), the report and progress rendering and the statistics, class bodies and
comprehensions: what is left is the glue a line travels through (CLI, input, intake, engine loop,
records, output); ``--all`` leaves no file out (every function of the package a line runs, the
model's compute, the scheduler and the report included). ``--verbose`` lists the functions.

    python scripts/line_path.py [--all] [--verbose]
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import tempfile
from pathlib import Path

LEFT_OUT = (
    "model/",
    "attention/",
    "core/",
    "cli/report.py",
    "cli/progress.py",
    "cli/blocks_view.py",
    "engine/stats.py",
)


def calls(lines: int, everything: bool = False) -> dict[tuple[str, str], int]:
    """Calls per package function during one ``pagedinfer run`` of ``lines`` lines (``everything``:
    no file left out)."""
    import pagedinfer
    from pagedinfer.cli.app import app

    package = str(Path(pagedinfer.__file__).resolve().parent)
    seen: dict[tuple[str, str], int] = {}

    def hook(frame, event, arg) -> None:
        code = frame.f_code
        if event != "call" or not code.co_filename.startswith(package):
            return
        rel = code.co_filename[len(package) + 1 :]
        if (
            (not everything and rel.startswith(LEFT_OUT))
            or code.co_name.startswith("<")
            or not code.co_flags & inspect.CO_OPTIMIZED
        ):
            return
        key = (rel, code.co_qualname)
        seen[key] = seen.get(key, 0) + 1

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "in.jsonl"
        rows = [{"id": f"l{i}", "prompt": "ROMEO:", "max_tokens": 4} for i in range(lines)]
        src.write_text("".join(json.dumps(r) + "\n" for r in rows))
        sys.setprofile(hook)
        try:
            app(["run", str(src), "-q", "--no-report"], standalone_mode=False)
        finally:
            sys.setprofile(None)
    return seen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--all", action="store_true", help="leave no file out")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    one, three = calls(1, args.all), calls(3, args.all)
    path = {k: v for k, v in three.items() if v > one.get(k, 0)}
    files = sorted({f for f, _ in path})
    print(f"a line's path: {len(path)} functions in {len(files)} files")
    if args.verbose:
        for (f, name), n in sorted(path.items()):
            print(f"  {f}:{name} ({one.get((f, name), 0)} -> {n} calls)")


if __name__ == "__main__":
    main()
