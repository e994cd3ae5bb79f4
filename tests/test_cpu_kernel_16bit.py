"""The C decode kernel's bfloat16 and float16 instantiations against a float64 torch reference.

Same shapes and cases as the float32 kernel tests in test_attention.py. The reference attends the
same 16-bit K/V and queries, widened exactly; the kernel accumulates in float32 and rounds only its
output to the pool's dtype, so the tolerance is that rounding: half a unit in the last place of
values of magnitude up to ~2 (bfloat16: 8 significant bits, atol = rtol = 1.6e-2; float16: 11 bits,
atol = rtol = 2e-3). Float32 queries over a 16-bit pool (--kv-cache-dtype) output float32: the
reference attends the pool's rounded K/V, to float32's accuracy.
"""

import pytest
import torch
from test_attention import TOLERANCE, check_sequences, make_batch, reference

from pagedinfer.attention.interface import PortablePlan
from pagedinfer.kernels import paged_decode

DTYPES = [torch.bfloat16, torch.float16]


def half_batch(dtype, *args, **kwargs):
    """test_attention.make_batch with q, K/V and the pool in ``dtype``."""
    q, k, v, kc, vc, meta = make_batch(*args, **kwargs)
    return (*(t.to(dtype) for t in (q, k, v, kc, vc)), meta)


