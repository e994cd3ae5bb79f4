"""``--matmul-numerics llama.cpp``: GGUF Q4_0, Q4_1 and Q8_0 weights, and ``--quantization`` int8 / int4
ones, times activations quantized per block of 32 to int8 (kernels/cpu_gemm_q8dot.h). The kernel equals
a numpy model of the same integer math bit for bit, every build gives the same bits, an engine run is
batch-invariant and close to the exact numerics, and the option is refused where it cannot apply."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from conftest import DEVICE, ENGINE
from test_gguf_types import PROMPTS, blocks, gguf_file
from torch import nn

from pagedinfer import LLM, SamplingParams
from pagedinfer.config import QUANTIZATIONS
from pagedinfer.engine import fingerprint
from pagedinfer.kernels.build import cpu_flags
from pagedinfer.model import gguf_blocks, packed_linear, panel_formats
from pagedinfer.model.fused_ops import GatedLinear
from pagedinfer.model.loader import ModelLoadError

pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="the panels run on the CPU")

KINDS = ("Q8_0", "Q4_0", "Q4_1")  # the GGUF types it serves
OURS = ("int8", "int4", "int4-g128", "int4-zp", "int4-g128-zp")  # and the --quantization ones
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


def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each row of ``x [m, k]`` as quantize_row_q8_0 makes it: ``q [m, k / 32, 32]`` (roundf: half away
    from zero), ``d [m, k / 32]`` its float32 scale and ``dx`` that scale rounded to float16."""
    m, k = x.shape
    nb = k // 32
    xb = x.reshape(m, nb, 32).astype(np.float32)
    d = np.abs(xb).max(-1) / np.float32(127)  # [m, nb] float32
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, np.float32(1)), np.float32(0)).astype(
        np.float32
    )
    v = xb * inv[..., None]  # float32 products
    q = (np.sign(v) * np.floor(np.abs(v).astype(np.float64) + 0.5)).astype(np.int64)
    return q, d, d.astype(np.float16).astype(np.float32)


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
    q, d, dx = quantize_rows(x)
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


