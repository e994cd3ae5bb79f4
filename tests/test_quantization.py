"""Weight-only quantization (``--quantization int8``, ``int4`` and its variants): the int8 and int4 panels
multiply exactly as float32 panels that hold the dequantized weights, at every row count, so a
quantized run equals a float32 run of the dequantized checkpoint, token for token and
log-probability for log-probability; misuse is refused in one line."""

from pathlib import Path

import pytest
import torch
from cli_helpers import read_jsonl, tiny_model, write_jsonl
from conftest import DEVICE, ENGINE
from models import count_one_call_steps
from safetensors.torch import load_file, save_file
from torch import nn
from typer.testing import CliRunner

from pagedinfer import LLM, SamplingParams
from pagedinfer.cli.app import app
from pagedinfer.config import QUANTIZATIONS
from pagedinfer.model import packed_linear, panel_formats
from pagedinfer.model.dtype import DTypeError, choose_dtype
from pagedinfer.model.fused_ops import GatedLinear
from pagedinfer.model.loader import ModelLoadError

pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="quantized weights run on the CPU")


def test_quantize_int8_rounds_each_row_to_its_own_scale():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(5, 40, generator=gen) * torch.tensor([[1e-3], [1.0], [30.0], [0.0], [2.0]])  # [5, 40]
    q, s = panel_formats.quantize_int8(w)
    assert q.dtype == torch.int8 and s.shape == (5,)
    assert torch.equal(q[3], torch.zeros(40, dtype=torch.int8)) and s[3] == 1  # an all-zero row
    live = [0, 1, 2, 4]
    assert torch.equal(q[live].abs().amax(dim=1), torch.full((4,), 127, dtype=torch.int8))
    assert bool(((q.float() * s[:, None] - w).abs() <= s[:, None] / 2 * (1 + 1e-6)).all())


