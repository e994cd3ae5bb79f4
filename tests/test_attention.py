"""The CPU attention paths (C decode kernel and torch) against a plain per-sequence reference."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedinfer.attention.interface import use_cpu_kernel
from pagedinfer.attention.metadata import AttentionMetadata
from pagedinfer.attention.portable_backend import PortablePlan
from pagedinfer.kernels import build, paged_decode


def reference(q, keys, values, qpos, scale, window, softcap, sinks):
    """q [n, Hq, D], keys/values [L, kvh, D] of one sequence; plain softmax attention in float64."""
    n, hq, _ = q.shape
    g = hq // keys.shape[1]
    k = keys.double().repeat_interleave(g, dim=1)  # [L, Hq, D]
    v = values.double().repeat_interleave(g, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale  # [Hq, n, L]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    kpos = torch.arange(keys.shape[0])
    visible = kpos[None, :] <= qpos[:, None]
    if window:
        visible &= qpos[:, None] - kpos[None, :] < window
    scores = scores.masked_fill(~visible, -math.inf)
    if sinks is not None:
        scores = torch.cat([scores, sinks.double()[:, None, None].expand(hq, n, 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., : keys.shape[0]]
    return torch.einsum("hnl,lhd->nhd", probs, v)  # [n, Hq, Dv]


def make_batch(query_lens, context_lens, bs, kvh, hq, d, seed=0):
    """Random pool and block tables in scrambled order, sequences 0 and 1 sharing their first block."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-c // bs) for c in context_lens)
    num_blocks = len(context_lens) * max_blocks + 4
    perm = torch.randperm(num_blocks, generator=gen)
    tables = perm[: len(context_lens) * max_blocks].view(len(context_lens), max_blocks).clone()
    if len(context_lens) > 1:
        tables[1, 0] = tables[0, 0]
    k_cache = torch.randn(num_blocks, bs, kvh, d, generator=gen)
    v_cache = torch.randn(num_blocks, bs, kvh, d, generator=gen)
    total = sum(query_lens)
    q = torch.randn(total, hq, d, generator=gen)
    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    positions = torch.cat([torch.arange(c - n, c) for n, c in zip(query_lens, context_lens, strict=True)])
    seq_of = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))
    slots = tables[seq_of, positions // bs] * bs + positions % bs
    k_new = k_cache.view(-1, kvh, d)[slots].clone()  # this step's K/V: what is already at the slots
    v_new = v_cache.view(-1, kvh, d)[slots].clone()
    meta = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=qsl,
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        block_tables=tables.to(torch.int32),
        query_lens=list(query_lens),
        context_lens_host=list(context_lens),
        block_size=bs,
        max_query_len=max(query_lens),
        max_context_len=max(context_lens),
    )
    return q, k_new, v_new, k_cache, v_cache, meta


TOLERANCE = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3, torch.float32: 2e-5}  # by output dtype


