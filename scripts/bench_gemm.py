#!/usr/bin/env python
"""The CPU linears at every step size: oneDNN packed, MKL ``F.linear`` and kernels/cpu_gemm.c's panels in
each weight format (float32, bfloat16, int8 / int4 weight-only, GGUF block types kept as stored).

    python scripts/bench_gemm.py [--rows 1,4,8,16,64,256,2048] [--threads 2] [--repeats 3]
        [--paths onednn,mkl,f32,int8,int4,Q4_1,Q8_0,...] [--dtype bfloat16] [--cpu-time] [--shape INxOUT]

A SmolLM2-135M-shaped stack of linears (30 layers of fused QKV, output, fused gate-up and down,
then the 49152-wide lm_head: 538 MB of float32) is run through once per measurement, so every
weight comes from memory as in a real step, not from a cache warmed by the previous call. The
paths take turns within each repeat; the best repeat of each is printed, in ms per pass, with the
weight bytes streamed per second (each path's own bytes) and the GFLOP/s. Compare within one run.
On a shared, loaded machine ``--cpu-time`` (with ``--threads 1``) times the process's CPU time.
``--shape INxOUT`` (e.g. ``576x1536``): copies of one plain linear of that shape in place of the stack,
as many as make 64 MB of float32 (at least one), so each still comes from memory: a row sweep per shape.
Quantized paths: ``int8``, ``int4`` (``int4-g128``, ``-zp``: `packed_linear.QUANTIZATIONS`), and
GGUF types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 quantized by gguf-py; Q4_K, Q5_K, Q6_K random blocks, with
llama-quantize's fallback types for the 576-wide linears: only the 1536-wide down projections are K-quants).
A quantized path followed by ``+llama.cpp`` (``int8+llama.cpp``, ``Q4_0+llama.cpp``) runs under
``--matmul-numerics llama.cpp`` (int8, int4 and Q4_0 / Q4_1 / Q8_0: activations quantized to int8).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from torch import nn

from pagedinfer.config import QUANTIZATIONS
from pagedinfer.model import gguf_blocks, panel_formats
from pagedinfer.model.fused_ops import GatedLinear
from pagedinfer.model.packed_linear import PackedLinear, use_llamacpp_numerics

# (in, out) of each linear: per layer QKV 576 -> 960, o 576 -> 576, gate-up 576 -> 3072, down 1536 -> 576
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)] * 30 + [(576, 49152)]


FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}  # llama-quantize's, for rows not of 256


def gguf_linear(lin: nn.Linear, kind: str) -> PackedLinear:
    """``lin``'s weight in GGUF type ``kind`` (K-quants: llama-quantize's fallback type where ``in`` is not a
    multiple of 256, as in SmolLM2's 576-wide linears), as the GGUF loader packs it."""
    import gguf

    w = lin.weight.detach().float().numpy()
    if kind in FALLBACK and w.shape[1] % 256:
        kind = FALLBACK[kind]
    if kind in ("Q4_K", "Q5_K", "Q6_K"):  # gguf-py has no quantizer for K-quants: random blocks, sane scales
        block, size = gguf_blocks.BLOCKS[kind]
        rng = np.random.default_rng(0)
        data = rng.integers(0, 256, (w.shape[0], w.shape[1] // block * size), dtype=np.uint8)
        b = data.reshape(-1, size)
        d = (rng.random(b.shape[0]) * 0.01).astype(np.float16).view(np.uint8).reshape(-1, 2)
        b[:, 208:210] = d if kind == "Q6_K" else b[:, 208:210]
        if kind != "Q6_K":
            b[:, 0:2], b[:, 2:4] = d, d
    else:
        data = gguf.quants.quantize(w, getattr(gguf.GGMLQuantizationType, kind))
    values, fields = gguf_blocks.split_blocks(kind, data, w.shape[1])
    gated = isinstance(lin, GatedLinear)
    records = panel_formats.pack_records(kind, values, fields, gated)
    cols = w.shape[0] // 2 if gated else w.shape[0]
    seg = panel_formats.Segment(
        kind,
        cols,
        torch.from_numpy(records),
        in_features=w.shape[1],
        gated_pairs=gated,
        bf16_io=lin.weight.dtype == torch.bfloat16,  # --dtype bfloat16: bfloat16 activations
    )
    return PackedLinear.from_segments(w.shape[1], w.shape[0], gated, [seg])


def build(path: str, plain: list[nn.Linear]) -> list:
    if path == "onednn":
        return [PackedLinear(lin, panels=False) for lin in plain]
    if path == "mkl":
        return plain
    if path in ("f32", "bf16"):
        return [PackedLinear(lin, panels=True) for lin in plain]
    kind, _, numerics = path.partition("+")  # Q4_0+llama.cpp, int8+llama.cpp: `--matmul-numerics llama.cpp`
    if kind in QUANTIZATIONS:
        linears = [  # under the run's activations (--dtype bfloat16: bfloat16)
            PackedLinear(lin, panels=True, quantization=QUANTIZATIONS[kind], activations=lin.weight.dtype)
            for lin in plain
        ]
    else:
        linears = [gguf_linear(lin, kind) for lin in plain]
    if numerics == "llama.cpp":
        use_llamacpp_numerics(nn.Sequential(*linears))
    return linears


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,8,16,64,256,2048")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--paths", help="default: onednn,mkl,f32,int8 (float32); onednn,mkl,bf16 (bfloat16)")
    ap.add_argument(
        "--cpu-time", action="store_true", help="time CPU time, not the wall clock (a loaded machine)"
    )
    ap.add_argument("--shape", help="INxOUT: copies of one linear of that shape in place of SmolLM2's stack")
    args = ap.parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    names = (args.paths or ("onednn,mkl,f32,int8" if dtype == torch.float32 else "onednn,mkl,bf16")).split(
        ","
    )
    shapes = SHAPES
    if args.shape:
        k, n = map(int, args.shape.split("x"))
        shapes = [(k, n)] * max(1, (64 << 20) // (k * n * 4))
    torch.manual_seed(0)
    # gate-up as a GatedLinear, as our layers hold it (paired panels, silu(gate) * up in the kernel)
    plain = [
        (GatedLinear if n == 3072 and not args.shape else nn.Linear)(k, n, bias=False, dtype=dtype)
        for k, n in shapes
    ]
    paths = {name: build(name, plain) for name in names}
    if "f32" in paths and paths["f32"][0].segments is None:
        raise SystemExit(f"bench_gemm: kernels/cpu_gemm.c has no {args.dtype} panel kernel here")
    weights = sum(k * n for k, n in shapes)
    size = torch.finfo(dtype).bits // 8
    bytes_of = {}
    for name, linears in paths.items():
        segs = [s for lin in linears for s in getattr(lin, "segments", None) or []]
        bytes_of[name] = sum(s.nbytes for s in segs) if segs else weights * size
    print(f"{len(shapes)} linears, {weights * size / 1e6:.0f} MB {args.dtype}, {args.threads} threads")
    print("bytes per weight: " + ", ".join(f"{n} {b / weights:.3f}" for n, b in bytes_of.items()))
    print("| rows | " + " | ".join(f"{name} ms (GB/s, GFLOP/s)" for name in paths) + " |")
    print("|---:|" + "---:|" * len(paths))
    with torch.inference_mode():
        for rows in map(int, args.rows.split(",")):
            xs = {k: torch.randn(rows, k, dtype=dtype) for k in {k for k, _ in shapes}}  # [rows, in]
            best = dict.fromkeys(paths, float("inf"))
            for _ in range(args.repeats):
                for name, linears in paths.items():
                    t = clock()
                    for lin, (k, _) in zip(linears, shapes, strict=True):
                        lin(xs[k])
                    best[name] = min(best[name], clock() - t)
            gflop = weights * 2 * rows / 1e9
            cells = [f"{s * 1e3:.1f} ({bytes_of[n] / s / 1e9:.1f}, {gflop / s:.0f})" for n, s in best.items()]
            print(f"| {rows} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
