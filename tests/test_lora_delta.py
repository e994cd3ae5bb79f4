"""The LoRA deltas' C kernel (kernels/cpu_lora.c): each row's bits depend on that row alone (any row
range, row tile, batch size, thread count, vector width) and the values are the float32 formula
rounded once (its refusal of rows out of range: tests/test_kernel_bounds.py)."""

from __future__ import annotations

import pytest
import torch

from pagedinfer.kernels import abi, build
from pagedinfer.lora import delta

# (in, out, rank): tails in every dimension (rows of 6, columns and ranks of 16), a rank above 16
SHAPES = [(64, 70, 8), (40, 33, 3), (96, 160, 24)]
ROWS = 23  # three full row tiles of 6 and a tile of 5


@pytest.fixture(autouse=True)
def kernel():
    if delta.library() is None:
        pytest.fail("the C kernels did not build (is a C compiler installed?)")


def weights(inputs: int, out: int, rank: int, seed: int) -> delta.DeltaWeights:
    gen = torch.Generator().manual_seed(seed)
    a_t = torch.zeros(inputs, delta.padded(rank))
    b_t = torch.zeros(rank, delta.padded(out))
    a_t[:, :rank] = torch.randn(inputs, rank, generator=gen)
    b_t[:, :out] = torch.randn(rank, out, generator=gen)
    return delta.DeltaWeights(a_t, b_t, rank, out, 0.625)


def operands(inputs: int, out: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(ROWS, inputs, generator=gen).to(dtype), torch.randn(ROWS, out, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_each_row_depends_on_itself_alone(shape, dtype):
    inputs, out, rank = shape
    w = weights(inputs, out, rank, seed=1)
    x, y0 = operands(inputs, out, dtype, seed=2)
    whole = y0.clone()
    delta.add_delta(whole, x, 0, ROWS, w)
    ref = y0.double() + w.scaling * (x.double() @ w.a_t[:, :rank].double() @ w.b_t[:, :out].double())
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(whole.double(), ref, rtol=tolerance, atol=tolerance * ref.abs().max().item())
    for lo, hi in [(0, 1), (4, 5), (5, 12), (6, 23), (1, 22)]:  # other tiles, other row counts
        part = y0.clone()
        delta.add_delta(part, x, lo, hi, w)
        assert torch.equal(part[lo:hi], whole[lo:hi]), (lo, hi)
        assert torch.equal(part[:lo], y0[:lo]) and torch.equal(part[hi:], y0[hi:])  # no other row written
    for i in range(ROWS):  # each row alone in its call
        alone = y0[i : i + 1].clone()
        delta.add_delta(alone, x[i : i + 1], 0, 1, w)
        assert torch.equal(alone[0], whole[i]), i


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_size_and_threads_change_no_row(dtype):
    """Each row of batches of several sizes, on one thread and on two, has the bits of that row alone:
    shapes past the kernel's bound for threads (2^17 multiply-adds a product), so two threads split
    the batches' row tiles and panels."""
    inputs, out, rank, rows = 512, 600, 16, 40
    w = weights(inputs, out, rank, seed=9)
    gen = torch.Generator().manual_seed(10)
    x, y0 = (
        torch.randn(rows, inputs, generator=gen).to(dtype),
        torch.randn(rows, out, generator=gen).to(dtype),
    )
    alone = y0.clone()
    for i in range(rows):
        delta.add_delta(alone[i : i + 1], x[i : i + 1], 0, 1, w)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for size in (5, 6, 13, rows):
                batch = y0[:size].clone()
                delta.add_delta(batch, x[:size], 0, size, w)
                assert torch.equal(batch, alone[:size]), (count, size)
    finally:
        torch.set_num_threads(threads)


def test_bfloat16_rows_are_the_float32_sums_rounded_once():
    """A bfloat16 row's result is the float32 kernel's on its (exact) float32 values, rounded once."""
    inputs, out, rank = SHAPES[0]
    w = weights(inputs, out, rank, seed=3)
    x, y = operands(inputs, out, torch.bfloat16, seed=4)
    in_float32 = y.float()
    delta.add_delta(in_float32, x.float(), 0, ROWS, w)
    delta.add_delta(y, x, 0, ROWS, w)
    assert torch.equal(y, in_float32.to(torch.bfloat16))


def test_the_avx2_build_gives_the_same_bits(monkeypatch):
    """Built without AVX-512 (its 16-column vectors as two 8-float halves): the same bits as here."""
    if not build.cpu_flags(("avx512f",)):
        pytest.skip("needs an AVX-512 CPU: its native build is what the AVX2 build is compared with")
    monkeypatch.setenv("PAGEDINFER_CC_FLAGS", "-mno-avx512f")
    avx2 = delta.bind(build.optional_library(delta.SOURCE))
    for dtype in (torch.float32, torch.bfloat16):
        for seed, (inputs, out, rank) in enumerate(SHAPES):
            w = weights(inputs, out, rank, seed)
            x, y = operands(inputs, out, dtype, seed + 10)
            there = y.clone()
            fn = getattr(avx2, f"lora_delta_{delta.SUFFIX[dtype]}")
            args = (inputs, out, w.a_t.data_ptr(), w.a_t.shape[1], w.b_t.data_ptr(), w.b_t.shape[1], rank)
            scratch = torch.empty(ROWS, w.a_t.shape[1])
            refusal = abi.Refusal()
            assert (
                fn(
                    x.data_ptr(),
                    there.data_ptr(),
                    ROWS,
                    0,
                    ROWS,
                    *args,
                    w.scaling,
                    scratch.data_ptr(),
                    refusal,
                )
                == 0
            )
            delta.add_delta(y, x, 0, ROWS, w)
            assert torch.equal(there, y), (dtype, inputs, out, rank)


def test_the_debug_build_asserts_operands_that_do_not_fit_the_weights(monkeypatch):
    """Shapes are the caller's to vouch for: with ``PAGEDINFER_KERNEL_DEBUG=1`` the binding asserts them
    before any C runs (here x 40 wide against A^T's 64 rows)."""
    w = weights(*SHAPES[0], seed=7)
    x, y = operands(SHAPES[1][0], SHAPES[0][1], torch.float32, seed=8)
    before = y.clone()
    monkeypatch.setenv("PAGEDINFER_KERNEL_DEBUG", "1")
    abi.debug.cache_clear()
    try:
        with pytest.raises(AssertionError):
            delta.add_delta(y, x, 0, ROWS, w)
    finally:
        abi.debug.cache_clear()
    assert torch.equal(y, before)
