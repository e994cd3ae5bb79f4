#!/usr/bin/env python
"""The CPU linears at decode sizes: oneDNN packed, MKL ``F.linear`` and kernels/cpu_gemv.c.

    python scripts/bench_gemv.py [--rows 1,2,4,8,16,64] [--threads 2] [--repeats 3]

A SmolLM2-135M-shaped stack of linears (30 layers of fused QKV, output, fused gate-up and down,
then the 49152-wide lm_head: 538 MB of float32) is run through once per measurement, so every
weight comes from memory as in a real decode step, not from a cache warmed by the previous call.
Prints ms per pass and the weight bytes streamed per second; compare within one run.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from pagedinfer.model.packed_linear import GEMV_MAX_ROWS, PackedLinear

# (in, out) of each linear: per layer QKV 576 -> 960, o 576 -> 576, gate-up 576 -> 3072, down 1536 -> 576
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)] * 30 + [(576, 49152)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8,16,64")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    linears = [PackedLinear(nn.Linear(k, n, bias=False), gemv=True) for k, n in SHAPES]
    if linears[0].weight is None:
        raise SystemExit("bench_gemv: kernels/cpu_gemv.c did not build here (is a C compiler on PATH?)")
    gb = sum(k * n * 4 for k, n in SHAPES) / 1e9
    paths = {
        "oneDNN packed": lambda lin, x: torch.ops.mkldnn._linear_pointwise(
            x, lin.packed, None, "none", [], ""
        ),
        "MKL F.linear": lambda lin, x: torch.nn.functional.linear(x, lin.weight),
        "cpu_gemv.c": lambda lin, x: lin(x),  # PackedLinear's own choice: the kernel up to GEMV_MAX_ROWS
    }
    print(f"{len(SHAPES)} linears, {gb * 1e3:.0f} MB float32, {args.threads} threads")
    print("| rows | " + " | ".join(f"{name} ms (GB/s)" for name in paths) + " |")
    print("|---:|" + "---:|" * len(paths))
    with torch.inference_mode():
        for _ in range(args.repeats):
            for rows in map(int, args.rows.split(",")):
                xs = {k: torch.randn(rows, k) for k in {k for k, _ in SHAPES}}  # [rows, in]
                cells = []
                for name, run in paths.items():
                    if name == "cpu_gemv.c" and rows > GEMV_MAX_ROWS:
                        cells.append("(oneDNN)")
                        continue
                    t = time.perf_counter()
                    for lin, (k, _) in zip(linears, SHAPES, strict=True):
                        run(lin, xs[k])
                    s = time.perf_counter() - t
                    cells.append(f"{s * 1e3:.1f} ({gb / s:.1f})")
                print(f"| {rows} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
