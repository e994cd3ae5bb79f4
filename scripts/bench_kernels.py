"""Attention kernel microbenchmarks for the one GPU run (scripts/gpu_check.sh), with a CPU smoke mode.

Decode table: the paged decode kernel against torch's scaled_dot_product_attention over contiguous
K/V (no block table), for contexts 512/4096/16384, batch 1/16/256, head sizes 64/128, bf16 and fp16,
32 query / 8 KV heads, block 16, scattered blocks. Each row: both times, their ratio, the kernel's
K/V bytes per second as a fraction of a device-to-device copy measured in the same run, the
partitions the kernel chose, and the largest difference from SDPA. Shapes whose paged plus
contiguous K/V exceed the memory budget are skipped and listed. Then a sweep of
cuda_kernels.DECODE_BLOCKS_PER_SM on the headline shape (batch 64, context 4096, head 128, fp16).

Prefill/extend table: the paged prefill kernel against SDPA restricted to the flash backend (else the
first backend that runs, named in the row), causal with the chunk's queries at the end of the
context, on contiguous K/V, for chunks of 512 and 2048 new tokens over 0, 2048 and 8192 cached ones.

Few iterations per row (about 30 ms of calls) keep the whole run near a minute on an H200.
``--smoke`` runs tiny shapes on the CPU through the CUDA shim (pagedinfer.attention.cuda_on_cpu), so CI
checks that the script runs end to end; its times are not GPU figures.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedinfer.attention import cuda_kernels, cuda_on_cpu
from pagedinfer.attention.metadata import AttentionMetadata

GIB = 1 << 30
HEADS, KV_HEADS, BLOCK = 32, 8, 16
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TOLERANCE = 2e-2  # |kernel - SDPA| <= TOLERANCE * (1 + |SDPA|): two bf16 roundings of outputs up to ~4


@dataclass(frozen=True)
class Plan:
    """The shapes one run covers."""

    device: str
    contexts: tuple[int, ...]
    batches: tuple[int, ...]
    head_sizes: tuple[int, ...]
    memory_budget: int  # bytes of paged + contiguous K/V per row
    sweep: tuple[int, int, int, tuple[int, ...]]  # batch, context, head, DECODE_BLOCKS_PER_SM values
    chunks: tuple[int, ...]  # prefill: new tokens per sequence
    cached: tuple[int, ...]  # prefill: tokens already in the cache
    copy_bytes: int
    seconds_per_row: float  # calls per measurement: about this long, 3 to 20 of them


GPU = Plan("cuda", (512, 4096, 16384), (1, 16, 256), (64, 128), 40 * GIB, (64, 4096, 128, (1, 2, 4, 8, 16)),
           (512, 2048), (0, 2048, 8192), 2 * GIB, 0.03)  # fmt: skip
SMOKE = Plan("cpu", (40, 300), (1, 3), (64,), 3 << 20, (3, 300, 64, (0, 4)),
             (16, 40), (0, 50), 16 << 20, 0.0)  # fmt: skip


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def seconds_per_call(fn: Callable[[], object], plan: Plan) -> float:
    """Mean time per call of back-to-back calls (CUDA events on a GPU), after a warm-up call that
    also compiles the kernels; about plan.seconds_per_row of calls, 3 to 20 of them."""
    fn()
    sync(plan.device)
    start = time.perf_counter()
    fn()
    sync(plan.device)
    iters = max(3, min(20, int(plan.seconds_per_row / max(time.perf_counter() - start, 1e-9))))
    if plan.device != "cuda":
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) / iters
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / 1e3 / iters


def copy_bandwidth(plan: Plan) -> float:
    """Bytes per second of a device-to-device copy (read + write counted)."""
    src = torch.empty(plan.copy_bytes, dtype=torch.uint8, device=plan.device)
    dst = torch.empty_like(src)
    return 2 * plan.copy_bytes / seconds_per_call(lambda: dst.copy_(src), plan)


def paged_batch(k: torch.Tensor, v: torch.Tensor, q_len: int, block_tables: torch.Tensor | None = None):
    """Paged caches holding contiguous K/V ([B, kv_heads, ctx, D]) in scattered blocks, and metadata
    for q_len new tokens per sequence at the end of each context."""
    batch, kv_heads, ctx, head = k.shape
    blocks_per_seq = math.ceil(ctx / BLOCK)
    num_blocks = batch * blocks_per_seq
    if block_tables is None:
        block_tables = torch.randperm(num_blocks, device=k.device).view(batch, blocks_per_seq).int()
    caches = []
    for src in (k, v):
        cache = torch.empty(num_blocks, BLOCK, kv_heads, head, dtype=k.dtype, device=k.device)
        rows = cache.view(num_blocks * BLOCK, kv_heads, head)
        for b in range(batch):  # one sequence at a time: no batch-sized temporaries
            slots = (block_tables[b].long()[:, None] * BLOCK + torch.arange(BLOCK, device=k.device)).flatten()
            rows[slots[:ctx]] = src[b].transpose(0, 1)
        caches.append(cache)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(batch * q_len, dtype=torch.int64, device=k.device),  # unused by attention
        query_start_loc=torch.arange(batch + 1, device=k.device, dtype=torch.int32) * q_len,
        context_lens=torch.full((batch,), ctx, device=k.device, dtype=torch.int32),
        block_tables=block_tables,
        query_lens=[q_len] * batch,
        context_lens_host=[ctx] * batch,
        block_size=BLOCK,
        max_query_len=q_len,
        max_context_len=ctx,
    )
    return caches[0], caches[1], meta


def decode_row(plan: Plan, dtype: torch.dtype, head: int, batch: int, ctx: int, copy_bw: float) -> dict:
    """Times one decode shape; returns the row's figures."""
    dev = plan.device
    k = torch.randn(batch, KV_HEADS, ctx, head, device=dev, dtype=dtype)  # [B, Hkv, ctx, D]
    v = torch.randn_like(k)
    k_cache, v_cache, meta = paged_batch(k, v, 1)
    query = torch.randn(batch, HEADS, head, device=dev, dtype=dtype)  # [B, Hq, D]
    out = torch.empty_like(query)
    scale = head**-0.5
    t_kernel = seconds_per_call(
        lambda: cuda_kernels.paged_attention(out, query, k_cache, v_cache, meta, scale), plan
    )
    q = query.unsqueeze(2)  # [B, Hq, 1, D]
    sdpa = lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)  # noqa: E731
    t_sdpa = seconds_per_call(sdpa, plan)
    err, close = difference(out, sdpa().squeeze(2))
    partitions = cuda_kernels.decode_plan(HEADS, KV_HEADS, batch, ctx, query.device).partitions
    kv_bytes = 2 * k.numel() * k.element_size()
    return {
        "kernel": t_kernel,
        "sdpa": t_sdpa,
        "copy": kv_bytes / t_kernel / copy_bw,
        "parts": partitions,
        "err": err,
        "ok": close,
    }


