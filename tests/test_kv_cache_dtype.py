"""A 16-bit KV pool under float32 activations (``--kv-cache-dtype``, vLLM's name): twice the blocks in
the same memory, the new K/V rounded as torch's ``.to()`` rounds when written, decode attention over
the 16-bit pool in C (tests/test_cpu_kernel_16bit.py checks it against a float64 reference, and
tests/test_decode_step.py the one-call step against the layer-by-layer path); misuse refused in one
line."""

import json

import pytest
import torch
from cli_helpers import read_jsonl, tiny_model, write_jsonl
from conftest import DEVICE, ENGINE
from typer.testing import CliRunner

from pagedinfer import LLM, SamplingParams
from pagedinfer.attention.interface import select_cuda_kernels
from pagedinfer.attention.kv_cache import LayerShape
from pagedinfer.cli.app import app
from pagedinfer.config import EngineConfig
from pagedinfer.kernels import paged_decode

pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="16-bit pools under float32 are served on the CPU")
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [3 + i, 9, 27, 4 * i + 1, 5]} for i in range(5)]


@pytest.mark.parametrize("kv", ["bfloat16", "float16"])
@pytest.mark.parametrize("impl", ["pagedinfer", "transformers"])
def test_half_pool_holds_twice_the_blocks_and_is_read_by_the_kernel(tiny_model, monkeypatch, kv, impl):
    """The same byte budget buys twice the blocks; every layer's decode rows reach the C kernel over
    the 16-bit pool (our layers and transformers' modules alike); the stats and the report say so."""
    if not paged_decode.available(torch.float32, getattr(torch, kv)):
        pytest.fail(f"the CPU kernel has no float32-over-{kv} instantiation (is a C compiler installed?)")
    monkeypatch.setenv("PAGEDINFER_DECODE_STEP", "0")  # layer by layer, so the spy sees every call
    calls = []
    decode = paged_decode.paged_decode
    monkeypatch.setattr(
        paged_decode, "paged_decode", lambda *a: calls.append((a[1].dtype, a[2].dtype)) or decode(*a)
    )
    path = str(tiny_model("llama"))
    runs = {}
    for dtype in ("auto", kv):
        llm = LLM(path, block_size=4, kv_cache_memory="1MiB", model_impl=impl, kv_cache_dtype=dtype, **ENGINE)
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert all(o.error is None and len(o.outputs[0].token_ids) == 6 for o in outs)
        runs[dtype] = llm.stats
    full, half = runs["auto"], runs[kv]
    assert (full.kv_cache_dtype, half.kv_cache_dtype) == ("float32", kv)
    assert half.bytes_per_token * 2 == full.bytes_per_token
    assert half.num_blocks == (1 << 20) // half.bytes_per_block == 2 * full.num_blocks
    assert half.to_dict()["pool"]["kv_cache_dtype"] == kv
    assert set(calls) == {(torch.float32, torch.float32), (torch.float32, getattr(torch, kv))}


def test_refusals_are_one_line(tiny_model):
    with pytest.raises(
        ValueError, match="kv_cache_dtype must be auto, float32, float16 or bfloat16, not 'fp8'"
    ):
        EngineConfig(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="served under float32 activations only; use auto"):
        LLM(str(tiny_model("llama")), kv_cache_dtype="float16", **{**ENGINE, "dtype": "bfloat16"})
    shapes = {0: LayerShape(2, 64, 64)}
    with pytest.raises(ValueError, match="read a K/V pool of the model's dtype only"):
        select_cuda_kernels(True, torch.device("cuda"), shapes, torch.float16, 16, torch.float32)


def test_cli_kv_cache_dtype_option(tmp_path):
    """``--kv-cache-dtype float16`` runs, with the pool's dtype in the report; an unknown value is a
    usage error without a traceback."""
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "ab"}, {"prompt": "cd"}])
    args = ["run", str(src), "--model", str(tiny_model()), "--device", "cpu", "--max-tokens", "4"]
    ok = CliRunner().invoke(
        app, [*args, "--kv-cache-dtype", "float16", "--report-json", str(tmp_path / "r.json")]
    )
    assert ok.exit_code == 0, ok.output
    assert [r["error"] for r in read_jsonl(tmp_path / "p.out.jsonl")] == [None, None]
    assert json.loads((tmp_path / "r.json").read_text())["pool"]["kv_cache_dtype"] == "float16"
    bad = CliRunner().invoke(app, [*args, "--kv-cache-dtype", "fp8"])
    assert bad.exit_code == 2 and "--kv-cache-dtype" in bad.output and "Traceback" not in bad.output
    mixed = CliRunner().invoke(app, [*args, "--kv-cache-dtype", "float16", "--dtype", "bfloat16"])
    assert mixed.exit_code == 2 and "Traceback" not in mixed.output
    assert "--kv-cache-dtype float16 under bfloat16 activations" in mixed.output