@pytest.mark.parametrize("zero_points", [False, True], ids=["symmetric", "zero-points"])
def test_quantize_int4_rounds_each_group_to_its_own_scale(zero_points):
    """Groups of 32 (the last one short: in = 72), an all-zero group, each weight within s / 2 of its
    value; zero points in 0..15, symmetric ones 8."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(3, 72, generator=gen) * 3
    w[1, 32:64] = 0
    q, s, z = panel_formats.quantize_int4(w, 32, zero_points)
    assert q.dtype == torch.uint8 and s.shape == (3, 3) and int(q.max()) <= 15
    assert (z is not None) == zero_points and (z is None or int(z.max()) <= 15)
    assert s[1, 1] == 1 and bool((q[1, 32:64] == (z[1, 1] if zero_points else 8)).all())
    deq = panel_formats.dequantize_int4(q, s, z, 32)
    step = s.repeat_interleave(32, dim=1)[:, :72]
    assert bool(((deq - w).abs() <= step / 2 * (1 + 1e-5)).all())


@pytest.mark.parametrize("name", list(QUANTIZATIONS))
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("k,n,bias", [(576, 960, False), (64, 40, True), (36, 50, True), (200, 72, False)])
def test_quantized_panels_give_the_float32_products_of_the_dequantized_weight(name, gated, k, n, bias):
    """Every tile shape (one row by several panels; up to MR rows in registers; more: the first rows
    converting in registers into a buffer that the float32 tiles of the other rows read), partial
    panels, a short last int4 group (k = 36, 200), bias, SiLU x up: the same bits as cpu_gemm.c's
    float32 panels holding the dequantized weight (q * s for int8, (q - z) * s for int4)."""
    if packed_linear._gemm_library() is None:
        pytest.fail("the panel kernel did not build (is a C compiler installed?)")
    quant = QUANTIZATIONS[name]
    torch.manual_seed(k + n)
    lin = (GatedLinear if gated else nn.Linear)(k, n, bias=bias)
    packed = packed_linear.PackedLinear(lin, panels=True, quantization=quant)
    lin.weight.data = dequantized_weight(lin.weight.detach(), name)
    float32 = packed_linear.PackedLinear(lin, panels=True)
    assert packed.kinds == [{8: "I8", 4: "I4Z" if quant.zero_points else "I4"}[quant.bits]]
    assert float32.kinds == ["F32"]
    for rows in (1, 2, 3, 5, 6, 7, 12, 13, 16, 17, 20, 64, 300):
        x = torch.randn(rows, k)
        assert torch.equal(packed(x), float32(x)), f"{rows} rows"


def dequantized_weight(w: torch.Tensor, name: str) -> torch.Tensor:
    """``w`` [out, in] float32 as the quantization ``name`` stores it, dequantized (the panels' values)."""
    quant = QUANTIZATIONS[name]
    if quant.bits == 8:
        q, s = panel_formats.quantize_int8(w)
        return q.float() * s[:, None]
    q, s, z = panel_formats.quantize_int4(w, quant.group, quant.zero_points)
    return panel_formats.dequantize_int4(q, s, z, quant.group)


def dequantized_copy(path: Path, out: Path, name: str) -> Path:
    """``path``'s checkpoint with every linear weight (2-D, but the embedding) replaced by its dequantized
    form under the quantization ``name``."""
    out.mkdir()
    for f in path.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    for f in path.glob("*.safetensors"):
        tensors = load_file(str(f))
        for key, t in tensors.items():
            if t.dim() == 2 and "embed" not in key:
                tensors[key] = dequantized_weight(t.float(), name).to(t.dtype)
        save_file(tensors, str(out / f.name), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize(
    "impl,name",
    [
        ("pagedinfer", "int8"),
        ("transformers", "int8"),
        ("pagedinfer", "int4"),
        ("pagedinfer", "int4-g128-zp"),
    ],
)
def test_quantized_run_equals_float32_run_of_the_dequantized_checkpoint(
    tiny_model, tmp_path, monkeypatch, impl, name
):
    """Seeded n=2 sampling with logprobs on qwen2 (biases on q/k/v): the same tokens and the same
    log-probabilities as the float32 run of the dequantized weights, through our layers with the
    one-call decode step on the quantized panels, and through transformers' modules."""
    path = tiny_model("qwen2")
    deq = dequantized_copy(path, tmp_path / "dequantized", name)
    steps = count_one_call_steps(monkeypatch)
    params = SamplingParams(n=2, temperature=0.9, seed=5, max_tokens=10, logprobs=2, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (4, 9, 17)]

    def run(model: Path, **kw) -> list:
        llm = LLM(str(model), block_size=4, num_blocks=128, model_impl=impl, **ENGINE, **kw)
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [[(c.token_ids, c.logprobs) for c in o.outputs] for o in outs]

    quantized = run(path, quantization=name)
    assert bool(steps) == (impl == "pagedinfer")  # our layers decode in one C call, on those panels
    assert quantized == run(deq)


def test_quantization_refusals_are_one_line(tiny_model):
    path = str(tiny_model("llama"))
    with pytest.raises(
        ModelLoadError, match="unknown quantization 'int3': use int8, int4, int4-zp, int4-g128, "
    ):
        LLM(path, quantization="int3", **ENGINE)
    with pytest.raises(
        ModelLoadError, match="runs under float32 or bfloat16 activations: use --dtype auto, float32"
    ):
        LLM(path, quantization="int8", **{**ENGINE, "dtype": "float16"})
    with pytest.raises(DTypeError, match="runs on the CPU only"):
        choose_dtype("auto", None, torch.device("cuda"), QUANTIZATIONS["int8"])
    with pytest.raises(ModelLoadError, match="model family 'gpt2' keeps weights in Conv1D, which would stay"):
        LLM(str(tiny_model("gpt2")), quantization="int8", **ENGINE)


def test_cli_quantization_option(tmp_path):
    """``--quantization int8`` / ``int4-g128`` run and say so in the report; with ``--dtype float16`` it
    stops at once."""
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "ab"}, {"prompt": "cd"}])
    model = str(tiny_model())
    args = ["run", str(src), "--model", model, "--device", "cpu", "--max-tokens", "4", "--temperature", "0"]
    for name, says in (("int8", "int8 per output channel"), ("int4-g128", "int4 per group of 128 inputs")):
        ok = CliRunner().invoke(
            app, [*args, "--quantization", name, "--report-json", str(tmp_path / "r.json")]
        )
        assert ok.exit_code == 0, ok.output
        assert [r["error"] for r in read_jsonl(tmp_path / "p.out.jsonl")] == [None, None]
        assert f"linear weights {says}" in (tmp_path / "r.json").read_text()
    bad = CliRunner().invoke(app, [*args, "--quantization", "int8", "--dtype", "float16"])
    assert bad.exit_code == 2
    assert "use --dtype auto, float32 or bfloat16" in bad.output and "Traceback" not in bad.output
