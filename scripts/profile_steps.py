#!/usr/bin/env python
"""Where every engine step of a prompt-heavy run goes: GEMMs (and their rate), prompt attention, the
K/V copy into blocks, decode attention, sampling, and the rest (Python, metadata, norms, RoPE).

    python scripts/profile_steps.py MODEL_DIR [--dtype float32] [--prompts 64] [--prompt-len 128]
        [--max-new 64] [--workload NAME] [--max-num-batched-tokens 4096] [--threads 2] [--runs 1]

The default run is workload C of scripts/bench_llamacpp.py (64 random 128-token prompts, 64 greedy
new tokens each); ``--workload`` runs one of scripts/bench_peers.py's instead (A-D, b1, W1, W3: the
same prompts, n, temperature and seed as there). Every engine step is timed whole
(``LLMEngine.step``), and inside it: each linear's call (``PackedLinear`` / ``nn.Linear``, lm_head
included; its FLOPs 2 x rows x in x out, so the step's GEMM rate), the GEMMs the one-call C decode
step clocks itself, attention (the C kernel's call for every row of the step, or, without the
kernel, SDPA over each chunk's rows: prompt attention in a step with prompt tokens, decode attention
in a decode-only step), the K/V writes (``paged_decode.store_kv``) and the sampler. The
2048^3 GEMM rate of float32 and bfloat16 is measured first in the same process, for the GEMM rate
to be read against. Prints one row per prompt step, one for the decode steps together, and the
totals, then the run's bound: its GEMM FLOPs at the FMA peak (``--fma-peak``; default the 2048^3
rate of the run's dtype) plus the bytes it must read at the read rate (``--read-rate``; default a
stream-sum of 512 MB): every linear's weights once per forward pass and, per step, the K/V of every
block the step's sequences attend over, each block once however many sequences share it.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections import defaultdict

import bench_peers  # beside this script: its workloads (--workload)

import pagedinfer  # noqa: F401 - before torch: its OpenMP spin count (pagedinfer/__init__.py) must precede libgomp's load

# isort: split
import torch
from torch import nn

from pagedinfer import LLM, SamplingParams
from pagedinfer.attention import portable_backend
from pagedinfer.bench.machine import measure_gemm, measure_read_rate
from pagedinfer.engine import llm_engine
from pagedinfer.kernels import paged_decode
from pagedinfer.model import decode_step
from pagedinfer.model.loader import ModelLoadError
from pagedinfer.model.packed_linear import PackedLinear

# the C step's clocks (decode_step.gemm_seconds) are built in only on request
os.environ["PAGEDINFER_CC_FLAGS"] = f"{os.environ.get('PAGEDINFER_CC_FLAGS', '')} {decode_step.TIMERS_FLAG}"

PARTS = ("gemm", "prompt_attention", "kv_store", "decode_attention", "sampler")


class Clocks:
    """Seconds per part within the current step, and the GEMMs' FLOPs."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.flops = 0

    def wrap(self, owner, name: str, part: str, flops=None) -> None:
        """Time every call of ``owner.name`` into ``part`` (and add ``flops(*args)``)."""
        fn = getattr(owner, name)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            self.seconds[part] += time.perf_counter() - t
            if flops is not None:
                self.flops += flops(*args)
            return out

        setattr(owner, name, timed)