def check_sequences(out, q, kc, vc, meta, scale, window=0, softcap=0.0, sinks=None):
    """Each sequence's output rows against the float64 reference over its context, read via its table."""
    bs, kvh, d = meta.block_size, kc.shape[2], kc.shape[3]
    starts = meta.query_start_loc.tolist()
    tol = TOLERANCE[out.dtype]
    for s, (n, length) in enumerate(zip(meta.query_lens, meta.context_lens_host, strict=True)):
        pos = torch.arange(length)
        slots = meta.block_tables[s, pos // bs].long() * bs + pos % bs
        keys, values = kc.view(-1, kvh, d)[slots], vc.view(-1, kvh, d)[slots]
        want = reference(
            q[starts[s] : starts[s] + n],
            keys,
            values,
            torch.arange(length - n, length),
            scale,
            window,
            softcap,
            sinks,
        )
        torch.testing.assert_close(out[starts[s] : starts[s] + n].double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("use_kernel", [True, False], ids=["c-kernel", "torch"])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize(
    "window,softcap,with_sinks", [(0, 0.0, False), (5, 0.0, False), (0, 3.0, False), (0, 0.0, True)]
)
def test_paged_attention_matches_reference(use_kernel, group, window, softcap, with_sinks):
    if use_kernel and not paged_decode.available():
        pytest.fail("the CPU kernel did not build (is a C compiler installed?)")
    bs, kvh, d = 4, 2, 16
    hq = kvh * group
    query_lens = [1, 1, 5, 1, 1, 3]  # decode rows mixed with prefill/extend chunks
    context_lens = [3, 4, 5, 9, 17, 12]  # below, at and across block boundaries
    q, k, v, kc, vc, meta = make_batch(query_lens, context_lens, bs, kvh, hq, d)
    sinks = torch.randn(hq) if with_sinks else None
    out = torch.empty(q.shape[0], hq, d)
    plan = PortablePlan.build(meta, use_kernel)
    plan.attend(out, q, k, v, kc, vc, meta.slot_mapping, 0.3, window, softcap, sinks)
    starts = meta.query_start_loc.tolist()
    for s, (n, length) in enumerate(zip(query_lens, context_lens, strict=True)):
        pos = torch.arange(length)
        slots = meta.block_tables[s, pos // bs].long() * bs + pos % bs
        keys, values = kc.view(-1, kvh, d)[slots], vc.view(-1, kvh, d)[slots]
        qpos = torch.arange(length - n, length)
        want = reference(q[starts[s] : starts[s] + n], keys, values, qpos, 0.3, window, softcap, sinks)
        torch.testing.assert_close(out[starts[s] : starts[s] + n].double(), want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adjacent_whole_prompts_of_one_length_attend_in_one_call(window, dtype):
    """A run of whole prompts of one length is one batched SDPA call: the same bits as one call per
    prompt, and each output the reference's; other chunks (other lengths, cached contexts) alone."""
    bs, kvh, hq, d = 4, 2, 6, 16
    query_lens = [1, 6, 6, 6, 4, 6, 3, 1]  # decode, three 6-token prompts, a 4, a 6, an extend, decode
    context_lens = [9, 6, 6, 6, 4, 6, 10, 5]
    q, k, v, kc, vc, meta = make_batch(query_lens, context_lens, bs, kvh, hq, d)
    q, k, v, kc, vc = (t.to(dtype) for t in (q, k, v, kc, vc))
    plan = PortablePlan.build(meta, use_kernel=False)
    assert plan.prompt_runs == [(1, 3, 6), (19, 1, 4), (23, 1, 6), (29, 1, 3)]
    out = torch.empty(q.shape[0], hq, d, dtype=dtype)
    plan.attend(out, q, k, v, kc, vc, meta.slot_mapping, 0.3, window, 0.0, None)
    alone = PortablePlan.build(meta, use_kernel=False)
    alone.prompt_runs = [(start, 1, n) for start, n, _ in alone.chunk_spans]
    one_by_one = torch.empty_like(out)
    alone.attend(one_by_one, q, k, v, kc, vc, meta.slot_mapping, 0.3, window, 0.0, None)
    assert torch.equal(out, one_by_one)
    check_sequences(out, q, kc, vc, meta, 0.3, window)


def _one_sequence_step(table: torch.Tensor, bs: int, start: int, n: int, other: tuple | None = None):
    """Metadata of a step that computes positions [start, start + n) of the sequence with ``table``;
    ``other`` (table, context length): a decode row of another sequence runs first in the step."""
    seqs = ([other] if other else []) + [(table, start + n)]
    lens = [1] * bool(other) + [n]
    slots = torch.cat(
        [
            t[p // bs].long() * bs + p % bs
            for (t, c), m in zip(seqs, lens, strict=True)
            for p in [torch.arange(c - m, c)]
        ]
    )
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=qsl,
        context_lens=torch.tensor([c for _, c in seqs], dtype=torch.int32),
        block_tables=torch.stack([t for t, _ in seqs]).to(torch.int32),
        query_lens=lens,
        context_lens_host=[c for _, c in seqs],
        block_size=bs,
        max_query_len=max(lens),
        max_context_len=max(c for _, c in seqs),
    )


@pytest.mark.parametrize("window", [0, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_row_has_the_same_bits_however_the_prompt_is_cut(window, dtype):
    """Through the C kernel a prompt row's output depends only on its own context: the same bits whole,
    in chunks of 16/16/8 or 5/30/5, one row at a time (as decode rows), or beside another sequence's
    row (SDPA gave a row other bits in a 3-row chunk than in a 16-row one on an AMD EPYC Zen 5)."""
    if not paged_decode.available(dtype):
        pytest.fail("the CPU kernel did not build (is a C compiler installed?)")
    bs, kvh, hq, d, length = 8, 3, 9, 64, 40
    gen = torch.Generator().manual_seed(11)
    kc = torch.randn(12, bs, kvh, d, generator=gen).to(dtype)
    vc = torch.randn(12, bs, kvh, d, generator=gen).to(dtype)
    q = torch.randn(length, hq, d, generator=gen).to(dtype)
    table = torch.tensor([7, 2, 9, 0, 4, 11])  # scattered blocks
    other = (torch.tensor([3, 5, 1, 6, 8, 10]), 29)
    kf, vf = kc.view(-1, kvh, d), vc.view(-1, kvh, d)
    pos = torch.arange(length)
    k_all, v_all = kf[table[pos // bs] * bs + pos % bs], vf[table[pos // bs] * bs + pos % bs]
    outs = []
    for cuts in ([40], [16, 16, 8], [5, 30, 5], [1] * 40, "beside"):
        out = torch.empty(length, hq, d, dtype=dtype)
        start = 0
        for n in [40] if cuts == "beside" else cuts:
            meta = _one_sequence_step(table, bs, start, n, other if cuts == "beside" else None)
            rows = slice(start, start + n)
            qs, ks, vs = q[rows], k_all[rows], v_all[rows]
            if cuts == "beside":  # the other sequence's decode row first in the packed rows
                last = other[0][(other[1] - 1) // bs] * bs + (other[1] - 1) % bs
                qs = torch.cat([q[:1], qs])
                ks, vs = torch.cat([kf[last : last + 1], ks]), torch.cat([vf[last : last + 1], vs])
            res = torch.empty(qs.shape[0], hq, d, dtype=dtype)
            plan = PortablePlan.build(meta, use_kernel=True)
            plan.attend(res, qs, ks, vs, kc, vc, meta.slot_mapping, d**-0.5, window, 0.0, None)
            out[rows] = res[-n:]
            start += n
        outs.append(out)
    for got in outs[1:]:
        assert torch.equal(got, outs[0])
    whole = _one_sequence_step(table, bs, 0, length)
    check_sequences(outs[0], q, kc, vc, whole, d**-0.5, window)


def test_threaded_decode_kernel_equals_torch_path(monkeypatch):
    """Enough work to be split across threads (sequence ranges of equal context): same as the torch path."""
    torch.set_num_threads(2)
    query_lens = [1] * 16
    context_lens = [40 + 37 * i for i in range(16)]
    q, k, v, kc, vc, meta = make_batch(query_lens, context_lens, bs=16, kvh=2, hq=8, d=64, seed=3)
    splits = []
    lib = paged_decode._library()
    real = lib.paged_decode_ranges_f32

    def spy(bounds, parts, *args):
        splits.append(list(bounds[: parts + 1]))
        real(bounds, parts, *args)

    fake = type("L", (), {"paged_decode_ranges_f32": staticmethod(spy), "store_kv_f32": lib.store_kv_f32})
    monkeypatch.setattr(paged_decode, "_library", lambda: fake())

    outs = []
    for use_kernel in (True, False):
        out = torch.empty(16, 8, 64)
        PortablePlan.build(meta, use_kernel).attend(
            out, q, k, v, kc, vc, meta.slot_mapping, 0.125, 0, 0.0, None
        )
        outs.append(out)
    assert len(splits) == 1 and len(splits[0]) == 3 and splits[0][0] == 0 < splits[0][1] < splits[0][2] == 16
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-4)


def test_decode_kernel_underflowing_probabilities():
    """Scores hundreds apart: most probabilities underflow to exactly 0 in the kernel's vector exp."""
    if not paged_decode.available():
        pytest.fail("the CPU kernel did not build (is a C compiler installed?)")
    query_lens, context_lens = [1, 1, 1], [7, 16, 33]
    q, k, v, kc, vc, meta = make_batch(query_lens, context_lens, bs=8, kvh=2, hq=4, d=16, seed=5)
    out = torch.empty(3, 4, 16)
    PortablePlan.build(meta, True).attend(out, q, k, v, kc, vc, meta.slot_mapping, 60.0, 0, 0.0, None)
    for s, length in enumerate(context_lens):
        pos = torch.arange(length)
        slots = meta.block_tables[s, pos // 8].long() * 8 + pos % 8
        keys, values = kc.view(-1, 2, 16)[slots], vc.view(-1, 2, 16)[slots]
        want = reference(q[s : s + 1], keys, values, torch.tensor([length - 1]), 60.0, 0, 0.0, None)
        torch.testing.assert_close(out[s : s + 1].double(), want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "dtype, pool",
    [(dt, dt) for dt in (torch.float32, torch.bfloat16, torch.float16)]
    + [(torch.float32, torch.bfloat16), (torch.float32, torch.float16)],
)
def test_store_kv_writes_strided_rows_at_their_slots(dtype, pool):
    """Rows of the activations' dtype land at their slots, rounded to the pool's dtype exactly as
    torch's ``.to()`` rounds (--kv-cache-dtype: float32 rows into a 16-bit pool)."""
    if not paged_decode.available(dtype, pool):
        pytest.fail(f"the CPU kernel has no {dtype} over {pool} instantiation (is a C compiler installed?)")
    kc, vc = torch.zeros(4, 8, 2, 16, dtype=pool), torch.zeros(4, 8, 2, 8, dtype=pool)
    # [5, 2, 16] strided like the model's key, values up to ~1000 (float16 rounds them coarsely)
    k = (torch.randn(1, 2, 5, 16) * 300).to(dtype)[0].transpose(0, 1)
    v = torch.randn(1, 2, 5, 8).to(dtype)[0].transpose(0, 1)  # [5, 2, 8]
    slots = torch.tensor([3, 31, -1, 8, 0])  # -1: padding, written nowhere
    paged_decode.store_kv(kc, vc, k, v, slots)
    want_k, want_v = torch.zeros(32, 2, 16, dtype=pool), torch.zeros(32, 2, 8, dtype=pool)
    keep = slots >= 0
    want_k[slots[keep]], want_v[slots[keep]] = k[keep].to(pool), v[keep].to(pool)
    assert torch.equal(kc.view(32, 2, 16), want_k) and torch.equal(vc.view(32, 2, 8), want_v)


def test_decode_kernel_serves_completions_sharing_prompt_blocks_together(monkeypatch):
    """Neighbouring sequences whose tables start with the same physical blocks (the n completions of a
    prompt) are attended together over those blocks: each output equals the sequence run alone,
    bit for bit, and the reference. Groups here: 20 completions (more than one pass of the kernel's
    group), 3 completions whose tables diverge at different blocks, a lone sequence, and 2 completions
    sharing a block only one of them fills."""
    if not paged_decode.available():
        pytest.fail("the CPU kernel did not build (is a C compiler installed?)")
    bs, kvh, hq, d = 4, 2, 6, 16
    gen = torch.Generator().manual_seed(7)
    prompt = [0, 1, 2]  # physical blocks of the 20 completions' common prompt
    tables, lens, free = [], [], iter(range(3, 200))
    for i in range(20):
        tables.append(prompt + [next(free), next(free)])
        lens.append(13 + i % 6)  # 3 shared full blocks, then 1-6 own tokens
    tables += [[40, 41, next(free), 0, 0], [40, 41, 42, 43, 0], [40, next(free), next(free), 0, 0]]
    lens += [10, 15, 9]
    tables += [[next(free)] * 5, [60, next(free), 0, 0, 0], [60, 61, 0, 0, 0]]
    lens += [17, 6, 3]
    bt = torch.tensor(tables, dtype=torch.int32)  # [S, 5]
    ctx = torch.tensor(lens, dtype=torch.int32)
    s = len(lens)
    kc, vc = torch.randn(200, bs, kvh, d, generator=gen), torch.randn(200, bs, kvh, d, generator=gen)
    q = torch.randn(s, hq, d, generator=gen)
    rows = torch.arange(s)
    together = torch.empty(s, hq, d)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # one range: groups never cut
    bounds = paged_decode.split(lens, hq * 2 * d)
    assert list(bounds) == [0, s]  # one thread: every group in one range
    paged_decode.paged_decode(together, q, kc, vc, bt, ctx, rows, bounds, 0.25, 0, 0.0, None)
    for i in range(s):
        alone = torch.empty(s, hq, d)
        paged_decode.paged_decode(
            alone,
            q,
            kc,
            vc,
            bt[i : i + 1],
            ctx[i : i + 1],
            rows[i : i + 1],
            paged_decode.split([lens[i]], 1),
            0.25,
            0,
            0.0,
            None,
        )
        assert torch.equal(together[i], alone[i]), f"sequence {i}"
        pos = torch.arange(lens[i])
        slots = bt[i, pos // bs].long() * bs + pos % bs
        keys, values = kc.view(-1, kvh, d)[slots], vc.view(-1, kvh, d)[slots]
        want = reference(q[i : i + 1], keys, values, torch.tensor([lens[i] - 1]), 0.25, 0, 0.0, None)
        torch.testing.assert_close(together[i : i + 1].double(), want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "hq,kvh,d,lens,window",
    [
        (9, 3, 64, [1500, 1500, 1500, 2900, 700], 0),  # completions of a 1500-token prompt, then two alone
        (32, 8, 128, [4100, 4100, 33], 0),  # logit rows of 4100 tokens x 32 heads: one member a group
        (6, 2, 72, [300, 300, 301], 0),  # head size 72: output vectors 8 + 1
        (4, 4, 64, [1000, 1000, 999], 250),  # a sliding window over long contexts
    ],
)
def test_decode_kernel_long_contexts_and_wide_heads(monkeypatch, hq, kvh, d, lens, window):
    """Realistic shapes through the kernel, two threads: the logit rows over whole contexts (the
    softmax between the two passes), groups of completions sharing prompt blocks, and groups cut short
    where the rows of one more member would not fit."""
    if not paged_decode.available():
        pytest.fail("the CPU kernel did not build (is a C compiler installed?)")
    bs = 16
    gen = torch.Generator().manual_seed(11)
    max_blocks = -(-max(lens) // bs)
    num_blocks = len(lens) * max_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    bt = perm.view(len(lens), max_blocks).to(torch.int32).clone()  # [S, max_blocks] scattered
    shared = min(lens[0], lens[1]) // bs
    for i in range(1, len(lens)):
        if lens[i] == lens[0]:
            bt[i, :shared] = bt[0, :shared]  # completions of one prompt: its full blocks shared
    kc = torch.randn(num_blocks, bs, kvh, d, generator=gen)
    vc = torch.randn(num_blocks, bs, kvh, d, generator=gen)
    q = torch.randn(len(lens), hq, d, generator=gen)
    out = torch.empty(len(lens), hq, d)
    torch.set_num_threads(2)
    bounds = paged_decode.split(lens, hq * 2 * d)
    ctx, rows = torch.tensor(lens, dtype=torch.int32), torch.arange(len(lens))
    paged_decode.paged_decode(out, q, kc, vc, bt, ctx, rows, bounds, d**-0.5, window, 0.0, None)
    for i, length in enumerate(lens):
        pos = torch.arange(length)
        slots = bt[i, pos // bs].long() * bs + pos % bs
        keys, values = kc.view(-1, kvh, d)[slots], vc.view(-1, kvh, d)[slots]
        qpos = torch.tensor([length - 1])
        want = reference(q[i : i + 1], keys, values, qpos, d**-0.5, window, 0.0, None)
        torch.testing.assert_close(out[i : i + 1].double(), want, atol=2e-5, rtol=1e-4)


def test_decode_kernel_shares_torchs_openmp_runtime():
    """The kernel's threads are torch's OpenMP workers: it needs libgomp, and loading it maps no second one."""
    if not paged_decode.available():
        pytest.fail("the CPU kernel did not build (is a C compiler installed?)")
    assert b"libgomp.so.1" in Path(paged_decode._library()._name).read_bytes()  # built with OpenMP
    maps = Path("/proc/self/maps").read_text().splitlines()
    gomp = {line.split()[-1] for line in maps if "libgomp" in line}
    assert len(gomp) == 1, gomp


@pytest.mark.parametrize("preset, want", [(None, "10000"), ("250", "250")])
def test_importing_pagedinfer_before_torch_shortens_openmp_spinning(preset, want):
    """``import pagedinfer`` sets libgomp's spin count before torch loads libgomp, unless one is set."""
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    if preset is not None:
        env["GOMP_SPINCOUNT"] = preset
    code = "import os, pagedinfer, torch; print(os.environ['GOMP_SPINCOUNT'])"
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == [want]


@pytest.mark.parametrize(
    "lens,threads,want",
    [
        ([10, 10, 10, 10, 40], 2, [0, 4, 5]),  # 40 | 40
        ([10, 20, 30, 45, 80], 2, [0, 4, 5]),  # 105 | 80 is nearer halves than 60 | 125
        ([5] * 9, 3, [0, 3, 6, 9]),
        ([100, 1, 1, 1], 2, [0, 1, 4]),
        ([3, 3], 4, [0, 1, 2]),  # never more threads than sequences
    ],
)
def test_split_gives_each_thread_about_equal_context(monkeypatch, lens, threads, want):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    monkeypatch.setattr(paged_decode, "MIN_WORK_PER_THREAD", 1)
    assert list(paged_decode.split(lens, 1)) == want


def test_kernel_without_openmp_builds_serial_and_agrees(monkeypatch, tmp_path):
    """A compiler that cannot link OpenMP still builds the kernel: ranges then run one after another
    (built at -O1: the fallback is what is tested, not the optimiser)."""
    if not paged_decode.available():
        pytest.fail("the CPU kernel did not build (is a C compiler installed?)")
    monkeypatch.setenv("PAGEDINFER_CACHE", str(tmp_path))
    monkeypatch.setenv("PAGEDINFER_CC_FLAGS", "-O1")
    monkeypatch.setattr(build, "THREADING", (["-fno-such-option"], ["-fopenmp-simd"]))
    paged_decode._library.cache_clear()
    try:
        assert paged_decode.available() and len(list(tmp_path.glob("*.so"))) == 1
        torch.set_num_threads(2)
        q, k, v, kc, vc, meta = make_batch([1] * 8, [40 + 37 * i for i in range(8)], 16, 2, 8, 64, seed=4)
        outs = []
        for use_kernel in (True, False):
            out = torch.empty(8, 8, 64)
            PortablePlan.build(meta, use_kernel).attend(
                out, q, k, v, kc, vc, meta.slot_mapping, 0.125, 0, 0.0, None
            )
            outs.append(out)
        torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-4)
    finally:
        paged_decode._library.cache_clear()


# (query heads, KV heads, head size): GQA ratios 3, 1, 4 and 8, the last with a head size ending in
# a lone 8 values (72 = 4 x 16 + 8)
BUILD_SHAPES = ((9, 3, 64), (4, 4, 80), (8, 2, 128), (8, 1, 72))
# (queries, pool): each pool under float32 activations, and bfloat16's own pair products
BUILD_DTYPES = (
    (torch.float32, torch.float32),
    (torch.float32, torch.float16),
    (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.bfloat16),
)


def _rows_through_kernel(hq, kvh, d, qdt, kvdt, window, softcap, with_sinks):
    """Prompt rows over their own prefixes (a whole prompt of 37, a chunk of 19 after 41 cached tokens:
    contexts off the 8-row groups and 16-row blocks) and decode rows over 133 and 9 tokens, through the
    engine's plan (every row a kernel row); (out, q, pool, meta, sinks)."""
    q, _, _, kc, vc, meta = make_batch([37, 1, 1, 19], [37, 133, 9, 60], 16, kvh, hq, d, seed=hq + d)
    q, kc, vc = q.to(qdt), kc.to(kvdt), vc.to(kvdt)
    k = kc.view(-1, kvh, d)[meta.slot_mapping].to(qdt)  # this step's rows: what the pool holds at their slots
    v = vc.view(-1, kvh, d)[meta.slot_mapping].to(qdt)
    sinks = torch.randn(hq, generator=torch.Generator().manual_seed(d)) if with_sinks else None
    out = torch.empty(q.shape[0], hq, d, dtype=qdt)
    PortablePlan.build(meta, True).attend(
        out, q, k, v, kc, vc, meta.slot_mapping, d**-0.5, window, softcap, sinks
    )
    return out, q, kc, vc, meta, sinks


@pytest.mark.skipif(not build.cpu_flags(("avx512f",)), reason="needs an AVX-512 CPU to build both")
def test_attention_builds_give_the_same_bits(monkeypatch):
    """The AVX-512 build serves the query heads of a KV head in tiles of 3 sharing each K/V load (16-bit
    rows widened in registers); the AVX2 build holds each 16-lane chunk as two 8-lane halves, takes
    the logits a head at a time and pass 2 three heads a tile (float16 rows widened by F16C as they
    are loaded, bfloat16 blocks into a buffer first). Every product and sum is taken in the same
    order, so the builds give the same bits, for prompt rows and decode rows, at every GQA ratio and
    head size of BUILD_SHAPES, with a window, softcapping and sinks, over every pool type.
    bfloat16's pair products (vdpbf16ps where the CPU has it) equal two FMAs in the other builds.
    The builds are the kernel cache's own (cached by flags: the AVX2 one is other tests' too)."""
    builds = [("avx512", ""), ("avx2", "-mno-avx512f")]
    if build.cpu_flags(("avx512_bf16",)):
        builds.append(("avx512 without vdpbf16ps", "-mno-avx512bf16"))  # pair products by two FMAs
    features = ((0, 0.0, False), (21, 0.0, False), (0, 30.0, True))  # window, softcap, sinks
    outs, libraries = {}, set()
    try:
        for name, flags in builds:
            monkeypatch.setenv("PAGEDINFER_CC_FLAGS", flags)
            paged_decode._library.cache_clear()
            library = paged_decode._library()
            assert library is not None, name
            libraries.add(library._name)
            torch.set_num_threads(2)
            for qdt, kvdt in BUILD_DTYPES:
                assert paged_decode.available(qdt, kvdt), (name, qdt, kvdt)
                for shape in BUILD_SHAPES:
                    for feature in features:
                        out, q, kc, vc, meta, sinks = _rows_through_kernel(*shape, qdt, kvdt, *feature)
                        outs[name, qdt, kvdt, shape, feature] = out
                        if name == "avx2" and qdt == torch.float32:
                            window, softcap, _ = feature
                            check_sequences(out, q, kc, vc, meta, shape[2] ** -0.5, window, softcap, sinks)
    finally:
        paged_decode._library.cache_clear()
    assert len(libraries) == len(builds)  # not one compared with itself
    for (name, *case), out in outs.items():
        assert torch.equal(outs[("avx512", *case)].view(torch.int16), out.view(torch.int16)), (name, *case)


def test_cpu_kernel_only_for_pools_in_host_memory_of_the_queries_dtype():
    """A pool on a device (a CUDA run without CuPy takes the torch path) must never reach the C kernel;
    float32, bfloat16 and float16 pools do, with queries of their own dtype or float32 ones
    (--kv-cache-dtype), never 16-bit queries over a wider or other pool."""
    if not paged_decode.available():
        pytest.fail("the CPU kernel did not build (is a C compiler installed?)")
    q, k, v = torch.empty(3, 8, 64), torch.empty(3, 2, 64), torch.empty(3, 2, 64)
    assert use_cpu_kernel(q, k, v, torch.empty(4, 16, 2, 64))
    assert not use_cpu_kernel(q, k, v, torch.empty(4, 16, 2, 64, device="meta"))
    for dtype in (torch.bfloat16, torch.float16):
        half = q.to(dtype), k.to(dtype), v.to(dtype)
        assert use_cpu_kernel(*half, torch.empty(4, 16, 2, 64, dtype=dtype)) == paged_decode.available(dtype)
        assert use_cpu_kernel(q, k, v, torch.empty(4, 16, 2, 64, dtype=dtype)) == paged_decode.available(
            torch.float32, dtype
        )
        assert not use_cpu_kernel(*half, torch.empty(4, 16, 2, 64))  # 16-bit queries over float32
    assert not use_cpu_kernel(q.half(), k.half(), v.half(), torch.empty(4, 16, 2, 64, dtype=torch.bfloat16))
    assert not use_cpu_kernel(q.double(), k, v, torch.empty(4, 16, 2, 64, dtype=torch.float64))
    assert not use_cpu_kernel(q[..., :60], k[..., :60], v, torch.empty(4, 16, 2, 60))  # head size 60: not 8k
