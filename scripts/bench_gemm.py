#!/usr/bin/env python
"""The CPU linears at every step size: oneDNN packed, MKL ``F.linear`` and kernels/cpu_gemm.c's panels
(float32: also its int8 panels, ``--quantization int8``).

    python scripts/bench_gemm.py [--rows 1,4,8,16,64,256,2048] [--threads 2] [--repeats 3] [--dtype bfloat16]

A SmolLM2-135M-shaped stack of linears (30 layers of fused QKV, output, fused gate-up and down,
then the 49152-wide lm_head: 538 MB of float32, 269 of bfloat16) is run through once per measurement, so every
weight comes from memory as in a real step, not from a cache warmed by the previous call. The
paths take turns within each repeat; the best repeat of each is printed, in ms per pass, with the
weight bytes streamed per second and the GFLOP/s. Compare within one run.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from pagedinfer.model.packed_linear import PackedLinear

# (in, out) of each linear: per layer QKV 576 -> 960, o 576 -> 576, gate-up 576 -> 3072, down 1536 -> 576
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)] * 30 + [(576, 49152)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,8,16,64,256,2048")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    plain = [nn.Linear(k, n, bias=False, dtype=dtype) for k, n in SHAPES]
    paths = {
        "oneDNN packed": [PackedLinear(lin, panels=False) for lin in plain],
        "MKL F.linear": plain,
        "cpu_gemm.c panels": [PackedLinear(lin, panels=True) for lin in plain],
    }
    if paths["cpu_gemm.c panels"][0].panels is None:
        raise SystemExit(f"bench_gemm: kernels/cpu_gemm.c has no {args.dtype} panel kernel here")
    size = torch.finfo(dtype).bits // 8
    weights = sum(k * n for k, n in SHAPES)
    bytes_per_weight = dict.fromkeys(paths, size)
    if dtype == torch.float32:  # and the same weights in int8 (--quantization int8)
        paths["cpu_gemm.c int8 panels"] = [PackedLinear(lin, panels=True, int8=True) for lin in plain]
        bytes_per_weight["cpu_gemm.c int8 panels"] = 1
    print(f"{len(SHAPES)} linears, {weights * size / 1e6:.0f} MB {args.dtype}, {args.threads} threads")
    print("| rows | " + " | ".join(f"{name} ms (GB/s, GFLOP/s)" for name in paths) + " |")
    print("|---:|" + "---:|" * len(paths))
    with torch.inference_mode():
        for rows in map(int, args.rows.split(",")):
            xs = {k: torch.randn(rows, k, dtype=dtype) for k in {k for k, _ in SHAPES}}  # [rows, in]
            best = dict.fromkeys(paths, float("inf"))
            for _ in range(args.repeats):
                for name, linears in paths.items():
                    t = time.perf_counter()
                    for lin, (k, _) in zip(linears, SHAPES, strict=True):
                        lin(xs[k])
                    best[name] = min(best[name], time.perf_counter() - t)
            gflop = weights * 2 * rows / 1e9
            cells = [
                f"{s * 1e3:.1f} ({weights * bytes_per_weight[n] / s / 1e9:.1f}, {gflop / s:.0f})"
                for n, s in best.items()
            ]
            print(f"| {rows} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
