"""``--matmul-numerics llama.cpp``: GGUF Q4_0, Q4_1 and Q8_0 weights times activations quantized per block of
32 to int8 (kernels/cpu_gemm_q8dot.h). The kernel equals a numpy model of the same integer math bit for
bit, every build gives the same bits, an engine run is batch-invariant and close to the exact
numerics, and the option is refused where it cannot apply."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import DEVICE
from test_gguf_types import PROMPTS, blocks, gguf_file
from torch import nn

from pagedinfer import LLM, SamplingParams
from pagedinfer.engine import fingerprint
from pagedinfer.model import gguf_blocks, packed_linear
from pagedinfer.model.loader import ModelLoadError

pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="the panels run on the CPU")

KINDS = packed_linear.Q8_DOT_KINDS
REPO = Path(__file__).resolve().parents[1]
ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 13, 17, 300)  # every tile size and tails past them
PORTABLE = "-mno-avx -mno-f16c"  # the kernels' portable C (cpu_gemm_q8dot.h's scalar loop)


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 fma(a, b, c), rounded once: a * b is exact in float64, the sum's error is kept exactly
    (TwoSum) and decides the float32 rounding where the float64 sum falls on a float32 tie."""
    p, c64 = a.astype(np.float64) * b.astype(np.float64), c.astype(np.float64)
    s = p + c64
    t = s - p
    err = (p - (s - t)) + (c64 - t)
    r = s.astype(np.float32)
    other = np.nextafter(r, np.where(s > r, np.float32(np.inf), np.float32(-np.inf)))
    tie = (s != r) & (np.abs(s - r) == np.abs(other.astype(np.float64) - s))
    toward = np.sign(err) == np.sign(other.astype(np.float64) - r)
    return np.where(tie & (err != 0) & toward, other, r)


def reference(data: np.ndarray, kind: str, x: np.ndarray) -> np.ndarray:
    """``x [m, k] @ W^T`` as llama.cpp's numerics define it, in numpy: W's GGUF blocks ``data`` as
    integers and float16 scales (and mins), each row of x as quantize_row_q8_0 / q8_1 makes it (roundf:
    half away from zero; q8_1's s = float16(sum(q) * d)), integer block sums, then
    acc = fma(d_w * d_x, isum, acc) block by block, and for Q4_1 acc = fma(m_w, s_x, acc) after it."""
    m, k = x.shape
    nb = k // 32
    blk = data.reshape(data.shape[0], nb, -1)  # [n, nb, bytes]
    dw = blk[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)  # [n, nb]
    head = 4 if kind == "Q4_1" else 2
    qs = blk[..., head:]
    if kind == "Q8_0":
        w = qs.copy().view(np.int8).astype(np.int64)  # [n, nb, 32]
    else:
        w = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.int64) - (8 if kind == "Q4_0" else 0)
    xb = x.reshape(m, nb, 32).astype(np.float32)
    d = np.abs(xb).max(-1) / np.float32(127)  # [m, nb] float32
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, np.float32(1)), np.float32(0)).astype(
        np.float32
    )
    v = xb * inv[..., None]  # float32 products
    q = (np.sign(v) * np.floor(np.abs(v).astype(np.float64) + 0.5)).astype(np.int64)
    dx = d.astype(np.float16).astype(np.float32)
    isum = np.einsum("mbj,nbj->mnb", q, w)  # [m, n, nb] exact
    scale = dw[None] * dx[:, None]  # [m, n, nb] float32, exact (float16 values)
    acc = np.zeros(isum.shape[:2], dtype=np.float32)
    if kind == "Q4_1":
        mw = blk[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)  # [n, nb]
        xs = (q.sum(-1).astype(np.float32) * d).astype(np.float16).astype(np.float32)  # [m, nb]
    for b in range(nb):
        acc = fma32(scale[..., b], isum[..., b].astype(np.float32), acc)
        if kind == "Q4_1":
            acc = fma32(mw[None, :, b], xs[:, None, b], acc)
    return acc


