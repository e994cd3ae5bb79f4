"""The full GGUF fuzz run: thousands of structure-aware mutations of two tiny valid GGUF files, each
loaded and run in a worker process (tests/gguf_fuzz.py's `check`), with a per-file timeout.

Every file must be refused with one line naming it, or run with correct records. A worker that dies
(a signal), a check that raises (a traceback in the CLI) or one past the timeout is a failure; the
summary counts each outcome class and lists the refusals by their wording (numbers masked), the
failures with their mutations. Exit status 1 when anything failed.

    python scripts/fuzz_gguf.py --count 3000 --seed 0
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing
import os
import re
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import gguf_fuzz  # noqa: E402


def _init(cache: str) -> None:
    os.environ["PAGEDINFER_GGUF_CACHE"] = cache
    import torch
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - the notes the loader writes


def _run(path: str, case: gguf_fuzz.Case, base: gguf_fuzz.Base) -> tuple[str, str]:
    try:
        out = gguf_fuzz.check(Path(path), case, base)
    except gguf_fuzz.NonFiniteLogits as e:
        return "failure:non-finite-logits", str(e)
    except BaseException:  # noqa: BLE001 - reported as the failure it is
        return "failure", traceback.format_exc(limit=-3)
    return out.kind, out.detail


def _pattern(line: str, path: str) -> str:
    """A refusal's wording with the file and numbers masked: one class per kind of reason."""
    line = line.replace(path, "FILE").replace(Path(path).name, "FILE")
    line = re.sub(r"'[^']*'", "'…'", line)
    return re.sub(r"\d[\d,._e+-]*", "N", line)[:160]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds one file may take (default 60)")
    ap.add_argument("--keep", type=Path, help="copy the files that failed into this folder")
    ap.add_argument("--verbose", action="store_true", help="print each mutation before it runs")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pagedinfer-fuzz-"))
    ctx = multiprocessing.get_context("spawn")
    pool = cf.ProcessPoolExecutor(1, ctx, _init, (str(work / "cache"),))
    bases = gguf_fuzz.bases()
    for base in bases:
        path = work / f"base-{base.name}.gguf"
        path.write_bytes(gguf_fuzz.encode(base.layout)[0])
        kind, detail = pool.submit(_run, str(path), gguf_fuzz.Case("base", b""), base).result()
        if kind != "ran":
            print(f"the base {base.name} does not run: {detail}")
            return 1
        base.neutral_tokens = json.loads(detail)
    classes: Counter = Counter()
    refusals: Counter = Counter()
    failures: list[str] = []
    start = time.monotonic()
    for i, (base, case) in enumerate(gguf_fuzz.cases(args.count, args.seed, bases)):
        path = work / f"case-{i}.gguf"
        path.write_bytes(case.data)
        if args.verbose:
            print(i, base.name, case.name[:200], flush=True)
        try:
            kind, detail = pool.submit(_run, str(path), replace(case, data=b""), base).result(
                timeout=args.timeout
            )
        except cf.TimeoutError:
            kind, detail = "timeout", f"past {args.timeout:g} s"
        except cf.process.BrokenProcessPool:
            kind, detail = "signal", "the worker died"
        if kind in ("timeout", "signal"):
            for proc in list(getattr(pool, "_processes", {}).values()):
                proc.kill()
            pool.shutdown(wait=False, cancel_futures=True)
            pool = cf.ProcessPoolExecutor(1, ctx, _init, (str(work / "cache"),))
        label = f"{kind}{'-neutral' if case.neutral and kind == 'ran' else ''}"
        classes[label] += 1
        if kind == "refused":
            refusals[_pattern(detail, str(path))] += 1
        elif kind not in ("ran",):
            failures.append(f"case {i} [{base.name}] {case.name}: {kind}: {detail.strip()[-600:]}")
            if args.keep:
                args.keep.mkdir(parents=True, exist_ok=True)
                (args.keep / f"case-{i}-{base.name}.gguf").write_bytes(case.data)
        path.unlink()
        if (i + 1) % 250 == 0:
            print(f"{i + 1} files, {time.monotonic() - start:.0f} s: {dict(classes)}", flush=True)
    pool.shutdown()
    elapsed = time.monotonic() - start
    print(f"\n{args.count} files (seed {args.seed}) in {elapsed:.0f} s: {dict(sorted(classes.items()))}")
    print(f"\nrefusals by wording ({len(refusals)} kinds):")
    for pattern, n in refusals.most_common():
        print(f"{n:6}  {pattern}")
    if failures:
        print(f"\n{len(failures)} failures:")
        print("\n".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
