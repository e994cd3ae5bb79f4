"""Quantized weights under bfloat16 activations (``--dtype bfloat16`` with a GGUF kept in its types, or
with ``--quantization int8 / int4``): each k pair of a quantized panel is converted into the bfloat16
pair panel's layout (with AVX512-BF16 in registers up to 8 rows, through a per-thread buffer past
them; through the buffer in a build without it) and multiplied by the same vdpbf16ps steps (native
or emulated) as a bfloat16 linear, so the products are those of a bfloat16 linear over the
dequantized weight rounded to bfloat16, bit for bit, at every row count; a run equals the bfloat16
run of the dequantized weights token for token, through the one-call decode step."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers as tf
from conftest import DEVICE, ENGINE
from models import count_one_call_steps, save_lora
from test_gguf_types import PROMPTS, TYPES, blocks, dequantize, gguf_file
from test_quantization import dequantized_copy, dequantized_weight
from torch import nn

from pagedinfer import LLM, LoRARequest, SamplingParams
from pagedinfer.config import QUANTIZATIONS
from pagedinfer.model import gguf, gguf_blocks, packed_linear
from pagedinfer.model.fused_ops import GatedLinear
from pagedinfer.model.loader import ModelLoadError

pytestmark = [
    pytest.mark.skipif(DEVICE != "cpu", reason="the panels run on the CPU"),
    pytest.mark.skipif(
        not packed_linear.panel_dtype(torch.bfloat16, 2),
        reason="the panel kernel did not build (no C compiler)",
    ),
]

# 1 row by four panels, 2-3 by two, 4-8 by one in registers; past 8 rows the buffer and the 8 x 3 tiles
ROWS = (*range(1, 14), 16, 17, 24, 33, 64, 300)


def bfloat16_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, gated: bool
) -> packed_linear.PackedLinear:
    """A bfloat16 linear on the float32 ``weight`` rounded to bfloat16 (bias too), in bfloat16 panels."""
    lin = (GatedLinear if gated else nn.Linear)(weight.shape[1], weight.shape[0], bias=bias is not None)
    lin.weight.data = weight.to(torch.bfloat16)
    if bias is not None:
        lin.bias.data = bias.to(torch.bfloat16)
    packed = packed_linear.PackedLinear(lin, panels=True)
    assert packed.kinds == ["BF16"]
    return packed


def assert_same_products(quant: packed_linear.PackedLinear, ref: packed_linear.PackedLinear, k: int) -> None:
    assert quant.activation_dtype == torch.bfloat16
    for rows in ROWS:
        x = torch.randn(rows, k).to(torch.bfloat16)
        got, want = quant(x), ref(x)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, want), f"{rows} rows"


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_gguf_products_equal_the_bfloat16_panels_on_the_dequantized_weight(kind, gated):
    """Every tile shape, a partial last panel (n = 72), a bias, SiLU x up, for every GGUF type kept: the
    bits of cpu_gemm.c's bfloat16 panels holding the dequantized weight."""
    rng = np.random.default_rng(3)
    n, k = 72, 512
    data = blocks(rng.standard_normal((n, k)).astype(np.float32), kind)
    bias = torch.randn(n)
    weight = gguf_blocks.GGUFWeight(kind, data, k, bf16_io=True)
    quant = packed_linear.gguf_linear([weight], [bias.to(torch.bfloat16)], gated)
    assert quant.kinds == [kind] and (quant.paired if gated else True)
    assert_same_products(quant, bfloat16_linear(dequantize(data, kind), bias, gated), k)


@pytest.mark.parametrize("name", list(QUANTIZATIONS))
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("k,n,bias", [(576, 960, False), (64, 40, True), (36, 50, True), (200, 72, False)])
def test_int8_int4_products_equal_the_bfloat16_panels_on_the_dequantized_weight(name, gated, k, n, bias):
    """int8 and int4 panels quantized from float32 weights, under bfloat16 activations: short last int4
    groups (k = 36, 200), partial panels, bias, SiLU x up: the bits of the bfloat16 panels holding
    the dequantized weight (q * s, (q - z) * s) and bias, each rounded to bfloat16."""
    torch.manual_seed(k + n)
    lin = (GatedLinear if gated else nn.Linear)(k, n, bias=bias)
    quant = packed_linear.PackedLinear(
        lin, panels=True, quantization=QUANTIZATIONS[name], activations=torch.bfloat16
    )
    ref = bfloat16_linear(dequantized_weight(lin.weight.detach(), name), lin.bias, gated)
    assert_same_products(quant, ref, k)


def run(path: Path, monkeypatch, **kw) -> tuple[list, int, LLM]:
    """Seeded n=2 completions with logprobs (and the number of one-call decode steps taken)."""
    steps = count_one_call_steps(monkeypatch)
    params = SamplingParams(n=2, temperature=0.9, seed=5, max_tokens=12, logprobs=2, ignore_eos=True)
    llm = LLM(str(path), block_size=4, num_blocks=128, **{**ENGINE, **kw})
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [[(c.token_ids, c.logprobs) for c in o.outputs] for o in outs], len(steps), llm


