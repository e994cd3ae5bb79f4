"""CPU attention kernel (kernels/cpu_paged_decode.c) against the machine's own limits.

Prints, per ISA build (``--isa native``, ``avx2`` or ``both``; avx2 is scripts/bench_isa.py's cap:
the kernels built with ``-mno-avx512f``, torch held to AVX2):

- the machine: memory read rate (a float32 sum over an array far past the caches, GB/s) and the FMA
  rate of a float32 2048^3 matmul (GFLOP/s, torch under the same cap): the references;
- prompt rows: every token of ``batch`` prompts of ``context`` tokens as a query row over its own
  prefix (how the engine runs a prefill through the kernel), in GFLOP/s (2 per multiply-add of
  q . k and p . v: 2 (D + Dv) heads per key and row);
- decode rows: one query token for each of ``batch`` sequences of ``context`` tokens, in GB/s of K/V
  read (each sequence's K and V rows, read once per step);
- with ``--draft-contexts``: a verification step's rows (speculative decoding), ``--draft-rows``
  consecutive positions of one sequence after ``context`` tokens (its blocks shared by the rows)
  against one row, and against as many rows of as many sequences (nothing shared).

SmolLM2-135M's attention shape by default (9 query heads, 3 KV heads, head size 64, block 16), blocks
scattered through the pool as a long run leaves them. Each figure is the best of ``--repeats`` timings
of about ``--seconds`` of calls each; with one thread (the default) the clock is the calling thread's
CPU time, which other processes on a loaded machine do not inflate (the kernel runs on that thread),
else wall time.

Usage: python scripts/bench_attention.py [--isa native|avx2|both] [--threads N] [--kv-dtype float32,float16]
    [--draft-contexts 384,1024 [--draft-rows 6]]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_isa  # noqa: E402

HEADS, KV_HEADS, HEAD, BLOCK = 9, 3, 64, 16


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--isa", choices=(*bench_isa.ISAS, "both"), default="both")
    p.add_argument("--threads", type=int, default=1, help="torch/OpenMP threads (default 1: per-core rates)")
    p.add_argument("--kv-dtype", default="float32,float16", help="K/V pool dtypes (float32 queries)")
    p.add_argument("--prompt-contexts", type=_ints, default=[128, 512, 2048])
    p.add_argument("--prompt-batches", type=_ints, default=[1, 4])
    p.add_argument("--decode-contexts", type=_ints, default=[128, 512, 2048])
    p.add_argument("--decode-batches", type=_ints, default=[1, 4, 16])
    p.add_argument(
        "--draft-contexts", type=_ints, default=[], help="contexts of the drafted rows (none: skipped)"
    )
    p.add_argument(
        "--draft-rows", type=int, default=6, help="rows of a verification step (1 + drafted tokens)"
    )
    p.add_argument(
        "--heads", type=_ints, default=[HEADS, KV_HEADS, HEAD], help="query heads, KV heads, head size"
    )
    p.add_argument("--seconds", type=float, default=0.3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-machine", action="store_true", help="skip the read-rate and FMA references")
    return p.parse_args(argv)


CLOCK = [time.perf_counter]  # run() picks the thread's CPU time for one thread


def best_seconds(fn, seconds: float, repeats: int) -> float:
    """The fastest per-call time over ``repeats`` timings of enough calls to last about ``seconds``."""
    clock = CLOCK[0]
    fn()
    start = clock()
    fn()
    once = max(clock() - start, 1e-6)
    calls = max(1, int(seconds / once))
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        for _ in range(calls):
            fn()
        best = min(best, (clock() - start) / calls)
    return best


def machine(a: argparse.Namespace) -> None:
    import torch

    x = torch.ones(1 << 27)  # 512 MiB of float32: far past any cache
    read = best_seconds(lambda: x.sum(), a.seconds, a.repeats)
    m = torch.randn(2048, 2048)
    mm = best_seconds(lambda: m @ m, a.seconds, a.repeats)
    print(f"  read rate (float32 sum of 512 MiB): {x.numel() * 4 / read / 1e9:.1f} GB/s")
    print(f"  FMA rate (float32 2048^3 matmul, torch): {2 * 2048**3 / mm / 1e9:.1f} GFLOP/s")


def batch(lens: list[int], tables_of: list[int], kv_dtype, heads: list[int], seed: int):
    """The kernel's arguments for query rows of context ``lens`` over sequence ``tables_of[i]``'s blocks:
    (q, k_cache, v_cache, tables, lens, rows), the pool's blocks in a random order."""
    import torch

    hq, kvh, d = heads
    g = torch.Generator().manual_seed(seed)
    seqs = max(tables_of) + 1
    need = [0] * seqs
    for n, s in zip(lens, tables_of, strict=True):
        need[s] = max(need[s], (n + BLOCK - 1) // BLOCK)
    max_blocks = max(need)
    order = torch.randperm(sum(need), generator=g).to(torch.int32)
    seq_tables = torch.zeros(seqs, max_blocks, dtype=torch.int32)
    at = 0
    for s in range(seqs):
        seq_tables[s, : need[s]] = order[at : at + need[s]]
        at += need[s]
    k = torch.randn(sum(need), BLOCK, kvh, d, generator=g).to(kv_dtype)
    v = torch.randn(sum(need), BLOCK, kvh, d, generator=g).to(kv_dtype)
    q = torch.randn(len(lens), hq, d, generator=g)
    tables = seq_tables[torch.tensor(tables_of)].contiguous()
    return q, k, v, tables, torch.tensor(lens, dtype=torch.int32), torch.arange(len(lens))


def kernel_seconds(lens, tables_of, kv_dtype, a: argparse.Namespace) -> float:
    import torch

    from pagedinfer.kernels import paged_decode

    q, k, v, tables, ctx, rows = batch(lens, tables_of, kv_dtype, a.heads, seed=len(lens))
    out = torch.empty(q.shape[0], q.shape[1], v.shape[3])
    bounds = paged_decode.split(lens, q.shape[1] * (q.shape[2] + v.shape[3]))
    scale = q.shape[2] ** -0.5
    return best_seconds(
        lambda: paged_decode.paged_decode(out, q, k, v, tables, ctx, rows, bounds, scale, 0, 0.0, None),
        a.seconds,
        a.repeats,
    )


def run(isa: str, a: argparse.Namespace) -> None:
    import torch

    from pagedinfer.kernels import paged_decode

    torch.set_num_threads(a.threads)
    CLOCK[0] = time.thread_time if a.threads == 1 else time.perf_counter
    clock = "thread CPU time" if a.threads == 1 else "wall time"
    print(bench_isa.machine_line(isa) + f"; {a.threads} thread(s), {clock}")
    if not a.no_machine:
        machine(a)
    hq, kvh, d = a.heads
    for name in a.kv_dtype.split(","):
        kv_dtype = getattr(torch, name)
        if not paged_decode.available(torch.float32, kv_dtype):
            print(f"  float32 over a {name} pool: no kernel instantiation here")
            continue
        size = torch.finfo(kv_dtype).bits // 8
        print(f"  float32 queries, {name} K/V, {hq}/{kvh} heads, head size {d}, block {BLOCK}")
        for n in a.prompt_contexts:
            for b in a.prompt_batches:
                lens = [t + 1 for _ in range(b) for t in range(n)]
                tables_of = [s for s in range(b) for _ in range(n)]
                sec = kernel_seconds(lens, tables_of, kv_dtype, a)
                flops = 2 * 2 * d * hq * sum(lens)
                print(
                    f"    prompt  context {n:5d} batch {b:3d}: {sec * 1e3:9.3f} ms  {flops / sec / 1e9:7.1f} GFLOP/s"
                )
        for n in a.decode_contexts:
            for b in a.decode_batches:
                sec = kernel_seconds([n] * b, list(range(b)), kv_dtype, a)
                read = 2 * b * n * kvh * d * size
                print(
                    f"    decode  context {n:5d} batch {b:3d}: {sec * 1e3:9.3f} ms  {read / sec / 1e9:7.1f} GB/s of K/V"
                )
        r = a.draft_rows
        for n in a.draft_contexts:
            lens = [n + 1 + i for i in range(r)]  # the rows' own contexts: consecutive positions
            one = kernel_seconds(lens[:1], [0], kv_dtype, a)
            same = kernel_seconds(lens, [0] * r, kv_dtype, a)
            apart = kernel_seconds(lens, list(range(r)), kv_dtype, a)
            print(
                f"    drafted context {n:5d}: 1 row {one * 1e3:.3f} ms, {r} rows of one sequence "
                f"{same * 1e3:.3f} ms ({same / one:.2f}x), of {r} sequences {apart * 1e3:.3f} ms ({apart / one:.2f}x)"
            )


def main() -> None:
    a = parse()
    if a.isa != "both" and os.environ.get("BENCH_ATTENTION_CHILD"):
        run(a.isa, a)
        return
    cache = Path(tempfile.gettempdir()) / "bench_attention"
    for isa in ("native", "avx2") if a.isa == "both" else (a.isa,):
        argv = [arg for arg in sys.argv[1:]]
        env = {**os.environ, **bench_isa.isa_env(isa, cache), "BENCH_ATTENTION_CHILD": "1"}
        cmd = [sys.executable, __file__, *argv, "--isa", isa]
        subprocess.run(cmd, env=env, check=True)


if __name__ == "__main__":
    main()