def llamacpp_linear(data: np.ndarray, kind: str, k: int, bias: torch.Tensor | None, gated: bool):
    linear = packed_linear.gguf_linear([gguf_blocks.GGUFWeight(kind, data, k)], [bias], gated)
    assert packed_linear.use_llamacpp_numerics(nn.Sequential(linear)) == 1
    return linear


@pytest.mark.parametrize("kind", KINDS)
def test_the_kernel_equals_the_integer_math_in_numpy(kind):
    """Every row count (a row's outputs are its own: each row's equal the reference of that row alone),
    a partial last panel (n = 72), a bias added after the sums, a zero row (zero scales), a row whose
    values sit on roundf's ties, a gated linear's silu(gate) * up close to the reference's."""
    rng = np.random.default_rng(11)
    n, k = 72, 512
    w = rng.standard_normal((n, k)).astype(np.float32)
    data = blocks(w, kind)
    bias = torch.randn(n)
    linear = llamacpp_linear(data, kind, k, bias, gated=False)
    plain = llamacpp_linear(data, kind, k, None, gated=False)
    for rows in ROWS:
        x = torch.randn(rows, k) * torch.rand(rows, 1) * 3
        x[0, :32] = 0.0
        if rows > 1:  # x / d = k + 0.5 exactly: amax 127, the other values halves
            x[1, :32] = torch.arange(32) - 15.5
            x[1, 0] = 127.0
        want = reference(data, kind, x.numpy())
        assert torch.equal(plain(x), torch.from_numpy(want)), f"{rows} rows"
        assert torch.equal(linear(x), torch.from_numpy(want) + bias), f"{rows} rows, bias"
    gated = llamacpp_linear(data, kind, k, None, gated=True)
    x = torch.randn(5, k)
    sums = torch.from_numpy(reference(data, kind, x.numpy()))
    assert torch.allclose(gated(x), nn.functional.silu(sums[:, :36]) * sums[:, 36:], rtol=1e-5, atol=1e-6)


def test_every_build_gives_the_same_bits(tmp_path):
    """The AVX-512 build (vpdpbusd), the AVX2 builds with AVX-VNNI and without (vpmaddubsw + vpsignb) and
    the portable loop (a build without AVX) give the same bits, at every row count (the portable build's
    gated outputs aside: its SiLU, outside the contract, rounds otherwise)."""
    flags = packed_linear.cpu_flags(("avx512f", "avx512_vnni", "avx_vnni", "avx2"))
    builds = ["", "-mno-avx512f -mno-avxvnni", PORTABLE]
    if "avx_vnni" in flags:
        builds.insert(1, "-mno-avx512f")
    if "avx2" not in flags:
        pytest.skip("this CPU has no AVX2: only the portable build runs here")
    script = tmp_path / "bits.py"
    script.write_text(
        """
import sys, numpy as np, torch
sys.path.insert(0, sys.argv[2])
from test_gguf_types import blocks
from test_matmul_numerics import llamacpp_linear, KINDS, ROWS
rng = np.random.default_rng(5)
torch.manual_seed(5)
out = {}
for kind in KINDS:
    for n, k, gated in ((72, 512, False), (40, 96, True)):
        data = blocks(rng.standard_normal((n, k)).astype(np.float32), kind)
        linear = llamacpp_linear(data, kind, k, torch.randn(n), gated)
        for rows in ROWS:
            out[kind, n, rows] = linear(torch.randn(rows, k) * 2)
torch.save(out, sys.argv[1])
"""
    )
    results = {}
    for build in builds:
        path = tmp_path / f"bits{build.replace(' ', '')}.pt"
        env = {**os.environ, "PAGEDINFER_CC_FLAGS": build, "PYTHONPATH": str(REPO)}
        run = subprocess.run(
            [sys.executable, str(script), str(path), str(REPO / "tests")], env=env, capture_output=True
        )
        assert run.returncode == 0, run.stderr.decode()[-2000:]
        results[build] = torch.load(path)
    first = results[builds[0]]
    for build in builds[1:]:
        # the portable build's SiLU (no AVX2 and FMA: outside the contract) rounds otherwise: its plain products
        keys = [key for key in first if key[1] == 72 or build != PORTABLE]
        differ = [key for key in keys if not torch.equal(first[key], results[build][key])]
        assert keys and not differ, f"{build}: {differ[:5]}"


