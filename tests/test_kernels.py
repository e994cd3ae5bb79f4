"""The CUDA kernels, executed, against a plain float32 torch reference.

By default the unchanged .cu sources run on the CPU through g++ and the CUDA shim (pagedinfer.cuda_cpu);
with PAGEDINFER_TEST_CUDA=1 the same tests drive real CuPy on CUDA tensors. Each (dtype, head, block)
combination below costs one g++ build (cached by source hash), so the set is kept small; head 256 and
the full matrix are covered by the NVRTC compile test.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from pagedinfer.attention import cuda_cpu, cuda_kernels
from pagedinfer.attention.metadata import AttentionMetadata

ON_CUDA = os.environ.get("PAGEDINFER_TEST_CUDA") == "1"
COMBOS = [(torch.float16, 128, 16), (torch.bfloat16, 64, 8), (torch.float32, 80, 32)]  # dtype, head, block
GQA = [(4, 4), (8, 2), (16, 2), (12, 1)]  # query heads, KV heads: ratios 1, 4, 8 and 12 (two head chunks)
TOLERANCE = {torch.float16: 3e-3, torch.bfloat16: 2e-2, torch.float32: 1e-4}


def combo_id(combo) -> str:
    return f"{str(combo[0]).removeprefix('torch.')}-h{combo[1]}-b{combo[2]}"


def heads_id(heads) -> str:
    return f"q{heads[0]}kv{heads[1]}"


@pytest.fixture(scope="module")
def device() -> str:
    if ON_CUDA:
        assert cuda_kernels.is_available(), "PAGEDINFER_TEST_CUDA=1 but CuPy or the GPU is missing"
        cuda_kernels.set_raw_module_factory(None)
    else:
        cuda_kernels.set_raw_module_factory(cuda_cpu.RawModule)
    yield "cuda" if ON_CUDA else "cpu"
    cuda_kernels.set_raw_module_factory(None)


def make_batch(q_lens, ctx_lens, dtype, head, block, heads, device, seed=0):
    """Random query/caches and metadata with scrambled block tables."""
    num_heads, num_kv_heads = heads
    gen = torch.Generator().manual_seed(seed)
    counts = [math.ceil(c / block) for c in ctx_lens]
    num_blocks = sum(counts) + 2
    physical = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [physical[sum(counts[:s]) : sum(counts[: s + 1])] for s in range(len(counts))]
    if len(tables) > 1:  # the two longest sequences share a prefix of blocks (prefix caching, forks)
        a, b = sorted(range(len(counts)), key=counts.__getitem__)[-2:]
        tables[a][: counts[a] // 2] = tables[b][: counts[a] // 2]
    max_blocks = max(counts) + 1
    block_tables = torch.zeros(len(tables), max_blocks, dtype=torch.int32)  # [S, max_blocks], pad 0
    for s, t in enumerate(tables):
        block_tables[s, : len(t)] = torch.tensor(t)
    slots = [
        tables[s][p // block] * block + p % block
        for s, (q, c) in enumerate(zip(q_lens, ctx_lens, strict=True))
        for p in range(c - q, c)
    ]
    k_cache = torch.randn(num_blocks, block, num_kv_heads, head, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block, num_kv_heads, head, generator=gen).to(dtype)
    # [T, Hq, D] as the engine passes it: a transposed view of the model's [1, Hq, T, D]
    query = torch.randn(1, num_heads, sum(q_lens), head, generator=gen).to(dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(
            [0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device
        ),
        context_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        query_lens=list(q_lens),
        context_lens_host=list(ctx_lens),
        block_size=block,
        max_query_len=max(q_lens),
        max_context_len=max(ctx_lens),
    )
    return query.to(device)[0].transpose(0, 1), k_cache.to(device), v_cache.to(device), meta


def reference(
    query, k_cache, v_cache, meta, scale, sliding_window=0, softcap=0.0, sinks=None
) -> torch.Tensor:
    """Float32 attention of each sequence's queries over its cached keys, gathered through the table."""
    group, starts, outs = query.shape[1] // k_cache.shape[2], meta.query_start_loc.tolist(), []
    for s, (q_len, ctx) in enumerate(zip(meta.query_lens, meta.context_lens_host, strict=True)):
        blocks = meta.block_tables[s, : math.ceil(ctx / meta.block_size)].long()
        k, v = (c[blocks].flatten(0, 1)[:ctx].float().repeat_interleave(group, 1) for c in (k_cache, v_cache))
        logits = torch.einsum("qhd,khd->hqk", query[starts[s] : starts[s + 1]].float(), k) * scale
        if softcap > 0:
            logits = softcap * torch.tanh(logits / softcap)
        q_pos = torch.arange(ctx - q_len, ctx, device=query.device)[:, None]
        k_pos = torch.arange(ctx, device=query.device)[None]
        visible = (k_pos <= q_pos) & ((q_pos - k_pos < sliding_window) if sliding_window > 0 else True)
        logits = logits.masked_fill(~visible, float("-inf"))  # [Hq, q_len, ctx]; k, v: [ctx, Hq, D]
        if sinks is not None:
            logits = torch.cat([logits, sinks.float()[:, None, None].expand(-1, q_len, 1)], dim=-1)
        outs.append(torch.einsum("hqk,khd->qhd", logits.softmax(-1)[..., :ctx], v))
    return torch.cat(outs)