@pytest.mark.parametrize("kind", ["Q4_0", "Q8_0", "Q4_K", "Q6_K"])
def test_a_gguf_run_under_bfloat16_equals_the_bfloat16_run_of_its_dequantized_weights(
    kind, gguf_dir, tmp_path, monkeypatch
):
    """``--dtype bfloat16`` on a GGUF keeps its blocks (the tied embedding and lm_head too) and equals the
    bfloat16 run of a directory holding the file's dequantized weights, token for token and logprob for
    logprob, through one-call decode steps on the quantized panels."""
    path = gguf_file(gguf_dir, "llama", True, lambda name: kind, kind)
    got, steps, llm = run(path, monkeypatch, dtype="bfloat16")
    loaded = llm.engine.loaded
    assert loaded.dtype == torch.bfloat16 and steps > 0
    assert loaded.model.layers[0].qkv_proj.kinds == [kind] and loaded.model.lm_head.kinds == [kind]
    assert isinstance(loaded.model.embed_tokens, packed_linear.PanelEmbedding)
    assert loaded.dtype_reason == f"bfloat16 activations; weights as stored in the GGUF ({kind} x15)"
    want, _, ref = run(gguf.convert(path, tmp_path / "dequantized"), monkeypatch, dtype="bfloat16")
    assert ref.engine.loaded.model.layers[0].qkv_proj.kinds == ["BF16"]
    assert got == want


def test_refusals_are_one_line(model_root, monkeypatch):
    """An odd input width (x is read in pairs), or no panel kernel: one line naming what, no
    traceback."""
    odd = model_root / "qwen2-odd-width"
    if not odd.exists():
        config = tf.Qwen2Config(
            vocab_size=256, hidden_size=63, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
        )  # fmt: skip
        tf.AutoModelForCausalLM.from_config(config).save_pretrained(odd)
    with pytest.raises(ModelLoadError, match=r"int8 weights under bfloat16 activations need an even "
                       r"input width \(this linear takes 63\); use --dtype float32"):  # fmt: skip
        LLM(str(odd), quantization="int8", **{**ENGINE, "dtype": "bfloat16"})
    monkeypatch.setattr(packed_linear, "panel_dtype", lambda dtype, k: False)
    with pytest.raises(
        ModelLoadError,
        match=r"quantization int4 needs the CPU panel kernel, which did not build \(no C compiler\?\)",
    ):
        LLM(str(odd), quantization="int4", **{**ENGINE, "dtype": "bfloat16"})


@pytest.mark.parametrize("name", ["int8", "int4", "int4-g128-zp"])
def test_a_quantized_run_under_bfloat16_equals_the_bfloat16_run_of_the_dequantized_checkpoint(
    tiny_model, tmp_path, monkeypatch, name
):
    """``--quantization NAME --dtype bfloat16`` on qwen2 (biases on q/k/v): quantized from the float32
    checkpoint, the other tensors in bfloat16; the same tokens and logprobs as the bfloat16 run of the
    dequantized checkpoint, through one-call decode steps on the quantized panels."""
    path = tiny_model("qwen2")
    got, steps, llm = run(path, monkeypatch, quantization=name, dtype="bfloat16")
    loaded = llm.engine.loaded
    assert loaded.dtype == torch.bfloat16 and steps > 0
    assert loaded.dtype_reason.startswith("bfloat16 activations; linear weights int")
    assert loaded.model.layers[0].qkv_proj.activation_dtype == torch.bfloat16
    want, _, _ = run(dequantized_copy(path, tmp_path / "dequantized", name), monkeypatch, dtype="bfloat16")
    assert got == want


def test_lora_lines_over_a_quantized_base_under_bfloat16(tiny_model, model_root, tmp_path):
    """Per-line LoRA over an int8 base under bfloat16 activations: adapter and base lines in one batch
    give the tokens of the bfloat16 run of the dequantized checkpoint with the same adapter (and the
    adapter's lines differ from the base's)."""
    path = tiny_model("qwen2")
    adapter = LoRARequest("r8", 1, str(save_lora(path, model_root / "loras", "qwen2-bf16-r8", 8, seed=21)))
    params = SamplingParams(n=2, temperature=0.9, seed=5, max_tokens=8, ignore_eos=True)

    def tokens(model: Path, lines: list, **kw) -> list:
        llm = LLM(
            str(model),
            block_size=4,
            num_blocks=128,
            enable_lora=True,
            **{**ENGINE, "dtype": "bfloat16", **kw},
        )
        outs = llm.generate(PROMPTS, params, use_tqdm=False, lora_request=lines)
        return [[c.token_ids for c in o.outputs] for o in outs]

    mixed = [None, adapter, adapter, None]
    got = tokens(path, mixed, quantization="int8")
    assert got == tokens(dequantized_copy(path, tmp_path / "dequantized", "int8"), mixed)
    base = tokens(path, [None] * len(PROMPTS), quantization="int8")
    assert (got[0], got[3]) == (base[0], base[3]) and (got[1], got[2]) != (base[1], base[2])
