"""GGUF files (``--model file.gguf``, ``LLM(model="file.gguf")``) and the dtype ``--dtype auto`` picks."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_helpers import invoke
from gguf_models import save_qwen2_gguf
from models import hf_greedy, save_model
from transformers import AutoModelForCausalLM, LlamaConfig

from pagedinfer import LLM, SamplingParams
from pagedinfer.model import dtype as dtype_choice
from pagedinfer.model import gguf
from pagedinfer.model.loader import ModelLoadError

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [[5, 17, 99, 3], [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def qwen2_gguf(model_root) -> tuple[Path, Path]:
    """(the tiny Qwen2 model directory, the same weights as a float32 GGUF file)."""
    model_dir = save_model("qwen2", model_root)
    path = model_root / "gguf" / "tiny-qwen2.gguf"
    if not path.exists():
        path.parent.mkdir(exist_ok=True)
        save_qwen2_gguf(model_dir, path)
    return model_dir, path


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_llm_loads_a_gguf_file(qwen2_gguf):
    model_dir, path = qwen2_gguf
    llm = LLM(str(path), device="cpu", dtype="float32")
    assert llm.engine.loaded.model.config.model_type == "qwen2"
    assert greedy(llm) == [hf_greedy(model_dir, p, MAX_TOKENS) for p in PROMPTS]


def test_gguf_is_dequantized_to_the_runs_dtype(qwen2_gguf):
    llm = LLM(str(qwen2_gguf[1]), device="cpu", dtype="bfloat16")
    loaded = llm.engine.loaded
    assert loaded.dtype == torch.bfloat16  # the reason adds "; emulated ..." on a CPU without AVX512-BF16
    assert loaded.dtype_reason.startswith("--dtype bfloat16")
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert llm.engine.kv.k[0].dtype == torch.bfloat16
    assert len(greedy(llm)[0]) == MAX_TOKENS


def test_convert_writes_a_plain_model_directory(qwen2_gguf, tmp_path):
    model_dir, path = qwen2_gguf
    out = gguf.convert(path, tmp_path / "converted")
    assert not list(tmp_path.glob("*.tmp"))
    want = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    got = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_missing_gguf_extra_is_one_clear_line(qwen2_gguf, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a)
    )
    with pytest.raises(ModelLoadError) as err:
        LLM(str(qwen2_gguf[1]), device="cpu")
    assert str(err.value) == "loading a GGUF file needs gguf: pip install 'pagedinfer[gguf]'"


def test_cli_refuses_a_missing_gguf_file_in_one_line(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_token_ids": [1, 2, 3]}\n')
    result = invoke("run", prompts, "--model", tmp_path / "none.gguf")  # in process: the next test spawns one
    assert result.exit_code == 2
    assert result.stderr.strip() == f"error: GGUF file {tmp_path / 'none.gguf'} does not exist"


def test_cli_runs_a_gguf_file(qwen2_gguf, tmp_path):
    model_dir, path = qwen2_gguf
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(
            f'{{"prompt_token_ids": {p}, "max_tokens": {MAX_TOKENS}, "temperature": 0, "ignore_eos": true}}\n'
            for p in PROMPTS
        )
    )
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "pagedinfer", "run", str(prompts), "--model", str(path), "-o", str(out)]
    result = subprocess.run(
        cmd + ["--device", "cpu", "--dtype", "float32", "--quiet"], cwd=REPO, capture_output=True
    )
    assert result.returncode == 0, result.stderr
    got = [json.loads(line)["outputs"][0]["token_ids"] for line in out.read_text().splitlines()]
    assert got == [hf_greedy(model_dir, p, MAX_TOKENS) for p in PROMPTS]


# -- --dtype auto --------------------------------------------------------------------------------


def config(stored: torch.dtype | None) -> LlamaConfig:
    cfg = LlamaConfig(hidden_size=64)
    cfg.dtype = stored
    return cfg


CPU = torch.device("cpu")


def test_stored_dtype_never_asks_for_the_deprecated_torch_dtype(monkeypatch):
    """A GGUF's config has no dtype; asking it for ``torch_dtype`` printed transformers' deprecation
    warning on every GGUF load."""
    asked = []
    monkeypatch.setattr(LlamaConfig, "torch_dtype", property(lambda self: asked.append(1)), raising=False)
    assert dtype_choice.stored_dtype(config(None)) is None
    assert dtype_choice.stored_dtype(config(torch.bfloat16)) == torch.bfloat16
    assert asked == []


@pytest.mark.parametrize("stored", [None, torch.float32])
def test_auto_keeps_float32_for_a_float32_checkpoint_on_any_cpu(stored, monkeypatch):
    monkeypatch.setattr(dtype_choice, "cpu_bf16_flags", lambda: ["amx_bf16"])
    monkeypatch.setattr(dtype_choice, "gemm_speedup", lambda width: 3.0)
    choice = dtype_choice.choose_dtype("auto", config(stored), CPU)
    assert choice.dtype == torch.float32 and "not stored in 16 bits" in choice.reason


def test_auto_keeps_float32_without_native_bfloat16_instructions(monkeypatch):
    monkeypatch.setattr(dtype_choice, "cpu_bf16_flags", lambda: [])
    monkeypatch.setattr(dtype_choice, "gemm_speedup", lambda width: pytest.fail("measured without AMX"))
    choice = dtype_choice.choose_dtype("auto", config(torch.bfloat16), CPU)
    assert choice.dtype == torch.float32 and "no amx_bf16/avx512_bf16" in choice.reason


@pytest.mark.parametrize("speedup,want", [(1.1, torch.float32), (2.5, torch.bfloat16)])
def test_auto_picks_bfloat16_only_when_measured_faster(speedup, want, monkeypatch):
    widths = []
    monkeypatch.setattr(dtype_choice, "cpu_bf16_flags", lambda: ["amx_bf16", "avx512_bf16"])
    monkeypatch.setattr(dtype_choice, "gemm_speedup", lambda width: widths.append(width) or speedup)
    choice = dtype_choice.choose_dtype("auto", config(torch.float16), CPU)
    assert choice.dtype == want and widths == [64]  # measured at the model's hidden size
    assert f"{speedup:.2f}x" in choice.reason


def test_auto_on_this_machine_matches_its_cpu_flags(text_model):
    """The demo-sized checkpoints are float32: auto is float32 here, and the run says why."""
    llm = LLM(str(text_model), device="cpu", num_blocks=8)
    llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=2), use_tqdm=False)
    model = llm.stats.to_dict()["model"]
    assert {k: model[k] for k in ("dtype", "dtype_reason")} == {
        "dtype": "float32",
        "dtype_reason": "auto: float32 on the CPU (the model is not stored in 16 bits)",
    }


@pytest.mark.parametrize(
    "dtype, flags", [("bfloat16", "amx_bf16/avx512_bf16"), ("float16", "amx_fp16/avx512_fp16")]
)
def test_an_explicit_16_bit_dtype_without_native_instructions_says_it_runs_emulated(
    dtype, flags, monkeypatch
):
    monkeypatch.setattr(dtype_choice, "cpu_flags", lambda names: [])  # an AVX2-only CPU
    choice = dtype_choice.choose_dtype(dtype, config(None), CPU)
    assert choice.emulated and choice.reason == f"--dtype {dtype}; emulated on this CPU (no {flags})"
    assert dtype_choice.emulated_note(choice) == (
        f"pagedinfer: note: {dtype} runs emulated on this CPU (no {flags}): float32 is faster here "
        "(--dtype float32), or --quantization int8"
    )
    given = dtype_choice.choose_dtype(getattr(torch, dtype), config(None), CPU)
    assert given.emulated and given.reason.startswith("given; emulated")
    for other in ("float32", "auto"):
        assert not dtype_choice.choose_dtype(other, config(None), CPU).emulated
    assert not dtype_choice.choose_dtype(dtype, config(None), torch.device("cuda")).emulated
    monkeypatch.setattr(dtype_choice, "cpu_flags", lambda names: list(names[-1:]))  # AVX512 with it
    native = dtype_choice.choose_dtype(dtype, config(None), CPU)
    assert not native.emulated and native.reason == f"--dtype {dtype}"


def test_gemm_speedup_measures_both_dtypes():
    assert dtype_choice.gemm_speedup(64, repeats=1) > 0


def test_unknown_dtype_is_one_clear_line(text_model):
    with pytest.raises(
        ModelLoadError, match="unknown dtype 'float8': use auto, float32, float16 or bfloat16"
    ):
        LLM(str(text_model), device="cpu", dtype="float8")


def test_the_header_reader_stands_in_for_gguf_py_exactly(tmp_path, monkeypatch):
    """The first load builds the config from the values `gguf_header` read (no gguf-py parse of the
    file): the cache folder is byte for byte the one gguf-py's own reader gives transformers."""
    import contextlib

    from gguf_fuzz import bases, encode

    base = next(b for b in bases() if b.name == "llama")  # a BPE tokenizer with merges, a chat template
    path = tmp_path / "llama.gguf"
    path.write_bytes(encode(base.layout)[0])
    folders = {}
    for how in ("header", "gguf-py"):
        monkeypatch.setenv("PAGEDINFER_GGUF_CACHE", str(tmp_path / how))
        if how == "gguf-py":
            monkeypatch.setattr(gguf._HeaderReader, "standing_in", lambda header: contextlib.nullcontext())
        folders[how] = gguf.open_checkpoint(path).folder
    names = sorted(p.name for p in folders["header"].iterdir())
    assert "tokenizer.json" in names and names == sorted(p.name for p in folders["gguf-py"].iterdir())
    for name in names:
        assert (folders["header"] / name).read_bytes() == (folders["gguf-py"] / name).read_bytes(), name


