"""Weight-only int8 (``--quantization int8``): the int8 panels multiply exactly as float32 panels that
hold the dequantized weights, at every row count, so an int8 run equals a float32 run of the
dequantized checkpoint, token for token and log-probability for log-probability; misuse is refused
in one line."""

from pathlib import Path

import pytest
import torch
from cli_helpers import read_jsonl, tiny_model, write_jsonl
from conftest import DEVICE, ENGINE
from safetensors.torch import load_file, save_file
from torch import nn
from typer.testing import CliRunner

from pagedinfer import LLM, SamplingParams
from pagedinfer.cli.app import app
from pagedinfer.model import decode_step, packed_linear
from pagedinfer.model.dtype import DTypeError, choose_dtype
from pagedinfer.model.fused_ops import GatedLinear
from pagedinfer.model.loader import ModelLoadError

pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="int8 weights run on the CPU")


def test_quantize_int8_rounds_each_row_to_its_own_scale():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(5, 40, generator=gen) * torch.tensor([[1e-3], [1.0], [30.0], [0.0], [2.0]])  # [5, 40]
    q, s = packed_linear.quantize_int8(w)
    assert q.dtype == torch.int8 and s.shape == (5,)
    assert torch.equal(q[3], torch.zeros(40, dtype=torch.int8)) and s[3] == 1  # an all-zero row
    live = [0, 1, 2, 4]
    assert torch.equal(q[live].abs().amax(dim=1), torch.full((4,), 127, dtype=torch.int8))
    assert bool(((q.float() * s[:, None] - w).abs() <= s[:, None] / 2 * (1 + 1e-6)).all())


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("k,n,bias", [(576, 960, False), (64, 40, True), (33, 50, True)])
def test_int8_panels_give_the_float32_products_of_the_dequantized_weight(gated, k, n, bias):
    """Every path of the int8 kernel (one row: two panels at a time; 2-6 rows in registers; more: the
    panel dequantized into a buffer for the float32 kernel), partial panels, bias, SiLU x up: the
    same bits as cpu_gemm.c's float32 panels holding q * scale."""
    if packed_linear._gemm_library() is None:
        pytest.fail("the panel kernel did not build (is a C compiler installed?)")
    torch.manual_seed(k + n)
    lin = (GatedLinear if gated else nn.Linear)(k, n, bias=bias)
    int8 = packed_linear.PackedLinear(lin, panels=True, int8=True)
    q, s = packed_linear.quantize_int8(lin.weight.detach())
    lin.weight.data = q.float() * s[:, None]  # the dequantized weight
    float32 = packed_linear.PackedLinear(lin, panels=True)
    assert int8.panels.dtype == torch.int8 and float32.panels.dtype == torch.float32
    for rows in (1, 2, 3, 5, 6, 7, 12, 13, 64, 300):
        x = torch.randn(rows, k)
        assert torch.equal(int8(x), float32(x)), f"{rows} rows"


def dequantized_copy(path: Path, out: Path) -> Path:
    """``path``'s checkpoint with every linear weight (2-D, but the embedding) replaced by q * scale."""
    out.mkdir()
    for f in path.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    for f in path.glob("*.safetensors"):
        tensors = load_file(str(f))
        for name, t in tensors.items():
            if t.dim() == 2 and "embed" not in name:
                q, s = packed_linear.quantize_int8(t.float())
                tensors[name] = (q.float() * s[:, None]).to(t.dtype)
        save_file(tensors, str(out / f.name), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("impl", ["pagedinfer", "transformers"])
def test_int8_run_equals_float32_run_of_the_dequantized_checkpoint(tiny_model, tmp_path, monkeypatch, impl):
    """Seeded n=2 sampling with logprobs on qwen2 (biases on q/k/v): the same tokens and the same
    log-probabilities as the float32 run of the dequantized weights, through our layers with the
    one-call decode step in int8, and through transformers' modules."""
    path = tiny_model("qwen2")
    deq = dequantized_copy(path, tmp_path / "dequantized")
    monkeypatch.setattr(packed_linear, "MIN_WEIGHTS", 0)  # the float32 run packs every linear too
    monkeypatch.setenv("PAGEDINFER_CPU_GEMM", "panels")
    steps: list[int] = []
    run_step = decode_step.DecodeStep.run
    monkeypatch.setattr(decode_step.DecodeStep, "run", lambda self, *a: steps.append(1) or run_step(self, *a))
    params = SamplingParams(n=2, temperature=0.9, seed=5, max_tokens=10, logprobs=2, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (4, 9, 17)]

    def run(model: Path, **kw) -> list:
        llm = LLM(str(model), block_size=4, num_blocks=128, model_impl=impl, **ENGINE, **kw)
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [[(c.token_ids, c.logprobs) for c in o.outputs] for o in outs]

    int8 = run(path, quantization="int8")
    assert bool(steps) == (impl == "pagedinfer")  # our layers decode in one C call, in int8
    assert int8 == run(deq)


def test_int8_refusals_are_one_line(tiny_model):
    path = str(tiny_model("llama"))
    with pytest.raises(ModelLoadError, match="unknown quantization 'int4': use int8"):
        LLM(path, quantization="int4", **ENGINE)
    with pytest.raises(ModelLoadError, match="keeps activations in float32: use --dtype auto or float32"):
        LLM(path, quantization="int8", **{**ENGINE, "dtype": "bfloat16"})
    with pytest.raises(DTypeError, match="runs on the CPU only"):
        choose_dtype("auto", None, torch.device("cuda"), "int8")
    with pytest.raises(ModelLoadError, match="model family 'gpt2' keeps weights in Conv1D, which would stay"):
        LLM(str(tiny_model("gpt2")), quantization="int8", **ENGINE)


def test_cli_quantization_option(tmp_path):
    """``--quantization int8`` runs and says so in the report; with ``--dtype bfloat16`` it stops at once."""
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "ab"}, {"prompt": "cd"}])
    model = str(tiny_model())
    args = ["run", str(src), "--model", model, "--device", "cpu", "--max-tokens", "4", "--temperature", "0"]
    ok = CliRunner().invoke(app, [*args, "--quantization", "int8", "--report-json", str(tmp_path / "r.json")])
    assert ok.exit_code == 0, ok.output
    assert [r["error"] for r in read_jsonl(tmp_path / "p.out.jsonl")] == [None, None]
    report = (tmp_path / "r.json").read_text()
    assert "linear weights int8 per output channel" in report
    bad = CliRunner().invoke(app, [*args, "--quantization", "int8", "--dtype", "bfloat16"])
    assert bad.exit_code == 2
    assert "use --dtype auto or float32" in bad.output and "Traceback" not in bad.output
