"""GGUF tensors kept in their types: the panels hold the file's blocks, dequantize them bit for bit as
gguf-py does, and multiply exactly as the float32 panels on the dequantized weights at every row
count, so a run on a GGUF file equals a float32 run of its dequantized weights token for token (and
logprob for logprob), through the one-call decode step; tensors of other types are dequantized with
a one-line note."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers as tf
from cli_helpers import invoke
from conftest import DEVICE, ENGINE
from gguf_models import quantize_k, save_gguf
from models import count_one_call_steps
from torch import nn

from pagedinfer import LLM, SamplingParams
from pagedinfer.kernels.build import cpu_flags
from pagedinfer.model import gguf_blocks, packed_linear, panel_cache, panel_formats
from pagedinfer.model.fused_ops import GatedLinear
from pagedinfer.model.loader import ModelLoadError

pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="the panels run on the CPU")

TYPES = list(gguf_blocks.BLOCKS)  # Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, MXFP4
REPO = Path(__file__).resolve().parents[1]


def blocks(w: np.ndarray, kind: str) -> np.ndarray:
    """``w [rows, in]`` as GGUF blocks of ``kind`` (gguf-py's quantizer, or tests/gguf_models.py's for K-quants)."""
    if kind in ("Q4_K", "Q5_K", "Q6_K"):
        return quantize_k(w, kind)
    return gguf.quants.quantize(w, getattr(gguf.GGMLQuantizationType, kind))


def dequantize(data: np.ndarray, kind: str) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(data, getattr(gguf.GGMLQuantizationType, kind)).copy())


@pytest.mark.parametrize("kind", TYPES)
def test_panels_dequantize_as_gguf_py(kind):
    """The weights the kernels multiply by (read back from the panels) equal gguf-py's dequantization, bits
    and all, for every type, also with float16 scales that are subnormal or zero."""
    rng = np.random.default_rng(7)
    w = (rng.standard_normal((40, 512)) * rng.random((40, 1)) * 4).astype(np.float32)
    w[3] = 0.0  # an all-zero row: zero scales
    w[5] *= 1e-6  # tiny scales: float16 subnormals
    data = blocks(w, kind)
    segment = packed_linear.gguf_segment([gguf_blocks.GGUFWeight(kind, data, 512)], None, gated=False)
    assert segment.panels.shape[1] == packed_linear._gemm_library().gemm_panel_bytes(
        packed_linear.KINDS[kind], 512, 0
    )
    got, want = packed_linear.dequantized(segment), dequantize(data, kind)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


MXFP4_VALUES = (0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6)  # E2M1, by stored nibble


def mxfp4_blocks(exponents: list[int]) -> np.ndarray:
    """One MXFP4 block per exponent byte ``[blocks, 17]``: byte j of its 16 holds nibble j low and
    15 - j high (weight j, weight 16 + j), so each block holds every one of the 16 values twice."""
    j = np.arange(16, dtype=np.uint8)
    return np.array([[e, *(j | (15 - j) << 4)] for e in exponents], np.uint8)


def test_mxfp4_dequantizes_as_llama_cpp():
    """Hand-built MXFP4 blocks (GGML type 39: an E8M0 byte, then 16 bytes of two E2M1 nibbles) read
    as llama.cpp's dequantize_row_mxfp4 reads them: weight j of a block is E2M1's value of nibble j
    of the low nibbles, then of the high ones, times 2^(e - 127) (ggml_e8m0_to_fp32_half of the
    doubled values), the exponent's extremes included: subnormal scales at e 0 and 1 (2^-128,
    2^-127), and past float32's range at e 254 and 255 (infinite weights, as llama.cpp gives them;
    e 255 is a number there, not NaN). The dequantizer the loader uses (gguf-py's) and the weights
    read back from the panels give those values bit for bit."""
    exponents = [0, 1, 2, 3, 100, 126, 127, 128, 200, 252, 253, 254, 255]
    data = mxfp4_blocks(exponents).reshape(1, -1)  # [1 row, 13 blocks * 17 bytes]
    nibbles = [*range(16), *range(15, -1, -1)]  # weight j's nibble in each block
    with np.errstate(over="ignore"):
        want = np.array(
            [[MXFP4_VALUES[q] * 2.0 ** (e - 127) for e in exponents for q in nibbles]], np.float64
        ).astype(np.float32)  # every finite value is exact in float32: no rounding in the cast
    assert want[0, 32 * exponents.index(0) + 1] == np.float32(2.0**-128)  # a subnormal scale
    assert np.isinf(want[0, 32 * exponents.index(255) + 7]) and np.isfinite(want[0, : 32 * 9]).all()
    want = torch.from_numpy(want)
    assert torch.equal(dequantize(data, "MXFP4").view(torch.int32).reshape(1, -1), want.view(torch.int32))
    assert torch.equal(
        torch.from_numpy(gguf_blocks_dequantized(data)).view(torch.int32), want.view(torch.int32)
    )
    rows = np.repeat(data, 16, axis=0)  # one panel's 16 rows
    segment = packed_linear.gguf_segment([gguf_blocks.GGUFWeight("MXFP4", rows, 32 * 13)], None, False)
    got = packed_linear.dequantized(segment)
    assert torch.equal(got.view(torch.int32), want.expand(16, -1).view(torch.int32))


def gguf_blocks_dequantized(data: np.ndarray) -> np.ndarray:
    """The loader's own dequantization of a tensor it does not keep as stored (`gguf._dequantized`)."""
    from pagedinfer.model import gguf as gguf_reader

    return gguf_reader._dequantized(data.reshape(-1), "MXFP4").reshape(data.shape[0], -1)


def test_mxfp4_products_at_the_exponent_extremes_equal_the_float32_panels():
    """Subnormal and large scales in one weight (finite products): the MXFP4 panels' products equal
    the float32 panels' over the dequantized weight at every tile shape."""
    rng = np.random.default_rng(9)
    n, k = 40, 256
    exponents = rng.choice([0, 1, 2, 60, 127, 128, 150, 180], size=n * k // 32)
    data = np.concatenate(
        [mxfp4_blocks(exponents.tolist())[:, :1], rng.integers(0, 256, (n * k // 32, 16), np.uint8)], axis=1
    ).reshape(n, -1)
    lin = nn.Linear(k, n, bias=False)
    lin.weight.data = dequantize(data, "MXFP4").reshape(n, k)
    float32 = packed_linear.PackedLinear(lin, panels=True)
    quant = packed_linear.gguf_linear([gguf_blocks.GGUFWeight("MXFP4", data, k)], [None], False)
    for rows in ROWS:
        x = torch.randn(rows, k)
        assert torch.equal(quant(x), float32(x)), f"{rows} rows"


# past 12 rows the first row block converts into a buffer (the AVX2 build: row blocks of 6 to 16 rows)
ROWS = (*range(1, 14), 16, 17, 20, 24, 33, 64, 300)


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_products_equal_the_float32_panels_on_the_dequantized_weight(kind, gated):
    """Every tile shape (1 row by four panels, 2-3 rows by two, up to 12 rows in registers; more: the
    first row block converting in registers into a buffer that the float32 tiles of the other rows
    read), a partial last panel (n = 72), a bias, SiLU x up: the same bits as cpu_gemm.c's float32
    panels holding the dequantized weights."""
    rng = np.random.default_rng(3)
    n, k = 72, 512
    w = rng.standard_normal((n, k)).astype(np.float32)
    data = blocks(w, kind)
    bias = torch.randn(n)
    lin = (GatedLinear if gated else nn.Linear)(k, n)
    lin.weight.data, lin.bias.data = dequantize(data, kind), bias
    float32 = packed_linear.PackedLinear(lin, panels=True)
    quant = packed_linear.gguf_linear([gguf_blocks.GGUFWeight(kind, data, k)], [bias], gated)
    assert quant.kinds == [kind] and (quant.paired if gated else True)
    for rows in ROWS:
        x = torch.randn(rows, k)
        assert torch.equal(quant(x), float32(x)), f"{rows} rows"


def test_mixed_parts_become_segments():
    """A QKV of three types is three segments writing their columns; a gate and an up of two types are
    two segments multiplied apart, then SiLU x up: the float32 products either way."""
    rng = np.random.default_rng(5)
    torch.manual_seed(5)
    k = 256
    parts = {"Q4_K": 64, "Q6_K": 32, "Q8_0": 32}
    data = {
        kind: blocks(rng.standard_normal((rows, k)).astype(np.float32), kind) for kind, rows in parts.items()
    }
    qkv = packed_linear.gguf_linear(
        [gguf_blocks.GGUFWeight(kind, d, k) for kind, d in data.items()], [None] * 3, gated=False
    )
    assert qkv.kinds == ["Q4_K", "Q6_K", "Q8_0"]
    full = torch.cat([dequantize(d, kind) for kind, d in data.items()])  # [128, k]
    lin = nn.Linear(k, 128, bias=False)
    lin.weight.data = full
    ref = packed_linear.PackedLinear(lin, panels=True)
    gate, up = (blocks(rng.standard_normal((48, k)).astype(np.float32), kind) for kind in ("Q4_K", "Q5_K"))
    gated = packed_linear.gguf_linear(
        [gguf_blocks.GGUFWeight("Q4_K", gate, k), gguf_blocks.GGUFWeight("Q5_K", up, k)],
        [None, None],
        gated=True,
    )
    assert gated.kinds == ["Q4_K", "Q5_K"] and not gated.paired
    glin = GatedLinear(k, 96, bias=False)
    glin.weight.data = torch.cat([dequantize(gate, "Q4_K"), dequantize(up, "Q5_K")])
    gref = packed_linear.PackedLinear(glin, panels=True)
    for rows in (1, 3, 13, 64):
        x = torch.randn(rows, k)
        assert torch.equal(qkv(x), ref(x))
        # against the exact products (float64): a 256-term float32 sum of terms ~1 is off by ~1e-5, and
        # SiLU(gate) x up (each ~16) scales that to ~1e-4; a wrong formula or block is off by ~1 or more.
        # (torch's float32 products, summed in another order by MKL on an AMD Zen 5, were 2e-4 apart.)
        y = x.double() @ glin.weight.double().T
        torch.testing.assert_close(
            gated(x).double(), torch.nn.functional.silu(y[:, :48]) * y[:, 48:], rtol=1e-4, atol=1e-3
        )
        torch.testing.assert_close(gated(x), gref(x), rtol=1e-6, atol=1e-6)


def test_the_avx2_build_gives_the_same_bits(tmp_path):
    """The kernels built without AVX-512 (two 8-float halves per panel row) give the AVX-512 build's
    products bit for bit for every type and tile shape (each lane computes the same float32 steps), plain
    and gated with a bias (the AVX2 half tiles of 7 to 11 rows leave the gate in y between halves)."""
    if not cpu_flags(("avx512f",)):
        pytest.skip("this CPU has no AVX-512: the suite's kernels are the AVX2 build already")
    script = tmp_path / "products.py"
    script.write_text(
        f"""
import sys, numpy as np, torch
sys.path.insert(0, {str(REPO / "tests")!r})
from test_gguf_types import TYPES, blocks
from pagedinfer.config import QUANTIZATIONS
from pagedinfer.model import gguf_blocks, packed_linear, panel_cache, panel_formats
from pagedinfer.model.fused_ops import GatedLinear
out = {{}}
rng = np.random.default_rng(11)
for kind in TYPES + ["int8", "int4", "int4-g128-zp"]:
    for gated in (False, True):  # gated: paired gate-up panels with a bias, silu(gate) * up
        w = torch.from_numpy(rng.standard_normal((40, 512)).astype(np.float32))
        bias = torch.from_numpy(rng.standard_normal(40).astype(np.float32)) if gated else None
        if kind.startswith("int"):
            lin = (GatedLinear if gated else torch.nn.Linear)(512, 40, bias=gated)
            lin.weight.data = w
            if gated:
                lin.bias.data = bias
            q = packed_linear.PackedLinear(lin, quantization=QUANTIZATIONS[kind])
        else:
            parts = [gguf_blocks.GGUFWeight(kind, blocks(h.numpy(), kind), 512) for h in w.split(20 if gated else 40)]
            q = packed_linear.gguf_linear(parts, list(bias.split(20)) if gated else [None], gated)
        torch.manual_seed(0)
        out[kind, gated] = [q(torch.randn(rows, 512)) for rows in (1, 2, 3, 5, 6, 7, 8, 9, 11, 12, 13, 15, 16, 20, 40)]
torch.save(out, sys.argv[1])
"""
    )
    results = {}
    for name, flags in (("avx512", ""), ("avx2", "-mno-avx512f")):
        env = {"PAGEDINFER_CC_FLAGS": flags, "PYTHONPATH": str(REPO)}
        path = tmp_path / f"{name}.pt"
        run = subprocess.run(
            [sys.executable, str(script), str(path)],
            env={**__import__("os").environ, **env},
            capture_output=True,
        )
        assert run.returncode == 0, run.stderr.decode()[-2000:]
        results[name] = torch.load(path)
    for kind, outs in results["avx512"].items():
        assert all(torch.equal(a, b) for a, b in zip(outs, results["avx2"][kind], strict=True)), kind


# -- whole models ------------------------------------------------------------------------------

# K-quants need rows of 256 inputs: hidden 256, intermediate 512, head size 64 (the C decode kernel's)
SHAPE = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    vocab_size=512,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
    initializer_range=0.2,
)


def random_model(gguf_dir: Path, arch: str, tied: bool) -> Path:
    path = gguf_dir / f"{arch}-{'tied' if tied else 'untied'}"
    if not (path / "config.json").exists():
        cls = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config}[arch]
        torch.manual_seed(0)
        tf.AutoModelForCausalLM.from_config(cls(**SHAPE, tie_word_embeddings=tied)).save_pretrained(path)
    return path


def gguf_file(gguf_dir: Path, arch: str, tied: bool, kind_of, tag: str) -> Path:
    out = gguf_dir / f"{arch}-{'tied' if tied else 'untied'}-{tag}.gguf"
    if not out.exists():
        save_gguf(random_model(gguf_dir, arch, tied), out, kind_of)
    return out


PROMPTS = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (4, 9, 17, 30)]


def run(path: Path, monkeypatch, **kw) -> tuple[list, int]:
    """Seeded n=2 completions with logprobs (and the number of one-call decode steps taken)."""
    steps = count_one_call_steps(monkeypatch)
    params = SamplingParams(n=2, temperature=0.9, seed=5, max_tokens=12, logprobs=2, ignore_eos=True)
    llm = LLM(str(path), block_size=4, num_blocks=128, **{**ENGINE, "dtype": "auto", **kw})
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [[(c.token_ids, c.logprobs) for c in o.outputs] for o in outs], len(steps), llm


@pytest.mark.parametrize("kind", TYPES)
def test_a_gguf_run_equals_the_float32_run_of_its_dequantized_weights(kind, gguf_dir, monkeypatch, capfd):
    """Every linear and the tied embedding in ``kind``: the quantized run (one-call decode steps in that
    type) equals ``--dtype float32`` on the same file (gguf-py's dequantization in float32 panels)."""
    path = gguf_file(gguf_dir, "llama", True, lambda name: kind, kind)
    got, steps, llm = run(path, monkeypatch)
    model = llm.engine.loaded.model
    assert model.layers[0].qkv_proj.kinds == [kind] and model.lm_head.kinds == [kind]
    assert isinstance(model.embed_tokens, packed_linear.PanelEmbedding)
    assert (
        llm.engine.loaded.dtype_reason == f"float32 activations; weights as stored in the GGUF ({kind} x15)"
    )
    assert steps > 0
    want, _, ref = run(path, monkeypatch, dtype="float32")
    assert ref.engine.loaded.model.layers[0].qkv_proj.kinds == ["F32"]
    assert got == want
    assert "dequantized" not in capfd.readouterr().err


def test_mixed_types_untied_qwen2_with_a_float16_tensor(gguf_dir, monkeypatch, capfd):
    """A Q4_K_M-like mix on qwen2 (biases on q/k/v): q, k Q4_K; v, down Q6_K; gate Q4_K, up Q5_K; the
    output projection float16 (dequantized, with its one-line note); an untied Q8_0 lm_head."""
    mix = {"attn_v": "Q6_K", "ffn_down": "Q6_K", "ffn_up": "Q5_K", "attn_output": "F16", "output.": "Q8_0"}

    def kind_of(name: str) -> str:
        return next((k for part, k in mix.items() if part in name), "Q4_K")

    path = gguf_file(gguf_dir, "qwen2", False, kind_of, "mix")
    got, _, llm = run(path, monkeypatch)
    err = capfd.readouterr().err
    assert f"pagedinfer: {path.name}: tensors of types the panels do not keep (2 F16) are dequantized" in err
    layer = llm.engine.loaded.model.layers[0]
    assert layer.qkv_proj.kinds == ["Q4_K", "Q6_K"] and layer.gate_up_proj.kinds == ["Q4_K", "Q5_K"]
    assert layer.o_proj.kinds == ["F32"] and llm.engine.loaded.model.lm_head.kinds == ["Q8_0"]
    want, _, _ = run(path, monkeypatch, dtype="float32")
    assert got == want


def test_the_float32_run_equals_transformers_on_the_same_file(gguf_dir):
    """Our reading of a llama GGUF (names, the Q/K row order) agrees with transformers' GGUF loader:
    greedy tokens equal to ``generate`` on the file it dequantizes."""
    path = gguf_file(gguf_dir, "llama", False, lambda name: "Q8_0", "q8")
    hf = tf.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    prompt = [5, 17, 99, 3, 42]
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, pad_token_id=0)[
        0, 5:
    ].tolist()
    llm = LLM(str(path), **{**ENGINE, "dtype": "auto"})
    got = llm.generate(
        {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False
    )
    assert got[0].outputs[0].token_ids == want


def test_a_second_load_reads_the_cache(gguf_dir, tmp_path, monkeypatch):
    """The first load fills a cache folder named by the file's hash; the second reads it, without parsing
    the GGUF's metadata again."""
    monkeypatch.setenv("PAGEDINFER_GGUF_CACHE", str(tmp_path / "cache"))
    path = gguf_file(gguf_dir, "llama", True, lambda name: "Q4_0", "Q4_0")
    LLM(str(path), **{**ENGINE, "dtype": "auto"})
    (folder,) = (tmp_path / "cache").glob("*-v*")  # (beside digests/: `gguf._known_digest`)
    assert {"config.json", "generation_config.json", "tensors.json"} <= {f.name for f in folder.iterdir()}
    monkeypatch.setattr(gguf.GGUFReader, "__init__", lambda *a, **k: pytest.fail("parsed the file again"))
    LLM(str(path), **{**ENGINE, "dtype": "auto"})


def _damaged(good: bytes) -> dict[str, bytes]:
    """A panel cache file's bytes spoilt each way a load must survive (the index is JSON after the head)."""
    head, index_bytes = panel_cache.HEAD.size, panel_cache.HEAD.unpack(good[: panel_cache.HEAD.size])[1]
    index = good[head : head + index_bytes].decode()
    first = re.search(r'"([^"]+)": \[0, (\d+),', index)  # the first weight's name and panel count
    renamed = index.replace(first.group(1), first.group(1)[:-1] + "X", 1)
    panels = str(int(first.group(2)) - 1).rjust(len(first.group(2)))
    reshaped = index.replace(f"[0, {first.group(2)},", f"[0, {panels},", 1)
    noise = np.random.default_rng(0).integers(0, 256, len(good), dtype=np.uint8).tobytes()
    return {
        "truncated": good[:-100],
        "grown": good + bytes(64),
        "magic": b"X" + good[1:],
        "entry-missing": good[:head] + renamed.encode() + good[head + index_bytes :],
        "entry-of-another-size": good[:head] + reshaped.encode() + good[head + index_bytes :],
        "noise": noise,
        "empty": b"",
    }


def test_the_panels_are_read_back_and_a_damaged_cache_is_packed_again(gguf_dir, tmp_path, monkeypatch):
    """The first load packs the blocks and keeps the panels in the file's cache folder; the next packs
    nothing and gives the same tokens. A panel file truncated, grown, with another magic, an entry
    missing or of another size, or noise, is packed again where it fails (same tokens) and rewritten as
    the first load wrote it, in place of another version's file."""
    monkeypatch.setenv("PAGEDINFER_GGUF_CACHE", str(tmp_path / "cache"))
    path = gguf_file(gguf_dir, "llama", True, lambda name: "Q4_1", "Q4_1")
    packs: list[str] = []
    pack = panel_formats.pack_records
    monkeypatch.setattr(
        panel_formats, "pack_records", lambda kind, *a, **k: packs.append(kind) or pack(kind, *a, **k)
    )
    want, _, _ = run(path, monkeypatch)
    assert packs == ["Q4_1"] * 9  # the embedding (the tied lm_head's too), then qkv, o, gate_up, down x2
    (cached,) = (tmp_path / "cache").glob("*/panels-*.bin")
    good = cached.read_bytes()
    packs.clear()
    got, _, _ = run(path, monkeypatch)
    assert got == want and packs == []
    stale = cached.with_name("panels-of-another-version.bin")
    stale.write_bytes(good)
    for how, content in _damaged(good).items():
        spoilt = cached.with_name("spoilt")  # renamed over it: an earlier run may still map the file
        spoilt.write_bytes(content)
        spoilt.replace(cached)
        packs.clear()
        got, _, _ = run(path, monkeypatch)
        assert got == want, how
        assert len(packs) == (1 if how.startswith("entry") else 9), how
        assert cached.read_bytes() == good, how
    assert not stale.exists()  # one panel file per GGUF file: the last packing's


@pytest.mark.parametrize(
    "content,message",
    [
        (b"not a gguf at all", "is not a GGUF file: it does not start with the GGUF magic bytes"),
        (b"GGUF\x03\x00\x00\x00" + b"\xff" * 40, "is not a valid GGUF file: "),
    ],
    ids=["no-magic", "garbage-header"],
)
def test_a_corrupt_gguf_is_one_line_naming_the_file(tmp_path, monkeypatch, content, message):
    monkeypatch.setenv("PAGEDINFER_GGUF_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content)
    with pytest.raises(ModelLoadError) as err:
        LLM(str(bad), **ENGINE)
    assert str(err.value).startswith(f"{bad} {message}") and "\n" not in str(err.value)


def test_a_truncated_gguf_names_the_tensor(gguf_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDINFER_GGUF_CACHE", str(tmp_path / "cache"))
    good = gguf_file(gguf_dir, "llama", True, lambda name: "Q4_0", "Q4_0")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(ModelLoadError) as err:
        LLM(str(cut), **ENGINE)
    size = cut.stat().st_size
    t = next(t for t in gguf.GGUFReader(good).tensors if t.data_offset + t.n_bytes > size)  # the first cut
    shape = ", ".join(f"{d:,}" for d in reversed(t.shape.tolist()))
    assert str(err.value) == (
        f"{cut} is not a valid GGUF file: its tensor data is cut short at {size:,} bytes: tensor {t.name!r} "
        f"[{shape}] Q4_0 needs bytes {t.data_offset:,} to {t.data_offset + t.n_bytes:,} (a truncated download?)"
    )


def test_the_report_states_the_weights_bytes_and_bits_per_weight(gguf_dir, tmp_path):
    """Q4_0 keeps 18 bytes per 32 weights: 4.5 bits per linear weight, the tied embedding's panels counted
    once; the same file dequantized holds 32 bits per weight (and the embedding beside its packed copy)."""
    path = gguf_file(gguf_dir, "llama", True, lambda name: "Q4_0", "Q4_0")
    src = tmp_path / "p.jsonl"
    src.write_text('{"prompt_token_ids": [3, 4, 5], "max_tokens": 2}\n')
    docs = {}
    for dtype in ("auto", "float32"):
        report = tmp_path / f"{dtype}.json"
        args = ["run", src, "--model", path, "--device", "cpu", "--dtype", dtype]
        args += ["-o", tmp_path / f"{dtype}.out.jsonl", "--report-json", report]
        result = invoke(*args, env={"COLUMNS": "200"})
        assert result.exit_code == 0, result.output[-2000:]
        docs[dtype] = (json.loads(report.read_text())["model"], result.stdout)
    (quant, text), (plain, _) = docs["auto"], docs["float32"]
    h, i, v, layers = 256, 512, 512, 2
    linear = (
        layers * ((h + 2 * 128) * h + h * h + 2 * i * h + i * h) + v * h
    )  # q/k/v/o, gate/up, down, lm_head
    norms = 4 * (2 * layers + 1) * h
    rope = 2 * 4 * 64 // 2  # RoPE's inv_freq and original_inv_freq buffers
    assert quant["linear_bits_per_weight"] == 4.5
    assert quant["weight_bytes"] == linear * 9 // 16 + norms + rope  # 4.5 bits, the tied table once
    assert plain["linear_bits_per_weight"] == 32.0
    assert "Weights" in text and "4.50 bits per linear weight" in text
