"""The LoRA deltas of one decoder layer: kernels/cpu_lora.c against the torch GEMMs that computed them
before it, alternating in one process.

Shapes: SmolLM2-135M's four sites of a layer (the fused QKV 576 -> 960, o 576 -> 576, the fused
gate-up 576 -> 3072, down 1536 -> 576), rank 16, random weights. The torch path is the one the sites
ran before the kernel: ``y.addmm_(x @ A^T, scaling * B^T)`` with A and B in the activations' dtype.
Each row count and dtype: ``--rounds`` rounds of many calls of each path in turn, the best round of
each, in CPU time of the calling thread (``time.thread_time``: less swayed by other jobs on a shared
machine than the wall clock; meaningful with one thread, the default).

    python scripts/bench_lora_delta.py [--threads 1] [--rows 1,16,256] [--rounds 15]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from pagedinfer.lora import delta

SITES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}  # in, out
RANK, SCALING = 16, 2.0


def per_call(calls: list[Callable[[], object]], reps: int) -> float:
    """Seconds of the calling thread's CPU time for one pass over ``calls``, averaged over ``reps``."""
    start = time.thread_time()
    for _ in range(reps):
        for call in calls:
            call()
    return (time.thread_time() - start) / reps


def layer(rows: int, dtype: torch.dtype) -> tuple[list[Callable[[], object]], list[Callable[[], object]]]:
    """The four sites' deltas on ``rows`` rows: the torch path's calls and the kernel's."""
    torch_calls, kernel_calls = [], []
    for inputs, out in SITES.values():
        a_t, b_t = torch.zeros(inputs, delta.padded(RANK)), torch.zeros(RANK, delta.padded(out))
        a_t[:, :RANK], b_t[:, :out] = torch.randn(inputs, RANK) / 30, torch.randn(RANK, out) / 4
        w = delta.DeltaWeights(a_t, b_t, RANK, out, SCALING)
        x, y = torch.randn(rows, inputs).to(dtype), torch.randn(rows, out).to(dtype)
        a, b = a_t[:, :RANK].to(dtype).contiguous(), (b_t[:, :out] * SCALING).to(dtype).contiguous()
        torch_calls.append(lambda y=y, x=x, a=a, b=b: y.addmm_(x @ a, b))
        kernel_calls.append(lambda y=y, x=x, w=w: delta.add_delta(y, x, 0, rows, w))
    return torch_calls, kernel_calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,16,256")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    if delta.library() is None:
        raise SystemExit("the LoRA deltas' kernel did not build (is a C compiler installed?)")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"threads {args.threads}; microseconds of a layer's four sites (best of {args.rounds} rounds)")
    print(f"{'dtype':9} {'rows':>5} {'torch':>9} {'cpu_lora.c':>11} {'ratio':>6}")
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (int(r) for r in args.rows.split(",")):
            torch_calls, kernel_calls = layer(rows, dtype)
            reps = max(3, 1000 // rows)
            best_torch = best_kernel = float("inf")
            for _ in range(args.rounds):
                best_torch = min(best_torch, per_call(torch_calls, reps))
                best_kernel = min(best_kernel, per_call(kernel_calls, reps))
            print(
                f"{str(dtype).removeprefix('torch.'):9} {rows:5} {best_torch * 1e6:9.1f} "
                f"{best_kernel * 1e6:11.1f} {best_kernel / best_torch:6.2f}"
            )


if __name__ == "__main__":
    main()
