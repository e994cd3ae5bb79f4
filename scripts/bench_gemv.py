#!/usr/bin/env python
"""Few-row GEMV of kernels/cpu_gemm.c's panels against the machine's read rate, per weight kind and shape.

    python scripts/bench_gemv.py [--rows 1,2,4,6,8] [--threads 2] [--repeats 5] [--mb 256]
        [--paths f32,int8,int4,Q4_0,Q4_1,Q8_0,Q4_0+llama.cpp] [--shapes 576x576,576x1536,1536x576,576x49152]

First a stream-sum (torch's ``sum`` over a float32 tensor of ``--mb`` MB) gives the read rate. Then each
shape (in x out: SmolLM2-135M's attention, MLP and lm_head linears), in each path (scripts/bench_gemm.py's
``build``: float32 panels, ``--quantization`` int8 / int4, GGUF types, ``Q4_0+llama.cpp`` / ``Q8_0+llama.cpp``
under ``--matmul-numerics llama.cpp``), is one linear made of copies of
its panels (distinct memory, one segment each) filling at least ``--mb`` MB of that path's bytes, so
every weight comes from memory, and one call covers them all (no per-linear Python overhead). Printed:
microseconds per single linear, the GB/s of weight bytes streamed (against the read rate) and, at more
than one row, the cost against one row (6 rows costing 6x one row share nothing between rows). Set
PAGEDINFER_CC_FLAGS=-mno-avx512f (and a PAGEDINFER_CACHE of its own) for the AVX2 build. On a shared,
loaded machine ``--cpu-time`` (with ``--threads 1``) times the process's CPU time instead of the wall
clock, so the time the scheduler gives to others is not counted.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch
from bench_gemm import build
from torch import nn

from pagedinfer.bench.machine import measure_read_rate
from pagedinfer.model.packed_linear import PackedLinear

SHAPES = "576x576,576x1536,1536x576,576x49152"


def copies_of(lin: PackedLinear, mb: int) -> tuple[PackedLinear, int]:
    """One linear of copies of ``lin``'s segments (cloned: each copy its own memory) filling ``mb`` MB."""
    one = sum(s.nbytes for s in lin.segments)
    n = max(1, -(-mb * (1 << 20) // one))
    segs = [
        dataclasses.replace(s, panels=s.panels.clone(), scale=None if s.scale is None else s.scale.clone())
        for _ in range(n)
        for s in lin.segments
    ]
    return PackedLinear.from_segments(lin.in_features, lin.out_features * n, False, segs), n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,6,8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--mb", type=int, default=256, help="MB of weights per measurement (past the caches)")
    ap.add_argument("--paths", default="f32,int8,int4,Q4_0,Q4_1,Q8_0")
    ap.add_argument("--shapes", default=SHAPES, help="in x out, comma-separated")
    ap.add_argument(
        "--cpu-time", action="store_true", help="time CPU time, not the wall clock (a loaded machine)"
    )
    args = ap.parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = [int(r) for r in args.rows.split(",")]
    rate = measure_read_rate(args.mb * 4, args.repeats, clock)
    print(f"read rate (sum of {args.mb * 4} MB float32, {args.threads} threads): {rate:.1f} GB/s")
    print(
        "| shape | path | B/weight | "
        + " | ".join(f"{r} row{'s' * (r > 1)} us (GB/s, x1)" for r in rows)
        + " |"
    )
    print("|---|---|---:|" + "---:|" * len(rows))
    with torch.inference_mode():
        for shape in args.shapes.split(","):
            k, n = map(int, shape.split("x"))
            lin = nn.Linear(k, n, bias=False)
            for path in args.paths.split(","):
                one = build(path, [lin])[0]
                big, copies = copies_of(one, args.mb)
                nbytes = sum(s.nbytes for s in big.segments)
                cells, first = [], None
                for r in rows:
                    x = torch.randn(r, k)  # [r, in]
                    big(x)
                    best = float("inf")
                    for _ in range(args.repeats):
                        t = clock()
                        big(x)
                        best = min(best, clock() - t)
                    first = first or best
                    cells.append(f"{best / copies * 1e6:.1f} ({nbytes / best / 1e9:.1f}, {best / first:.2f})")
                print(
                    f"| {shape} | {path} | {nbytes / copies / (k * n):.3f} | " + " | ".join(cells) + " |",
                    flush=True,
                )
                del big


if __name__ == "__main__":
    main()