def test_the_digest_is_hashed_once_per_version_of_the_file(tmp_path, monkeypatch):
    """A file's SHA-256 is kept by its identity: hashed once while the file stays as it is, again once it
    is rewritten (same size, another modification time), and on every load while it is too recently
    written for the file system's clock to tell a next write apart."""
    monkeypatch.setenv("PAGEDINFER_GGUF_CACHE", str(tmp_path / "cache"))
    hashed = []
    real = gguf.file_digest
    monkeypatch.setattr(gguf, "file_digest", lambda p: hashed.append(p) or real(p))
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + b"a" * 100)
    monkeypatch.setattr(gguf, "SETTLED_S", -1.0)  # kept however recent (ctime cannot be set back)
    first = hashlib.sha256(path.read_bytes()).hexdigest()
    assert gguf._known_digest(path) == gguf._known_digest(path) == first
    assert len(hashed) == 1
    path.write_bytes(b"GGUF" + b"b" * 100)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    second = hashlib.sha256(path.read_bytes()).hexdigest()
    assert gguf._known_digest(path) == gguf._known_digest(path) == second != first
    assert len(hashed) == 2
    monkeypatch.setattr(gguf, "SETTLED_S", 3600.0)
    fresh = tmp_path / "fresh.gguf"
    fresh.write_bytes(b"GGUF" + b"c" * 100)
    assert (
        gguf._known_digest(fresh)
        == gguf._known_digest(fresh)
        == hashlib.sha256(fresh.read_bytes()).hexdigest()
    )
    assert len(hashed) == 4  # too recent to be kept: hashed each time


def test_the_types_read_without_gguf_py_are_ones_it_reads():
    """The floats and the panels' block types are read without importing gguf-py; each is one its
    dequantizer reads too (the full list, asked for by a file with another type)."""
    ours = gguf.readable_types(["F32", "Q4_1"])
    assert set(ours) == {"F32", "F16", *gguf.BLOCKS}
    assert set(ours) < set(gguf.readable_types(["IQ2_XS"]))