def check_attention(q_lens, ctx_lens, combo, heads, device, **features):
    dtype, head, block = combo
    query, k_cache, v_cache, meta = make_batch(q_lens, ctx_lens, dtype, head, block, heads, device)
    out = torch.full(query.shape, float("nan"), dtype=dtype, device=device)
    scale = head**-0.5
    cuda_kernels.paged_attention(out, query, k_cache, v_cache, meta, scale, **features)
    expected = reference(query, k_cache, v_cache, meta, scale, **features)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


def decode_lens(block: int) -> list[int]:
    return [1, block - 1, block, block + 1, 700]  # 700 > DECODE_PARTITION_SIZE: partitions + merge


@pytest.mark.parametrize("heads", GQA, ids=heads_id)
@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
def test_decode(combo, heads, device):
    ctx = decode_lens(combo[2])
    check_attention([1] * len(ctx), ctx, combo, heads, device)


@pytest.mark.parametrize("partition", [128, 4096])  # 6 partitions for the longest context; no merge
@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
def test_decode_partition_size(combo, partition, device, monkeypatch):
    monkeypatch.setattr(cuda_kernels, "DECODE_PARTITION_SIZE", partition)
    ctx = decode_lens(combo[2])
    check_attention([1] * len(ctx), ctx, combo, (8, 2), device, sliding_window=650)


# (query tokens, context tokens) per sequence: whole prompts, chunks over a cached prefix, a decode row
PREFILL = ([37, 5, 1, 17, 3], [37, 21, 300, 333, 3])


@pytest.mark.parametrize("heads", GQA, ids=heads_id)
@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
def test_prefill(combo, heads, device):
    check_attention(*PREFILL, combo, heads, device)


FEATURES = [
    {"sliding_window": 37},
    {"sliding_window": 600},  # partitions start at ctx - window
    {"softcap": 2.0},
    {"sinks": True},
    {"sliding_window": 100, "softcap": 5.0, "sinks": True},
]


@pytest.mark.parametrize("features", FEATURES, ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()))
@pytest.mark.parametrize("combo", COMBOS[:2], ids=combo_id)
@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_features(phase, combo, features, device):
    features = dict(features)
    if features.get("sinks"):
        features["sinks"] = torch.linspace(-2.0, 3.0, 8, device=device)
    lens = ([1] * 5, decode_lens(combo[2])) if phase == "decode" else PREFILL
    check_attention(*lens, combo, (8, 2), device, **features)


@pytest.mark.skipif(ON_CUDA, reason="thread order is a CPU-shim probe")
@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_reverse_thread_order(phase, device, monkeypatch):
    monkeypatch.setenv("PAGEDINFER_CPU_REVERSE", "1")
    combo = COMBOS[0]
    lens = ([1] * 5, decode_lens(combo[2])) if phase == "decode" else PREFILL
    check_attention(*lens, combo, (16, 2), device, sliding_window=600, sinks=torch.ones(16))


@pytest.mark.parametrize("dtype", list(cuda_kernels.DTYPE_NAMES), ids=lambda d: str(d).removeprefix("torch."))
def test_reshape_and_cache_bit_exact(dtype, device):
    gen = torch.Generator().manual_seed(1)
    k_cache = torch.randn(6, 8, 2, 64, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(6, 8, 2, 80, generator=gen).to(dtype).to(device)
    key = (
        torch.randn(1, 2, 5, 64, generator=gen).to(dtype).to(device)[0].transpose(0, 1)
    )  # from [1, kvh, T, D]
    qkv = torch.randn(5, 4 * 80 + 2 * 80 + 2 * 80, generator=gen).to(dtype).to(device)  # a fused QKV output
    value = qkv[:, 480:].view(5, 2, 80)  # token stride 640
    slots = torch.tensor([3, 17, -1, 40, 47], device=device)
    expected_k, expected_v = k_cache.clone().flatten(0, 1), v_cache.clone().flatten(0, 1)
    keep = slots >= 0
    expected_k[slots[keep]], expected_v[slots[keep]] = key[keep], value[keep]
    cuda_kernels.reshape_and_cache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache.flatten(0, 1), expected_k) and torch.equal(v_cache.flatten(0, 1), expected_v)


def test_copy_blocks_bit_exact(device):
    gen = torch.Generator().manual_seed(2)
    k_caches = [torch.randn(7, 16, 2, 96, generator=gen).bfloat16().to(device) for _ in range(3)]
    v_caches = [torch.randn(7, 16, 2, 96, generator=gen).bfloat16().to(device) for _ in range(3)]
    pairs = [(0, 5), (2, 6), (0, 3)]
    expected = [c.clone() for c in k_caches + v_caches]
    for c in expected:
        for src, dst in pairs:
            c[dst] = c[src]
    cuda_kernels.copy_blocks(k_caches, v_caches, pairs)
    assert all(torch.equal(a, b) for a, b in zip(k_caches + v_caches, expected, strict=True))
