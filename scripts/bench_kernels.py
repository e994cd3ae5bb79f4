"""Decode attention microbenchmark for a GPU machine.

Reports the paged decode kernel's K/V bandwidth as a fraction of a device-to-device copy measured in
the same run (so the number is comparable across GPUs), and its time against torch's
scaled_dot_product_attention over contiguous K/V (which needs no block table).
Shape: batch 64, context 4096, 32 query / 8 KV heads, head 128, fp16, block 16. Then a sweep of the
decode kernel's two knobs (loads in flight per thread, keys per partition), each variant checked.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedinfer.attention import cuda_kernels
from pagedinfer.attention.metadata import AttentionMetadata

BATCH, CONTEXT, HEADS, KV_HEADS, HEAD, BLOCK = 64, 4096, 32, 8, 128, 16
DTYPE = torch.float16
DEVICE = "cuda"
LOADS_SWEEP = (2, 4, 8, 16)  # DECODE_LOADS_IN_FLIGHT (kernels/paged_attention.cu)
PARTITION_SWEEP = (256, 512, 1024)  # cuda_kernels.DECODE_PARTITION_SIZE


def seconds_per_call(fn: Callable[[], object], iters: int = 20) -> float:
    """Mean over CUDA events, after a warm-up that also compiles the kernels."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def main() -> None:
    if not cuda_kernels.is_available():
        sys.exit("bench_kernels: needs CuPy and a CUDA device")
    torch.manual_seed(0)
    dev = torch.device(DEVICE)
    blocks_per_seq = CONTEXT // BLOCK
    num_blocks = BATCH * blocks_per_seq
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD, device=dev, dtype=DTYPE)  # 0.5 GiB
    v_cache = torch.randn_like(k_cache)
    block_tables = torch.randperm(num_blocks, device=dev).view(BATCH, blocks_per_seq).int()  # scattered
    meta = AttentionMetadata(
        slot_mapping=(block_tables[:, -1].long() * BLOCK + BLOCK - 1),  # [B]: each sequence's last slot
        query_start_loc=torch.arange(BATCH + 1, device=dev, dtype=torch.int32),
        context_lens=torch.full((BATCH,), CONTEXT, device=dev, dtype=torch.int32),
        block_tables=block_tables,
        query_lens=[1] * BATCH,
        context_lens_host=[CONTEXT] * BATCH,
        block_size=BLOCK,
        max_query_len=1,
        max_context_len=CONTEXT,
    )
    query = torch.randn(BATCH, HEADS, HEAD, device=dev, dtype=DTYPE)  # [B, Hq, D]
    out = torch.empty_like(query)
    scale = HEAD**-0.5

    t_paged = seconds_per_call(
        lambda: cuda_kernels.paged_attention(out, query, k_cache, v_cache, meta, scale)
    )
    kv_bytes = 2 * k_cache.numel() * k_cache.element_size()
    src = torch.empty(kv_bytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    t_copy = seconds_per_call(lambda: dst.copy_(src))
    copy_bw, paged_bw = 2 * kv_bytes / t_copy, kv_bytes / t_paged  # a copy reads and writes every byte

    # Contiguous K/V in logical order for SDPA: [B, kv_heads, ctx, D]
    k = k_cache[block_tables.long()].view(BATCH, CONTEXT, KV_HEADS, HEAD).transpose(1, 2).contiguous()
    v = v_cache[block_tables.long()].view(BATCH, CONTEXT, KV_HEADS, HEAD).transpose(1, 2).contiguous()
    q = query.unsqueeze(2)  # [B, Hq, 1, D]
    sdpa = lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)  # noqa: E731
    t_sdpa = seconds_per_call(sdpa)
    err = (sdpa().squeeze(2).float() - out.float()).abs().max().item()

    print(
        f"device: {torch.cuda.get_device_name()}; decode B={BATCH} ctx={CONTEXT} Hq={HEADS} Hkv={KV_HEADS} D={HEAD}"
    )
    print(f"device-to-device copy: {copy_bw / 1e9:8.1f} GB/s")
    print(
        f"paged decode attention: {t_paged * 1e6:8.1f} us  {paged_bw / 1e9:8.1f} GB/s = {paged_bw / copy_bw:.1%} of copy"
    )
    print(f"SDPA (contiguous K/V):  {t_sdpa * 1e6:8.1f} us  paged/SDPA time = {t_paged / t_sdpa:.2f}x")
    print(f"max |paged - SDPA| = {err:.2e}")
    if err > 1e-2:
        sys.exit("bench_kernels: paged attention disagrees with SDPA")

    # The decode kernel's two tuning knobs, each variant checked against SDPA like the default
    reference = sdpa().squeeze(2).float()
    print("sweep: loads in flight x partition size -> time, fraction of copy, time / SDPA")
    base_options, base_partition = cuda_kernels.nvrtc_options, cuda_kernels.DECODE_PARTITION_SIZE
    for loads in LOADS_SWEEP:
        cuda_kernels.nvrtc_options = lambda n=loads: (*base_options(), f"-DDECODE_LOADS_IN_FLIGHT={n}")
        cuda_kernels._kernels.clear()
        for partition in PARTITION_SWEEP:
            cuda_kernels.DECODE_PARTITION_SIZE = partition
            run = lambda: cuda_kernels.paged_attention(out, query, k_cache, v_cache, meta, scale)  # noqa: E731
            t = seconds_per_call(run)
            bad = (out.float() - reference).abs().max().item() > 1e-2
            print(
                f"  loads {loads:2d}  partition {partition:4d}: {t * 1e6:7.1f} us  "
                f"{kv_bytes / t / copy_bw:6.1%} of copy  {t / t_sdpa:5.2f}x SDPA{'  WRONG' if bad else ''}"
            )
    cuda_kernels.nvrtc_options, cuda_kernels.DECODE_PARTITION_SIZE = base_options, base_partition
    cuda_kernels._kernels.clear()


if __name__ == "__main__":
    main()
