#!/usr/bin/env python
"""Peak RSS and time to the first output line of ``pagedinfer run`` on 2k, 20k and 200k short lines.

Each size runs the real command line in a fresh process (``python -m pagedinfer run``); its peak
RSS is that process's own ``ru_maxrss`` (from ``os.wait4``), and the time to the first line is
when the output file first holds a full line (polled every 5 ms). Lines are short token-id prompts
(``max_tokens`` 1, greedy); with ``--runnable-every K`` only every K-th line can run and the others
fail the model's vocabulary check after it loads (they still go through the streaming reader, the
resume keys, the error records and the final reorder), which keeps a 200k-line run short on a slow
machine. Not a timed test: compare figures of one run only::

    python scripts/bench_batch_memory.py                      # 2k, 20k, 200k; every line generates
    python scripts/bench_batch_memory.py --runnable-every 1000 --model DIR
    python scripts/bench_batch_memory.py --stop-at-first-line  # every line runnable, stopped early
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Measure:
    lines: int
    exit_code: int
    peak_rss_mb: float
    first_line_s: float | None  # from the process start to the first full line on disk
    wall_s: float


def write_input(path: Path, lines: int, runnable_every: int = 1, bad_token: int = 10**6) -> Path:
    """``lines`` short token-id lines; all but every ``runnable_every``-th use a token id beyond any vocabulary."""
    with open(path, "w", encoding="utf-8") as f:
        for i in range(lines):
            token = 5 + i % 50 if i % runnable_every == 0 else bad_token
            f.write(json.dumps({"prompt_token_ids": [token, 6], "max_tokens": 1, "temperature": 0}) + "\n")
    return path


def measure(
    prompts: Path, output: Path, args: list[str], timeout: float = 3600, stop_at_first_line: bool = False
) -> Measure:
    """Run ``pagedinfer run PROMPTS -o OUTPUT ARGS`` in a fresh process; its peak RSS and first-line time.

    ``stop_at_first_line``: send SIGTERM once the first line is on disk (the run then finishes its
    step and exits 143), to time the first line of a run too long to finish here.
    """
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable,
        "-m",
        "pagedinfer",
        "run",
        str(prompts),
        "-o",
        str(output),
        "-q",
        "--no-report",
        *args,
    ]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    first = None
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if first is None and output.exists() and b"\n" in _head(output):
            first = time.perf_counter() - start
            if stop_at_first_line:
                proc.send_signal(signal.SIGTERM)
        if time.perf_counter() - start > timeout:
            proc.kill()
        time.sleep(0.005)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode not in (0, 1, 143 if stop_at_first_line else 0):
        raise RuntimeError(f"pagedinfer run exited {proc.returncode}: {proc.stderr.read().decode()[-2000:]}")
    return Measure(_count(prompts), proc.returncode, usage.ru_maxrss / 1024, first, wall)


def _head(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(4096)


def _count(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for _ in f)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2000,20000,200000", help="line counts, comma-separated")
    parser.add_argument("--runnable-every", type=int, default=1, help="only every K-th line can run")
    parser.add_argument("--model", default=None, help="model directory (default: the demo model)")
    parser.add_argument("--dir", default=None, help="work directory (default: a temporary one in /dev/shm)")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    parser.add_argument(
        "--stop-at-first-line",
        action="store_true",
        help="SIGTERM each run once its first line is on disk (time to first line of long runs)",
    )
    opts = parser.parse_args(argv)
    base = (
        Path(opts.dir)
        if opts.dir
        else Path(tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    )
    extra = ["--device", "cpu"] + (["--model", opts.model] if opts.model else [])
    rows = []
    print(f"{'lines':>8} {'exit':>4} {'peak RSS MB':>12} {'first line s':>13} {'wall s':>8}")
    for size in (int(s) for s in opts.sizes.split(",")):
        prompts = write_input(base / f"in-{size}.jsonl", size, opts.runnable_every)
        m = measure(prompts, base / f"out-{size}.jsonl", extra, stop_at_first_line=opts.stop_at_first_line)
        first = f"{m.first_line_s:.2f}" if m.first_line_s is not None else "-"
        print(
            f"{m.lines:>8} {m.exit_code:>4} {m.peak_rss_mb:>12.1f} {first:>13} {m.wall_s:>8.1f}", flush=True
        )
        rows.append(m.__dict__)
    if opts.json:
        Path(opts.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