def ours_reference(w: np.ndarray, name: str, x: np.ndarray) -> np.ndarray:
    """``x [m, k] @ W^T`` for the float weight ``w [n, k]`` quantized as ``--quantization name`` under
    llama.cpp's numerics, in numpy: its integers minus their zero (int4's 8 or z), x quantized as for
    Q8_0, integer block sums, t = fma(d_x, isum, t) per group of the weight's scales (int8: all of k),
    then acc = fma(s_w, t, acc) group by group."""
    quant = QUANTIZATIONS[name]
    weight = torch.from_numpy(w)
    if quant.bits == 8:
        qw, scale = panel_formats.quantize_int8(weight)  # [n, k] int8, [n]
        group, ints, scale = w.shape[1], qw.numpy().astype(np.int64), scale.numpy()[:, None]
    else:
        qw, scale, zero = panel_formats.quantize_int4(weight, quant.group, quant.zero_points)
        group, scale = quant.group, scale.numpy()  # [n, groups]
        zeros = np.full(scale.shape, 8) if zero is None else zero.numpy().astype(np.int64)
        ints = qw.numpy().astype(np.int64) - np.repeat(zeros, group, axis=1)[:, : w.shape[1]]  # [n, k]
    m, k = x.shape
    q, _, dx = quantize_rows(x)
    isum = np.einsum("mbj,nbj->mnb", q, ints.reshape(ints.shape[0], k // 32, 32))  # [m, n, nb] exact
    t = acc = np.zeros(isum.shape[:2], dtype=np.float32)
    for b in range(k // 32):
        t = fma32(dx[:, None, b], isum[..., b].astype(np.float32), t)
        if (b + 1) * 32 % group == 0 or b == k // 32 - 1:
            acc, t = fma32(scale[None, :, b * 32 // group], t, acc), np.zeros_like(t)
    return acc


def ours_linear(w: np.ndarray, name: str, bias: torch.Tensor | None, gated: bool) -> nn.Module:
    """``w [n, k]`` (+ bias) as a ``--quantization name`` packed linear under llama.cpp's numerics."""
    lin = (GatedLinear if gated else nn.Linear)(w.shape[1], w.shape[0], bias=bias is not None)
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(w))
        if bias is not None:
            lin.bias.copy_(bias)
    linear = packed_linear.PackedLinear(lin, panels=True, quantization=QUANTIZATIONS[name])
    assert packed_linear.use_llamacpp_numerics(nn.Sequential(linear)) == 1
    return linear


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


@pytest.mark.parametrize("name", OURS)
def test_int8_and_int4_panels_equal_the_integer_math_in_numpy(name):
    """As above for our own panels: every row count, k = 480 (int4-g128's last group 96 long: its scale
    after 3 blocks), a partial last panel, a bias, a zero block, roundf's ties, a gated linear."""
    rng = np.random.default_rng(12)
    n, k = 72, 480
    w = rng.standard_normal((n, k)).astype(np.float32)
    w[3, 32:64] = 0  # an all-zero group: scale 1
    bias = torch.randn(n)
    linear, plain = ours_linear(w, name, bias, gated=False), ours_linear(w, name, None, gated=False)
    for rows in ROWS:
        x = torch.randn(rows, k) * torch.rand(rows, 1) * 3
        x[0, :32] = 0.0
        if rows > 1:
            x[1, :32] = torch.arange(32) - 15.5
            x[1, 0] = 127.0
        want = torch.from_numpy(ours_reference(w, name, x.numpy()))
        assert torch.equal(plain(x), want), f"{rows} rows"
        assert torch.equal(linear(x), want + bias), f"{rows} rows, bias"
    gated = ours_linear(w, name, None, gated=True)
    x = torch.randn(5, k)
    sums = torch.from_numpy(ours_reference(w, name, x.numpy()))
    assert torch.allclose(gated(x), nn.functional.silu(sums[:, :36]) * sums[:, 36:], rtol=1e-5, atol=1e-6)


def test_every_build_gives_the_same_bits(tmp_path):
    """The AVX-512 build (vpdpbusd), the AVX2 builds with AVX-VNNI and without (vpmaddubsw + vpsignb) and
    the portable loop (a build without AVX) give the same bits, at every row count (the portable build's
    gated outputs aside: its SiLU, outside the contract, rounds otherwise)."""
    flags = cpu_flags(("avx512f", "avx512_vnni", "avx_vnni", "avx2"))
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
from test_matmul_numerics import llamacpp_linear, ours_linear, KINDS, OURS, ROWS
rng = np.random.default_rng(5)
torch.manual_seed(5)
out = {}
for kind in KINDS + OURS:
    for n, k, gated in ((72, 480, False), (40, 96, True)):
        w = rng.standard_normal((n, k)).astype(np.float32)
        if kind in OURS:
            linear = ours_linear(w, kind, torch.randn(n), gated)
        else:
            linear = llamacpp_linear(blocks(w, kind), kind, k, torch.randn(n), gated)
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


@pytest.mark.parametrize("name", ["int8", "int4-g128-zp"])
def test_a_quantized_run_is_batch_invariant_and_close_to_exact(name, tiny_model):
    """``--quantization int8`` / ``int4`` under llama.cpp's numerics on every linear of a Llama (prefill rows
    and the one-call decode steps): greedy and sampled lines alone and all in one batch give the same
    tokens and logprobs; the report and the fingerprint name the numerics; the first tokens' logprobs are
    close to the exact numerics', not equal."""
    path = tiny_model("llama")
    llm = LLM(str(path), **ENGINE, quantization=name, matmul_numerics="llama.cpp")
    kind, label = ("I8", "I8") if name == "int8" else ("I4Z", "I4Z/g128")
    model = llm.engine.loaded.model
    assert model.layers[0].qkv_proj.kinds == [kind]
    assert all(s.q8_dot for s in model.layers[0].qkv_proj.segments + model.layers[0].down_proj.segments)
    for params in ({"temperature": 0.0}, {"n": 2, "temperature": 0.9, "seed": 5}):
        assert generate(llm, PROMPTS, **params) == [generate(llm, [p], **params)[0] for p in PROMPTS]
    assert llm.stats.to_dict()["model"]["matmul_numerics"] == "llama.cpp"
    assert fingerprint.components(llm.engine)["linears"] == [f"panels:{label} llama.cpp numerics"]
    exact = LLM(str(path), **ENGINE, quantization=name)
    first = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    ours, want = (
        [o.outputs[0].logprobs[0] for o in run.generate(PROMPTS, first, use_tqdm=False)]
        for run in (llm, exact)
    )
    for got, ref in zip(ours, want, strict=True):
        shared = got.keys() & ref.keys()
        assert len(shared) >= 4, (got.keys(), ref.keys())
        gaps = [abs(got[t].logprob - ref[t].logprob) for t in shared]
        assert 0 < max(gaps) < 0.6, gaps


def test_quantized_runs_are_refused_where_it_cannot_apply(tiny_model, model_root):
    """--quantization under bfloat16 activations, and input widths not a multiple of 32: one line each."""
    with pytest.raises(
        ModelLoadError, match="matmul numerics llama.cpp quantizes float32 activations; this run's"
    ):
        LLM(
            str(tiny_model("llama")),
            **{**ENGINE, "dtype": "bfloat16"},
            quantization="int8",
            matmul_numerics="llama.cpp",
        )
    narrow = model_root / "llama-width-40"
    if not narrow.exists():
        config = transformers.LlamaConfig(
            vocab_size=256, hidden_size=40, intermediate_size=72, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, head_dim=10, max_position_embeddings=128,
        )  # fmt: skip
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(narrow)
    message = (
        r"matmul numerics llama.cpp applies to GGUF Q8_0, Q4_0, Q4_1 weights kept as stored and to "
        r"--quantization int8 / int4 ones, with input widths a multiple of 32 \(--dtype auto, on the CPU\); "
        r".* has none: its packed linears are I4"
    )
    with pytest.raises(ModelLoadError, match=message):
        LLM(str(narrow), **ENGINE, quantization="int4", matmul_numerics="llama.cpp")


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
