#!/usr/bin/env python
"""Where a benchmark workload's time goes, op by op (torch.profiler), for pagedinfer alone.

    python scripts/profile_ops.py --workload W1 --model-cache /tmp/mc --threads 2

Sets pagedinfer up exactly as `pagedinfer bench` does (untimed warm-up included), then runs the
whole workload under ``torch.profiler`` and prints the wall time and the ops by self CPU time. Our C decode kernel runs through ctypes and so is not an op:
its time is the wall time the table does not account for (with the interpreter's).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from pagedinfer.bench import MODELS, WORKLOADS, PagedinferRunner, build_model, default_args, make_job


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="W1", choices=sorted(WORKLOADS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model-cache", type=Path, help="directory where the random models are saved once")
    ap.add_argument("--rows", type=int, default=25, help="ops to print")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    w = WORKLOADS[args.workload]
    model_dir, _ = build_model(w.model, args.model_cache or Path(tempfile.mkdtemp()))
    job = make_job(w, default_args(threads=args.threads), model_dir, MODELS[w.model]["vocab_size"])
    runner = PagedinferRunner(job)  # the benchmark's own setup, untimed warm-up included
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        runner.run()
        wall = time.perf_counter() - start
    print(f"{args.workload}: {wall:.2f} s wall under the profiler, {args.threads} threads")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