def linear_flops(module, x: torch.Tensor) -> int:
    rows = x.numel() // module.in_features
    return 2 * rows * module.in_features * module.out_features


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument(
        "--dtype",
        default="float32",
        help="float32, bfloat16, int8 (float32, int8 weights), or auto (a GGUF's own types)",
    )
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument(
        "--workload",
        choices=bench_peers.WORKLOADS,
        help="one of scripts/bench_peers.py's workloads instead of the prompts above",
    )
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--runs",
        type=int,
        default=1,
        help="run the prompts this many times in the process and profile the last (a first run also "
        "faults in the K/V pool's pages: its K/V store and attention carry that)",
    )
    ap.add_argument("--fma-peak", type=float, help="GFLOP/s of the bound (default: the 2048^3 GEMM rate)")
    ap.add_argument("--read-rate", type=float, help="GB/s of the bound (default: a stream-sum of 512 MB)")
    args = ap.parse_args()
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    torch.set_num_threads(args.threads)
    rates = {d: measure_gemm(2048, d).flops / 1e9 for d in ("float32", "bfloat16")}
    read_rate = args.read_rate or measure_read_rate()
    print(
        f"2048^3 GEMM: float32 {rates['float32']:.1f} GFLOP/s, bfloat16 {rates['bfloat16']:.1f} GFLOP/s; "
        f"read rate {read_rate:.1f} GB/s"
    )
    dtype, quantization = ("float32", "int8") if args.dtype == "int8" else (args.dtype, None)
    try:
        llm = LLM(
            args.model,
            device="cpu",
            dtype=dtype,
            quantization=quantization,
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
    except ModelLoadError as e:
        sys.exit(f"error: {e}")
    clocks = Clocks()
    clocks.wrap(PackedLinear, "forward", "gemm", linear_flops)
    clocks.wrap(nn.Linear, "forward", "gemm", linear_flops)
    clocks.wrap(portable_backend.PortablePlan, "_chunks_sdpa", "attention")
    clocks.wrap(portable_backend.PortablePlan, "_decode_kernel", "attention")
    clocks.wrap(paged_decode, "store_kv", "kv_store")
    clocks.wrap(llm_engine, "sample", "sampler")
    engine = llm.engine
    # the decoder layers' weights (packed panels hold them outside parameters()): the one-call step's
    # GEMMs multiply each once per row
    layer_weights = sum(
        m.in_features * m.out_features
        for m in engine.loaded.model.layers.modules()
        if isinstance(m, (PackedLinear, nn.Linear))
    )
    # every linear's weight bytes, read once per forward pass (lm_head included)
    weight_bytes = sum(
        sum(seg.nbytes for seg in m.segments) if isinstance(m, PackedLinear) else m.weight.nbytes
        for m in engine.loaded.model.modules()
        if isinstance(m, (PackedLinear, nn.Linear))
    )
    block_size, kv_token_bytes = engine.kv.block_size, engine.kv.bytes_per_token
    steps: list[dict] = []
    step = engine.step

    def timed_step():
        clocks.seconds.clear()
        clocks.flops = 0
        decode_step.gemm_seconds(), decode_step.attention_seconds()  # reset the C step's clocks
        plan_tokens = []
        filled: dict[int, int] = {}  # block id -> slots of it the step's attention reads
        schedule = engine.scheduler.schedule

        def recording_schedule():
            plan = schedule()
            plan_tokens.extend(s.num_tokens for s in plan.batch)
            for s in plan.batch:
                context = s.start + s.num_tokens
                for table in s.seq.block_tables:
                    for b, block in enumerate(table[: -(-context // block_size)]):
                        filled[block] = max(filled.get(block, 0), min(block_size, context - b * block_size))
            return plan

        engine.scheduler.schedule = recording_schedule
        t = time.perf_counter()
        try:
            return step()
        finally:
            wall = time.perf_counter() - t
            engine.scheduler.schedule = schedule
            c_gemm, c_attention = decode_step.gemm_seconds(), decode_step.attention_seconds()
            rec = {p: clocks.seconds[p] for p in PARTS}
            prompt_step = any(n > 1 for n in plan_tokens)
            rec["prompt_attention" if prompt_step else "decode_attention"] += clocks.seconds["attention"]
            rec["gemm"] += c_gemm
            rec["decode_attention"] += c_attention
            rows = len(plan_tokens)
            if c_gemm:  # the one-call step: every layer's GEMMs at ``rows`` rows, lm_head timed apart
                clocks.flops += 2 * rows * layer_weights
            rec |= {
                "wall": wall,
                "flops": clocks.flops,
                "prompt_tokens": sum(n for n in plan_tokens if n > 1),
                "decode_rows": sum(1 for n in plan_tokens if n == 1),
                "kv_bytes": sum(filled.values()) * kv_token_bytes,
            }
            steps.append(rec)

    engine.step = timed_step
    rng = random.Random(0)
    vocab = llm.engine.loaded.model.get_input_embeddings().num_embeddings
    prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts + 2)]
    params = SamplingParams(temperature=0, max_tokens=args.max_new, ignore_eos=True)
    warm, prompts = prompts[:2], prompts[2:]  # warm-up prompts of their own: no prefix-cache hits later
    llm.generate([{"prompt_token_ids": p} for p in warm], params, use_tqdm=False)
    if args.workload:
        w = bench_peers.make_workloads(vocab, (args.workload,), quick=False)[0]
        prompts = w["prompts"]
        params = [
            SamplingParams(
                n=w["n"], temperature=w["temperature"], max_tokens=m, ignore_eos=True, seed=w["seed"]
            )
            for m in w["max_tokens"]
        ]
    walls, cpu_s = [], 0.0
    for _ in range(args.runs):  # the table is the last run's; earlier ones fault the pool's pages in
        llm.reset_prefix_cache()
        steps.clear()
        t, c = time.perf_counter(), time.process_time()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        walls.append(time.perf_counter() - t)
        cpu_s = time.process_time() - c
    rate = rates["bfloat16" if dtype == "bfloat16" else "float32"]
    print(
        "| step | prompt tokens | decode rows | wall ms | GEMM ms | GEMM GFLOP/s (of 2048^3) | prompt attention ms "
        "| K/V store ms | decode attention ms | sampler ms | rest ms |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    prompt_steps = [(i, s) for i, s in enumerate(steps) if s["prompt_tokens"]]
    decode_steps = [s for s in steps if not s["prompt_tokens"]]
    rows = [(str(i), [s]) for i, s in prompt_steps] + [(f"{len(decode_steps)} decode steps", decode_steps)]
    rows.append(("all", steps))
    for label, group in rows:
        if not group:
            continue
        tot = {k: sum(s[k] for s in group) for k in (*PARTS, "wall", "flops", "prompt_tokens", "decode_rows")}
        rest = tot["wall"] - sum(tot[p] for p in PARTS)
        gflops = tot["flops"] / tot["gemm"] / 1e9 if tot["gemm"] else 0.0
        print(
            f"| {label} | {tot['prompt_tokens']} | {tot['decode_rows']} | {tot['wall'] * 1e3:.1f} "
            f"| {tot['gemm'] * 1e3:.1f} | {gflops:.1f} ({gflops / rate:.0%}) | {tot['prompt_attention'] * 1e3:.1f} "
            f"| {tot['kv_store'] * 1e3:.1f} | {tot['decode_attention'] * 1e3:.1f} | {tot['sampler'] * 1e3:.1f} "
            f"| {rest * 1e3:.1f} |"
        )
    runs = ", ".join(f"{w:.2f}" for w in walls)
    print(
        f"generate: {walls[-1]:.2f} s wall, {cpu_s:.2f} CPU s on {args.threads} threads, {len(steps)} steps"
        + (f" (runs: {runs} s)" if len(walls) > 1 else "")
    )
    peak = args.fma_peak or rate
    flops, kv_bytes = sum(s["flops"] for s in steps), sum(s["kv_bytes"] for s in steps)
    compute_s = flops / (peak * 1e9)
    read_s = (len(steps) * weight_bytes + kv_bytes) / (read_rate * 1e9)
    bound = compute_s + read_s
    print(
        f"bound: {flops / 1e9:.1f} GFLOP at {peak:.1f} GFLOP/s = {compute_s:.2f} s, plus {len(steps)} passes x "
        f"{weight_bytes / 1e6:.1f} MB of weights and {kv_bytes / 1e6:.1f} MB of K/V at {read_rate:.1f} GB/s = "
        f"{read_s:.2f} s: {bound:.2f} s; the run's wall {walls[-1] / bound:.2f}x the bound, its CPU seconds "
        f"per thread {cpu_s / args.threads / bound:.2f}x (a shared machine: pass --fma-peak and --read-rate "
        "measured in CPU time, e.g. scripts/bench_gemm.py --cpu-time)"
    )


if __name__ == "__main__":
    main()