@pytest.fixture(params=DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def dtype(request):
    if not paged_decode.available(request.param):
        pytest.fail(f"the CPU kernel has no {request.param} instantiation (is a C compiler installed?)")
    return request.param


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize(
    "window,softcap,with_sinks", [(0, 0.0, False), (5, 0.0, False), (0, 3.0, False), (0, 0.0, True)]
)
def test_half_kernel_matches_reference(dtype, group, window, softcap, with_sinks, monkeypatch):
    """Decode rows (the kernel) mixed with prefill/extend chunks (torch, in the same dtype)."""
    calls = []
    decode = paged_decode.paged_decode
    monkeypatch.setattr(paged_decode, "paged_decode", lambda *a: calls.append(a[2].dtype) or decode(*a))
    bs, kvh, d = 4, 2, 16
    hq = kvh * group
    q, k, v, kc, vc, meta = half_batch(dtype, [1, 1, 5, 1, 1, 3], [3, 4, 5, 9, 17, 12], bs, kvh, hq, d)
    sinks = torch.randn(hq) if with_sinks else None
    out = torch.empty(q.shape[0], hq, d, dtype=dtype)
    PortablePlan.build(meta, True).attend(
        out, q, k, v, kc, vc, meta.slot_mapping, 0.3, window, softcap, sinks
    )
    assert calls == [dtype]
    check_sequences(out, q, kc, vc, meta, 0.3, window, softcap, sinks)


@pytest.mark.parametrize("window", [0, 5])
def test_float32_queries_over_half_pool_match_reference(dtype, window, monkeypatch):
    """--kv-cache-dtype: float32 activations, the new K/V rounded into a 16-bit pool as they are
    written; decode rows through the kernel's float32-over-16-bit instantiation, chunks through torch
    reading the pool back, every output within float32 accuracy of attention over the rounded K/V."""
    if not paged_decode.available(torch.float32, dtype):
        pytest.fail(f"the CPU kernel has no float32-over-{dtype} instantiation")
    calls = []
    decode = paged_decode.paged_decode
    monkeypatch.setattr(paged_decode, "paged_decode", lambda *a: calls.append(a[2].dtype) or decode(*a))
    q, k, v, kc, vc, meta = make_batch([1, 1, 5, 1, 3], [3, 9, 5, 17, 12], 4, 2, 6, 16)
    kc, vc = kc.to(dtype), vc.to(dtype)
    out = torch.empty(q.shape[0], 6, 16)
    PortablePlan.build(meta, True).attend(out, q, k, v, kc, vc, meta.slot_mapping, 0.3, window, 0.0, None)
    assert calls == [dtype]
    written = kc.view(-1, 2, 16)[meta.slot_mapping]  # [T, kvh, D] the new rows, as stored
    assert torch.equal(written, k.to(dtype)) and torch.equal(
        vc.view(-1, 2, 16)[meta.slot_mapping], v.to(dtype)
    )
    check_sequences(out, q, kc, vc, meta, 0.3, window)


def test_threaded_half_kernel_matches_reference(dtype):
    torch.set_num_threads(2)
    lens = [40 + 37 * i for i in range(16)]
    q, k, v, kc, vc, meta = half_batch(dtype, [1] * 16, lens, bs=16, kvh=2, hq=8, d=64, seed=3)
    out = torch.empty(16, 8, 64, dtype=dtype)
    plan = PortablePlan.build(meta, True)
    plan.attend(out, q, k, v, kc, vc, meta.slot_mapping, 0.125, 0, 0.0, None)
    assert len(next(iter(plan.ranges.values()))) == 3  # two threads' ranges
    check_sequences(out, q, kc, vc, meta, 0.125)


def test_half_kernel_underflowing_probabilities(dtype):
    q, k, v, kc, vc, meta = half_batch(dtype, [1, 1, 1], [7, 16, 33], bs=8, kvh=2, hq=4, d=16, seed=5)
    out = torch.empty(3, 4, 16, dtype=dtype)
    PortablePlan.build(meta, True).attend(out, q, k, v, kc, vc, meta.slot_mapping, 60.0, 0, 0.0, None)
    check_sequences(out, q, kc, vc, meta, 60.0)


def together_equals_alone(dtype, tables, lens, bs, kvh, hq, d, scale, seed, monkeypatch):
    """Sequences over ``tables`` attended in one call, then each alone: equal bit for bit, and each
    within the dtype's tolerance of the float64 reference."""
    gen = torch.Generator().manual_seed(seed)
    members, nb = len(tables), max(max(t) for t in tables) + 1
    bt, ctx = (
        torch.tensor(tables, dtype=torch.int32),
        torch.tensor(lens, dtype=torch.int32),
    )  # [S, blocks], [S]
    kc = torch.randn(nb, bs, kvh, d, generator=gen).to(dtype)  # [NB, bs, kvh, D]
    vc = torch.randn(nb, bs, kvh, d, generator=gen).to(dtype)
    q = torch.randn(members, hq, d, generator=gen).to(dtype)  # [S, Hq, D]
    rows = torch.arange(members)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    together = torch.empty(members, hq, d, dtype=dtype)
    paged_decode.paged_decode(
        together, q, kc, vc, bt, ctx, rows, paged_decode.split(lens, 1), scale, 0, 0.0, None
    )
    for i in range(members):
        alone = torch.empty(members, hq, d, dtype=dtype)
        args = (bt[i : i + 1], ctx[i : i + 1], rows[i : i + 1], paged_decode.split([lens[i]], 1))
        paged_decode.paged_decode(alone, q, kc, vc, *args, scale, 0, 0.0, None)
        assert torch.equal(together[i], alone[i]), f"sequence {i}"
        pos = torch.arange(lens[i])
        slots = bt[i, pos // bs].long() * bs + pos % bs
        keys, values = kc.view(-1, kvh, d)[slots], vc.view(-1, kvh, d)[slots]
        want = reference(q[i : i + 1], keys, values, torch.tensor([lens[i] - 1]), scale, 0, 0.0, None)
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(together[i : i + 1].double(), want, atol=tol, rtol=tol)


def test_half_kernel_serves_completions_sharing_prompt_blocks_together(dtype, monkeypatch):
    """20 completions sharing 3 prompt blocks: attended together, each equals itself run alone, bit for bit."""
    tables = [[0, 1, 2, 3 + 2 * i, 4 + 2 * i] for i in range(20)]
    lens = [13 + i % 6 for i in range(20)]
    together_equals_alone(dtype, tables, lens, 4, 2, 6, 16, 0.25, 7, monkeypatch)


def test_bfloat16_output_rounds_to_nearest_even():
    """Two keys of equal logit (q = 0): the output is (v1 + v2) / 2, exact in float32, narrowed by the
    kernel's rounding: equal to torch's round-to-nearest-even cast, ties included."""
    if not paged_decode.available(torch.bfloat16):
        pytest.fail("the CPU kernel has no bfloat16 instantiation")
    d, gen = 512, torch.Generator().manual_seed(0)
    vc = torch.randn(1, 2, 1, d, generator=gen).to(torch.bfloat16)  # [NB=1, bs=2, kvh=1, D]: v1, v2
    kc = torch.randn(1, 2, 1, d, generator=gen).to(torch.bfloat16)
    q = torch.zeros(1, 1, d, dtype=torch.bfloat16)  # [T, Hq, D]
    out = torch.empty(1, 1, d, dtype=torch.bfloat16)
    table, lens, rows = (
        torch.zeros(1, 1, dtype=torch.int32),
        torch.tensor([2], dtype=torch.int32),
        torch.zeros(1).long(),
    )
    paged_decode.paged_decode(
        out, q, kc, vc, table, lens, rows, paged_decode.split([2], 1), 1.0, 0, 0.0, None
    )
    mean = (vc[0, 0, 0].float() + vc[0, 1, 0].float()) / 2  # [D] exact
    assert int((mean.view(torch.int32) & 0xFFFF == 0x8000).sum()) > 0, (
        "no tie among the rows: change the seed"
    )
    assert torch.equal(out.view(d), mean.to(torch.bfloat16))


def test_mismatched_dtypes_are_refused():
    if not paged_decode.available(torch.bfloat16):
        pytest.fail("the CPU kernel has no bfloat16 instantiation")
    kc = torch.zeros(1, 4, 1, 8, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="share one dtype"):  # float16 queries over a bfloat16 pool
        paged_decode.paged_decode(
            torch.empty(1, 1, 8, dtype=torch.float16),
            torch.empty(1, 1, 8, dtype=torch.float16),
            kc,
            kc,
            torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32),
            torch.zeros(1).long(),
            paged_decode.split([1], 1),
            1.0,
            0,
            0.0,
            None,
        )


@pytest.mark.parametrize(
    "bs,d,members,shared",
    [
        (16, 64, 20, 5),
        (16, 128, 9, 9),
        (32, 64, 13, 3),
        (64, 64, 8, 2),
        (16, 64, 7, 5),
        (128, 64, 9, 1),
        (16, 32, 9, 2),
    ],
)
def test_completions_over_shared_runs_equal_themselves_alone(dtype, bs, d, members, shared, monkeypatch):
    """Blocks shared by 8 or more completions go through the bfloat16 kernel's own layouts where the
    CPU has AVX512-BF16 (K transposed, V unpacked, runs of up to 64 rows, 6 query heads a tile; head
    size 64 or 128), the tiles otherwise (7 members, 128-row blocks, head size 32): each completion
    equals itself attended alone, bit for bit, and the float64 reference."""
    own = 3  # blocks of each member's own after the shared ones
    tables = [list(range(shared)) + [shared + own * i + b for b in range(own)] for i in range(members)]
    lens = [shared * bs + 1 + (7 * i) % (own * bs - 1) for i in range(members)]
    together_equals_alone(dtype, tables, lens, bs, 3, 9, d, 0.125, bs + d + members, monkeypatch)
