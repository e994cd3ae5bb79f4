"""The CUDA kernels, executed, against a plain float32 torch reference.

By default the unchanged .cu sources run on the CPU through g++ and the CUDA shim
(pagedinfer.attention.cuda_on_cpu); with PAGEDINFER_TEST_CUDA=1 the same tests drive real CuPy on CUDA
tensors. Each (dtype, head, block, decode GROUP) combination below costs one g++ build (cached by
source hash), so the set is kept small; head 256 and the full matrix are covered by the NVRTC
compile test.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from pagedinfer.attention import cuda_kernels, cuda_on_cpu
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
        cuda_kernels.set_raw_module_factory(cuda_on_cpu.RawModule)
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
    return [1, block - 1, block, block + 1, 700]  # 700: several partitions + merge


@pytest.mark.parametrize("heads", GQA, ids=heads_id)
@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
def test_decode(combo, heads, device):
    ctx = decode_lens(combo[2])
    check_attention([1] * len(ctx), ctx, combo, heads, device)


@pytest.mark.parametrize(
    ("cuda_blocks", "visible", "sm_count", "expected"),
    [
        (8 * 256, 16384, 132, (16384, 1)),  # batch 256, 8 KV heads: the grid is full already
        (8 * 64, 4096, 132, (2048, 2)),  # batch 64: two partitions give 1024 blocks >= 4 x 132
        (8, 16384, 132, (256, 64)),  # one long sequence: 64 partitions of the smallest size
        (8, 100, 132, (256, 1)),  # a short context is never split below PARTITION_QUANTUM
        (2, 1000, 16, (256, 4)),
    ],
)
def test_decode_partition_choice(cuda_blocks, visible, sm_count, expected):
    assert cuda_kernels.decode_partitions(cuda_blocks, visible, sm_count) == expected


@pytest.mark.parametrize(
    ("heads", "group"), [((8, 8), 1), ((6, 2), 4), ((8, 2), 4), ((7, 1), 8), ((12, 1), 8)]
)
def test_decode_group(heads, group):
    assert cuda_kernels.decode_group(*heads) == group


# ragged contexts, none but 1 a multiple of a tile (32 keys at 256-byte rows, 64 at 128-byte rows)
RAGGED = [1, 33, 100, 257, 700]


@pytest.mark.parametrize("plan", ["one-partition", "many-partitions"])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (16, 2)], ids=heads_id)  # GQA groups 1, 4, 8
@pytest.mark.parametrize("head", [64, 128])
@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16], ids=lambda d: str(d).removeprefix("torch.")
)
def test_decode_partitioning(dtype, head, heads, plan, device, monkeypatch):
    """fp16 / bf16 against the float32 reference within TOLERANCE (3e-3 / 2e-2, absolute and relative)."""
    if plan == "one-partition":
        monkeypatch.setattr(cuda_kernels, "DECODE_BLOCKS_PER_SM", 0)
    else:  # partitions of 100 keys: 7 for the longest context, boundaries off the tiles
        monkeypatch.setattr(cuda_kernels, "PARTITION_QUANTUM", 100)
    cuda_blocks = heads[1] * len(RAGGED)  # GROUP covers each GQA ratio here: one block per KV head
    expected = 1 if plan == "one-partition" else 7
    assert cuda_kernels.decode_partitions(cuda_blocks, max(RAGGED))[1] == expected
    block = 16 if dtype == torch.float16 else 8  # shares builds with COMBOS
    check_attention([1] * len(RAGGED), RAGGED, (dtype, head, block), heads, device)


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


@pytest.mark.skipif(ON_CUDA, reason="thread order and copy timing are CPU-shim probes")
@pytest.mark.parametrize("probe", ["PAGEDINFER_CPU_REVERSE", "PAGEDINFER_CPU_EAGER_COPIES"])
@pytest.mark.parametrize("heads", [(16, 2), (8, 8)], ids=heads_id)  # decode GROUP 8 and 1
@pytest.mark.parametrize("combo", [COMBOS[0], COMBOS[2]], ids=combo_id)  # rows of 16 and 20 pieces
@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_race_probes(phase, combo, heads, probe, device, monkeypatch):
    """Threads run last to first, or cp.async copies land at issue (a buffer overwritten while others
    still read it shows); the default run lands them at the last moment (a read before the wait shows).
    At 20 pieces a row, the threads that copy a row are not the ones that read it."""
    monkeypatch.setenv(probe, "1")
    lens = ([1] * 5, decode_lens(combo[2])) if phase == "decode" else PREFILL
    check_attention(*lens, combo, heads, device, sliding_window=600, sinks=torch.ones(heads[0]))


ASYNC_PROBE = r"""
#include <cuda_pipeline_primitives.h>
extern "C" __global__ void async_probe(float* out, const float* src) {
  __shared__ __align__(16) float buf[2][4];
  buf[0][0] = buf[1][0] = -1.f;
  __pipeline_memcpy_async(&buf[0][0], src, 16);
  __pipeline_commit();
  __pipeline_memcpy_async(&buf[1][0], src + 4, 16);
  __pipeline_commit();
  out[0] = buf[0][0];  // nothing waited for: stale
  __pipeline_wait_prior(1);
  out[1] = buf[0][0];  // the older batch landed, the newest not yet
  out[2] = buf[1][0];
  __pipeline_wait_prior(0);
  out[3] = buf[1][0];
}
"""


@pytest.mark.skipif(ON_CUDA, reason="the latest possible landing is a CPU-shim guarantee")
def test_shim_async_copies_land_at_their_wait(device):
    """The shim delivers cp.async copies at the wait that must see them, so the decode kernel's
    double buffering is checked against the weakest ordering a GPU allows."""
    kernel = cuda_on_cpu.RawModule(code=ASYNC_PROBE).get_function("async_probe")
    out, src = torch.zeros(4), torch.arange(1.0, 9.0)
    kernel((1,), (1,), (out, src))
    assert out.tolist() == [-1.0, 1.0, -1.0, 5.0]


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