def generate(llm: LLM, prompts: list, **params) -> list:
    outs = llm.generate(
        prompts, SamplingParams(max_tokens=10, logprobs=2, ignore_eos=True, **params), use_tqdm=False
    )
    return [[(c.token_ids, c.logprobs) for c in o.outputs] for o in outs]


@pytest.mark.parametrize("kind", KINDS)
def test_an_engine_run_is_batch_invariant_and_close_to_exact(kind, gguf_dir):
    """Every linear and the tied lm_head in ``kind`` under llama.cpp's numerics (prefill rows and the
    one-call decode steps): each prompt alone and all in one batch give the same tokens and logprobs;
    the report names the numerics; each prompt's 5 likeliest first tokens are the exact numerics', their
    logprobs close to theirs, not equal."""
    path = gguf_file(gguf_dir, "llama", True, lambda name: kind, kind)
    llm = LLM(str(path), block_size=4, num_blocks=128, device="cpu", matmul_numerics="llama.cpp")
    model = llm.engine.loaded.model
    assert all(s.q8_dot for s in model.layers[0].qkv_proj.segments + model.lm_head.segments)
    sampled = dict(n=2, temperature=0.9, seed=5)
    together = generate(llm, PROMPTS, **sampled)
    alone = [generate(llm, [p], **sampled)[0] for p in PROMPTS]
    assert together == alone
    stats = llm.stats.to_dict()
    assert stats["model"]["matmul_numerics"] == "llama.cpp"
    assert f"panels:{kind} llama.cpp numerics" in fingerprint.components(llm.engine)["linears"]
    exact = LLM(str(path), block_size=4, num_blocks=128, device="cpu")
    first = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    ours, want = (
        [o.outputs[0].logprobs[0] for o in run.generate(PROMPTS, first, use_tqdm=False)]
        for run in (llm, exact)
    )
    assert exact.stats.to_dict()["model"]["matmul_numerics"] == "exact"
    # of the 5 likeliest first tokens at least 4 shared (Q4_1's float16 activation sums can swap the fifth
    # on this random model, whose likeliest are close), each close
    for got, ref in zip(ours, want, strict=True):
        shared = got.keys() & ref.keys()
        assert len(shared) >= 4, (got.keys(), ref.keys())
        gaps = [abs(got[t].logprob - ref[t].logprob) for t in shared]
        assert 0 < max(gaps) < 0.6, gaps  # not the exact numerics, close to them


@pytest.mark.parametrize(
    "kind, kw, message",
    [
        ("F32", {}, "matmul numerics llama.cpp applies to GGUF Q8_0, Q4_0, Q4_1 weights kept as stored"),
        ("Q4_K", {}, "has none: its packed linears are Q4_K"),
        ("Q4_0", {"dtype": "float32"}, "has none: its packed linears are F32"),
        (
            "Q4_0",
            {"dtype": "bfloat16"},
            "matmul numerics llama.cpp quantizes float32 activations; this run's are bfloat16",
        ),
        ("Q4_0", {"matmul_numerics": "fast"}, "unknown matmul numerics 'fast': use exact or llama.cpp"),
    ],
)
def test_the_option_is_refused_where_it_cannot_apply(kind, kw, message, gguf_dir):
    path = gguf_file(gguf_dir, "llama", True, lambda name: kind, kind)
    with pytest.raises(ModelLoadError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LLM(str(path), block_size=4, num_blocks=128, device="cpu", **{"matmul_numerics": "llama.cpp", **kw})