def difference(out: torch.Tensor, reference: torch.Tensor) -> tuple[float, bool]:
    """(max |out - reference|, whether every element is within TOLERANCE)."""
    out, reference = out.float(), reference.float()
    return (out - reference).abs().max().item(), torch.allclose(
        out, reference, atol=TOLERANCE, rtol=TOLERANCE
    )


def decode_bytes(dtype: torch.dtype, head: int, batch: int, ctx: int) -> int:
    """Paged plus contiguous K and V of a decode row."""
    return 4 * batch * ctx * KV_HEADS * head * dtype.itemsize


def free(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()


def decode_table(plan: Plan, copy_bw: float) -> bool:
    """Prints the decode table; returns False if a row disagreed with SDPA."""
    print(f"\n## decode: {HEADS} query / {KV_HEADS} KV heads, block {BLOCK}, scattered blocks")
    print(
        "| dtype | head | batch | context | kernel us | SDPA us | kernel/SDPA | of copy BW | partitions | max err |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    ok, skipped = True, []
    for name, dtype in DTYPES.items():
        for head in plan.head_sizes:
            for batch in plan.batches:
                for ctx in plan.contexts:
                    need = decode_bytes(dtype, head, batch, ctx)
                    if need > plan.memory_budget:
                        skipped.append(
                            f"{name} head {head} batch {batch} context {ctx} ({need / GIB:.1f} GiB)"
                        )
                        continue
                    r = decode_row(plan, dtype, head, batch, ctx, copy_bw)
                    bad = not r["ok"]
                    ok &= not bad
                    print(
                        f"| {name} | {head} | {batch} | {ctx} | {r['kernel'] * 1e6:.1f} | {r['sdpa'] * 1e6:.1f} | "
                        f"{r['kernel'] / r['sdpa']:.2f}x | {r['copy']:.1%} | {r['parts']} | "
                        f"{r['err']:.1e}{' WRONG' if bad else ''} |"
                    )
                    free(plan.device)
    budget = f"{plan.memory_budget / GIB:.3g} GiB"
    print(f"skipped (paged + contiguous K/V over the {budget} budget): {'; '.join(skipped) or 'none'}")
    return ok


def sweep(plan: Plan, copy_bw: float) -> bool:
    """Decode time per DECODE_BLOCKS_PER_SM on one shape (fp16): where the partition choice's knob sits."""
    batch, ctx, head, values = plan.sweep
    print(f"\n## decode partition sweep: fp16, head {head}, batch {batch}, context {ctx}")
    print("| DECODE_BLOCKS_PER_SM | partitions | kernel us | kernel/SDPA | of copy BW | max err |")
    print("| --- | --- | --- | --- | --- | --- |")
    default, ok = cuda_kernels.DECODE_BLOCKS_PER_SM, True
    try:
        for value in values:
            cuda_kernels.DECODE_BLOCKS_PER_SM = value
            r = decode_row(plan, torch.float16, head, batch, ctx, copy_bw)
            ok &= r["ok"]
            print(
                f"| {value}{' (default)' if value == default else ''} | {r['parts']} | {r['kernel'] * 1e6:.1f} | "
                f"{r['kernel'] / r['sdpa']:.2f}x | {r['copy']:.1%} | {r['err']:.1e}{'' if r['ok'] else ' WRONG'} |"
            )
            free(plan.device)
    finally:
        cuda_kernels.DECODE_BLOCKS_PER_SM = default
    return ok


def sdpa_prefill(plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """(callable, backend name): causal SDPA with the queries at the end of the keys, on the flash
    backend when it takes this call (CUDA), else the first that does."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    mask = causal_lower_right(q.shape[2], k.shape[2])
    call = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # noqa: E731
    if plan.device != "cuda":
        return call, "default"
    for name, backend in (
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("efficient", SDPBackend.EFFICIENT_ATTENTION),
    ):
        with sdpa_kernel(backend):
            try:
                call()
            except RuntimeError:
                continue

        def run(b=backend):
            with sdpa_kernel(b):
                return call()

        return run, name
    return call, "default"


def prefill_row(plan: Plan, dtype: torch.dtype, head: int, chunk: int, cached: int) -> dict:
    """Times one sequence's chunk of new tokens over its cached ones; returns the row's figures."""
    ctx = cached + chunk
    k = torch.randn(1, KV_HEADS, ctx, head, device=plan.device, dtype=dtype)  # [1, Hkv, ctx, D]
    v = torch.randn_like(k)
    k_cache, v_cache, meta = paged_batch(k, v, chunk)
    q = torch.randn(1, HEADS, chunk, head, device=plan.device, dtype=dtype)  # [1, Hq, chunk, D]
    query = q[0].transpose(0, 1)  # [chunk, Hq, D], as the engine passes it
    out = torch.empty(chunk, HEADS, head, device=plan.device, dtype=dtype)  # [chunk, Hq, D]
    scale = head**-0.5
    t_kernel = seconds_per_call(
        lambda: cuda_kernels.paged_attention(out, query, k_cache, v_cache, meta, scale), plan
    )
    k_full, v_full = (x.repeat_interleave(HEADS // KV_HEADS, 1) for x in (k, v))  # [1, Hq, ctx, D]
    sdpa, backend = sdpa_prefill(plan, q, k_full, v_full, scale)
    t_sdpa = seconds_per_call(sdpa, plan)
    err, close = difference(out, sdpa()[0].transpose(0, 1))
    return {"kernel": t_kernel, "sdpa": t_sdpa, "backend": backend, "err": err, "ok": close}


def prefill_table(plan: Plan, dtype_name: str = "bf16") -> bool:
    """Prints the prefill/extend table (one sequence); returns False if a row disagreed with SDPA."""
    dtype, head = DTYPES[dtype_name], plan.head_sizes[-1]
    print(
        f"\n## prefill/extend: one sequence, {HEADS} query / {KV_HEADS} KV heads of {head}, {dtype_name}, "
        f"block {BLOCK}; SDPA on contiguous K/V (target: kernel/SDPA <= 1.3x)"
    )
    print("| new tokens | cached | kernel ms | SDPA ms | SDPA backend | kernel/SDPA | max err |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    ok = True
    for chunk in plan.chunks:
        for cached in plan.cached:
            r = prefill_row(plan, dtype, head, chunk, cached)
            bad = not r["ok"]
            ok &= not bad
            print(
                f"| {chunk} | {cached} | {r['kernel'] * 1e3:.2f} | {r['sdpa'] * 1e3:.2f} | {r['backend']} | "
                f"{r['kernel'] / r['sdpa']:.2f}x | {r['err']:.1e}{' WRONG' if bad else ''} |"
            )
            free(plan.device)
    return ok


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU through the CUDA shim")
    plan = SMOKE if parser.parse_args(argv).smoke else GPU
    if plan is SMOKE:
        cuda_kernels.set_raw_module_factory(cuda_on_cpu.RawModule)
        name = "CPU through the CUDA shim (smoke run: not GPU figures)"
    elif not cuda_kernels.is_available():
        sys.exit("bench_kernels: needs CuPy and a CUDA device (or --smoke)")
    else:
        props = torch.cuda.get_device_properties(0)
        name = f"{props.name}, {props.multi_processor_count} SMs"
    torch.manual_seed(0)
    start = time.perf_counter()
    copy_bw = copy_bandwidth(plan)
    print(f"device: {name}; torch {torch.__version__}")
    print(f"device-to-device copy: {copy_bw / 1e9:.1f} GB/s (read + write, {plan.copy_bytes / GIB:.3g} GiB)")
    ok = decode_table(plan, copy_bw)
    ok &= sweep(plan, copy_bw)
    ok &= prefill_table(plan)
    print(f"\nbench_kernels: {time.perf_counter() - start:.0f} s")
    if not ok:
        sys.exit(f"bench_kernels: a kernel disagreed with SDPA beyond {TOLERANCE} (rows marked WRONG)")


if __name__ == "__main__":
    main()
