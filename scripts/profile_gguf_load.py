#!/usr/bin/env python
"""Where a GGUF model's load goes inside the process, after the imports: the figure to set beside
llama.cpp's load of the same file (its in-process load: the file mapped, the tensors and the
vocabulary ready), apart from the import floor every Python process using torch pays.

    python scripts/profile_gguf_load.py FILE.gguf [--runs 5] [--fresh-cache]

Times the imports (torch, then the loader), then ``load_model(FILE)`` ``--runs`` times in this process,
each split into its phases: opening the file (its digest, the cache folder: filled on a first load),
the config, the tensor checks, the kernels' cache check, reading the panel cache, reading the
tensors, building the model (packing the blocks into panels, or taking them from the panel cache),
the probe step, the tokenizer, and the rest; then the load's wall seconds, and its CPU seconds (every
thread of the process: on a busy machine the wall time grows, the CPU time far less). A phase an
older checkout lacks shows 0 (run it with ``PYTHONPATH=OLD`` to profile that checkout).
``--fresh-cache`` points ``PAGEDINFER_GGUF_CACHE`` at an empty temporary folder, so the first load is
a first load (it fills the cache); otherwise the user's cache serves them all. Prints one row per
load (seconds) and the median of the loads after the first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

PHASES = (
    ("open", "pagedinfer.model.loader", "_open_gguf"),
    ("config", "pagedinfer.model.own_config", "read"),
    ("checks", "pagedinfer.model.validate", "check_tensors"),
    ("kernels", "pagedinfer.kernels.build", "prebuild"),
    ("panels", "pagedinfer.model.loader", "_panel_cache"),  # the panel cache read (where there is one)
    ("tensors", "pagedinfer.model.gguf", "state_dict"),
    ("model", "pagedinfer.model.llama", "from_gguf"),
    ("probe", "pagedinfer.model.loader", "probe_layers"),
    ("tokenizer", "pagedinfer.model.loader", "_load_tokenizer"),
)


def clock(seconds: dict[str, float], owner, attr: str, phase: str) -> None:
    """Replace ``owner.attr`` by a wrapper adding each call's seconds to ``seconds[phase]``."""
    inner = getattr(owner, attr)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            seconds[phase] += time.perf_counter() - start

    setattr(owner, attr, timed)


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def cpu_name() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name:")), "?")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("gguf", type=Path)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument(
        "--fresh-cache", action="store_true", help="an empty GGUF cache: the first load fills it"
    )
    args = parser.parse_args()
    tmp = tempfile.TemporaryDirectory() if args.fresh_cache else None
    if tmp is not None:
        os.environ["PAGEDINFER_GGUF_CACHE"] = tmp.name
    start = time.perf_counter()
    import pagedinfer  # noqa: F401 - before torch, as the CLI imports it (its OpenMP settings)

    # isort: split
    import torch  # noqa: F401

    imported_torch = time.perf_counter()
    import importlib

    from pagedinfer.model import loader

    imported = time.perf_counter()
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores; load average {load_average()}")
    print(f"imports: torch {imported_torch - start:.2f} s, the loader {imported - imported_torch:.2f} s")
    seconds: dict[str, float] = defaultdict(float)
    for phase, module, attr in PHASES:
        owner = importlib.import_module(module)
        if hasattr(owner, attr):  # (an older checkout may lack a phase)
            clock(seconds, owner, attr, phase)
    names = [p for p, _, _ in PHASES] + ["other", "total", "cpu"]
    print(f"{'load':5s} " + " ".join(f"{n:>9s}" for n in names))
    rows = []
    for run in range(args.runs):
        seconds.clear()
        begin, cpu = time.perf_counter(), time.process_time()
        loaded = loader.load_model(str(args.gguf))
        total, cpu = time.perf_counter() - begin, time.process_time() - cpu
        del loaded
        row = [seconds[p] for p, _, _ in PHASES]
        row += [total - sum(row), total, cpu]
        rows.append(row)
        print(f"{run + 1:<5d} " + " ".join(f"{v:9.3f}" for v in row), flush=True)
    if len(rows) > 1:
        med = [statistics.median(col) for col in zip(*rows[1:], strict=True)]
        print(f"{'med':5s} " + " ".join(f"{v:9.3f}" for v in med) + "   (loads 2-)")
    print(f"load average after: {load_average()}")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
