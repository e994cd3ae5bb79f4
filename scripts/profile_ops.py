#!/usr/bin/env python
"""Where a benchmark workload's time goes, for pagedinfer alone: op by op, or component by component.

    python scripts/profile_ops.py --workload W1 --model-cache /tmp/mc --threads 2
    python scripts/profile_ops.py --workload W1 --model-cache /tmp/mc --threads 2 --timers

Sets pagedinfer up exactly as `pagedinfer bench` does (untimed warm-up included), then runs the
whole workload once. By default under ``torch.profiler``, printing the ops by self CPU time (our C
decode kernel runs through ctypes and so is not an op: its time is the wall time the table does not
account for). With ``--timers``, wall-clock timers wrap the model's modules (by class, and each
linear by its attribute name), the attention kernel calls and the sampler instead: little overhead,
so the shares are those of a plain run; times are inclusive (a module's includes its children's).
"""

from __future__ import annotations

import argparse
import functools
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from pagedinfer.attention import interface as attention
from pagedinfer.bench.models import build_model
from pagedinfer.bench.pagedinfer_system import PagedinferSystem
from pagedinfer.bench.runner import BenchOptions, job_for, make_job
from pagedinfer.bench.workloads import WORKLOADS
from pagedinfer.engine import llm_engine as engine
from pagedinfer.kernels import paged_decode
from pagedinfer.model.packed_linear import PackedLinear


class Timers:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()

    def wrap(self, name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
                self.calls[name] += 1

        return timed

    def install(self, model: nn.Module) -> None:
        """Every module's forward (linears by attribute name, others by class), kernels, sampler."""
        for path, module in model.named_modules():
            if isinstance(module, (nn.Linear, PackedLinear)):
                name = f"linear {path.rsplit('.', 1)[-1]}"
            elif path and not isinstance(module, nn.ModuleList):
                name = type(module).__name__
            else:
                continue
            module.forward = self.wrap(name, module.forward)
        model.forward = self.wrap("model forward (all)", model.forward)
        paged_decode.paged_decode = self.wrap("C decode kernel", paged_decode.paged_decode)
        paged_decode.store_kv = self.wrap("C K/V write", paged_decode.store_kv)
        attention.PortablePlan.attend = self.wrap(
            "attention (K/V write + attend)", attention.PortablePlan.attend
        )
        engine.sample = self.wrap("sampler", engine.sample)

    def table(self, wall: float) -> str:
        rows = [f"{'component (inclusive)':34s} {'s':>8s} {'share':>6s} {'calls':>7s} {'us/call':>9s}"]
        for name, s in sorted(self.seconds.items(), key=lambda kv: -kv[1]):
            calls = self.calls[name]
            rows.append(f"{name:34s} {s:8.2f} {s / wall:6.1%} {calls:7d} {s / calls * 1e6:9.1f}")
        return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="W1", choices=sorted(WORKLOADS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model-cache", type=Path, help="directory where the random models are saved once")
    ap.add_argument("--rows", type=int, default=25, help="ops to print")
    ap.add_argument("--timers", action="store_true", help="component timers instead of torch.profiler")
    ap.add_argument(
        "--dtype", default=None, help="float32, bfloat16 or float16 (default: the workload's first)"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    w = WORKLOADS[args.workload]
    model = build_model(w.model, args.model_cache or Path(tempfile.mkdtemp()))
    job = make_job(w, BenchOptions(threads=args.threads), model, args.dtype or w.dtypes[0])
    runner = PagedinferSystem(
        job_for("pagedinfer", job, w)
    )  # the benchmark's setup, untimed warm-up included
    if args.timers:
        timers = Timers()
        timers.install(runner.llm.engine.loaded.model)
        start = time.perf_counter()
        runner.run()
        wall = time.perf_counter() - start
        print(f"{args.workload}: {wall:.2f} s wall with timers, {args.threads} threads")
        print(timers.table(wall))
        return
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        runner.run()
        wall = time.perf_counter() - start
    print(f"{args.workload}: {wall:.2f} s wall under the profiler, {args.threads} threads")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
