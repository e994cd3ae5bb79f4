"""Untrusted GGUF files never reach the kernels unchecked: a model disagreeing with itself (tensor
shapes against the config, the vocabulary's sizes, NaN or Inf weights) is refused at load in one line
naming the file, the tensor and the expected and found shape; metadata past its limits is refused at
once; and a seeded sample of structure-aware mutations (tests/gguf_fuzz.py; the full run is
scripts/fuzz_gguf.py) is each refused in one line or run with correct records."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_helpers import invoke, one_line_error, read_jsonl, tiny_model, with_weights, write_jsonl
from gguf_fuzz import ARRAY, STRING, Field, Tensor, bases, cases, check, encode, greedy, tensor_bytes

from pagedinfer import LLM
from pagedinfer.model import validate
from pagedinfer.model.loader import ModelLoadError

REPO = Path(__file__).resolve().parents[1]
SUBSET = 120  # seeded mutations in the default suite (about 25 s on 2 cores)
CASE_BUDGET_S = 60  # one file: loaded, run, or refused


@pytest.fixture(scope="module")
def files() -> dict:
    """The fuzz bases (llama with a tokenizer and block-32 types; qwen3 in K-quants), with their tokens."""
    return {b.name: b for b in bases()}


@pytest.fixture(autouse=True)
def gguf_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDINFER_GGUF_CACHE", str(tmp_path / "cache"))


def write(tmp_path: Path, name: str, layout) -> Path:
    path = tmp_path / f"{name}.gguf"
    path.write_bytes(encode(layout)[0])
    return path


def with_tensor(layout, name: str, rows: int, cols: int, kind: str | None = None):
    """``layout`` with tensor ``name`` rewritten as ``[rows, cols]`` random weights (its data fits the
    shape: only the model check can see the disagreement)."""
    rng = np.random.default_rng(0)
    tensors = []
    for t in layout.tensors:
        if t.name == name:
            kind = kind or t.kind
            t = Tensor(name, [cols, rows], kind, tensor_bytes(kind, rows, cols, rng))
        tensors.append(t)
    return replace(layout, tensors=tensors)


def with_field(layout, key: str, vtype: int, value, item_type: int | None = None):
    fields = [f for f in layout.fields if f.key != key] + [Field(key, vtype, value, item_type)]
    return replace(layout, fields=fields)


def refusal(path: Path) -> str:
    with pytest.raises(ModelLoadError) as err:
        LLM(str(path), device="cpu", num_blocks=16)
    assert "\n" not in str(err.value)
    return str(err.value)


# -- shapes against the config ----------------------------------------------------------------------


def test_a_q_projection_with_too_few_rows_is_refused_naming_it(files, tmp_path):
    path = write(tmp_path, "q48", with_tensor(files["llama"].layout, "blk.0.attn_q.weight", 48, 64))
    assert refusal(path) == (
        f"{path}: tensor 'blk.0.attn_q.weight' (model.layers.0.self_attn.q_proj.weight) has shape [48, 64]; "
        "the config expects [64, 64] (num_attention_heads * head_dim, hidden_size = 64, 64)"
    )


def test_an_embedding_narrower_than_the_hidden_size_is_refused(files, tmp_path):
    path = write(
        tmp_path, "narrow", with_tensor(files["qwen3"].layout, "token_embd.weight", 256, 128, "Q8_0")
    )
    assert refusal(path) == (
        f"{path}: tensor 'token_embd.weight' (model.embed_tokens.weight) has shape [256, 128]; the config "
        "expects [256, 256] (vocab_size, hidden_size = 256, 256)"
    )


@pytest.mark.parametrize("rows", [320 + 64, 320 - 64], ids=["wider", "narrower"])
def test_an_lm_head_of_another_vocabulary_than_the_embedding_is_refused(files, tmp_path, rows):
    """Wider: sampled ids the embedding cannot look up (the panels' row lookup read past its buffer);
    narrower: ids the logits do not have."""
    path = write(tmp_path, f"head{rows}", with_tensor(files["llama"].layout, "output.weight", rows, 64))
    assert refusal(path) == (
        f"{path}: tensor 'output.weight' (lm_head.weight) has shape [{rows}, 64]; the config expects [320, 64] "
        "(vocab_size, hidden_size = 320, 64)"
    )


def test_a_tensor_of_a_layer_past_the_block_count_is_refused(files, tmp_path):
    layout = with_field(files["llama"].layout, "llama.block_count", 4, 1)
    assert refusal(write(tmp_path, "blocks", layout)).endswith(
        ": tensor 'blk.1.attn_norm.weight' (model.layers.1.input_layernorm.weight) and 8 more are not part "
        "of the config's llama model (num_hidden_layers = 1)"
    )


def test_a_type_that_cannot_be_read_as_weights_is_refused(files, tmp_path):
    layout = with_tensor(files["llama"].layout, "blk.1.ffn_up.weight", 128, 64, "F16")
    layout.tensors = [
        replace(t, kind="I16") if t.name == "blk.1.ffn_up.weight" else t for t in layout.tensors
    ]
    path = write(tmp_path, "i16", layout)  # the same bytes, declared as int16 values
    assert refusal(path) == (
        f"{path}: tensor 'blk.1.ffn_up.weight' (model.layers.1.mlp.up_proj.weight) is stored as I16, a type "
        "pagedinfer does not read as weights"
    )


# -- non-finite weights -----------------------------------------------------------------------------


@pytest.mark.parametrize("bits,kind", [(0x7E00, "Q8_0"), (0x7C00, "Q4_1")], ids=["nan", "inf"])
def test_a_nan_or_inf_scale_in_a_quantized_block_is_refused(files, tmp_path, bits, kind):
    name = "token_embd.weight" if kind == "Q8_0" else "blk.1.ffn_gate.weight"
    tensors = []
    for t in files["llama"].layout.tensors:
        if t.name == name:
            data = bytearray(t.data)
            size = {"Q8_0": 34, "Q4_1": 20}[kind]
            row_bytes = t.dims[0] // 32 * size
            at = 5 * row_bytes + size  # row 5, block 1: its d
            data[at : at + 2] = bits.to_bytes(2, "little")
            t = replace(t, data=bytes(data))
        tensors.append(t)
    path = write(tmp_path, "scale", replace(files["llama"].layout, tensors=tensors))
    hf = "model.embed_tokens.weight" if kind == "Q8_0" else "model.layers.1.mlp.gate_proj.weight"
    assert refusal(path) == (
        f"{path}: tensor {name!r} ({hf}) ({kind}) has a NaN or infinite scale in row 5, block 1"
    )


def test_a_nan_weight_is_refused_naming_where(files, tmp_path):
    tensors = []
    for t in files["llama"].layout.tensors:
        if t.name == "blk.0.attn_v.weight":  # float16, [32, 64]
            values = np.frombuffer(t.data, np.float16).copy()
            values[3 * 64 + 7] = np.nan
            t = replace(t, data=values.tobytes())
        tensors.append(t)
    path = write(tmp_path, "nan", replace(files["llama"].layout, tensors=tensors))
    assert refusal(path) == (
        f"{path}: tensor 'blk.0.attn_v.weight' (model.layers.0.self_attn.v_proj.weight) holds nan at [3, 7]"
    )


def test_finite_weights_that_overflow_are_refused_by_the_probe(files, tmp_path):
    """A norm of 1e30 is finite, but one token through the model (the loader's probe) overflows."""
    tensors = [
        replace(t, data=np.full(64, 1e30, np.float32).tobytes()) if t.name == "blk.0.ffn_norm.weight" else t
        for t in files["llama"].layout.tensors
    ]
    path = write(tmp_path, "overflow", replace(files["llama"].layout, tensors=tensors))
    assert refusal(path) == (
        f"{path}: one token through the model gives NaN or infinite logits: its weights are finite but overflow "
        "float32 (a corrupt file, or a dtype too narrow for this model)"
    )


def test_denormal_and_largest_scales_are_finite_weights_and_run(files, tmp_path):
    tensors = []
    for t in files["llama"].layout.tensors:
        if t.name == "blk.0.attn_q.weight":  # Q4_0: the first block's d denormal, the second's 65504
            data = bytearray(t.data)
            data[0:2], data[18:20] = (1).to_bytes(2, "little"), (0x7BFF).to_bytes(2, "little")
            t = replace(t, data=bytes(data))
        tensors.append(t)
    out = greedy(write(tmp_path, "denormal", replace(files["llama"].layout, tensors=tensors)))
    assert all(isinstance(tokens, list) and len(tokens) == 4 for tokens in out)


# -- the config and the metadata --------------------------------------------------------------------


@pytest.mark.parametrize(
    "key,vtype,value,why",
    [
        ("llama.attention.head_count", 4, 0, "is 0; it must be a positive integer"),
        ("llama.block_count", STRING, "2", "is '2'; it must be a positive integer"),
        ("llama.embedding_length", ARRAY, [64, 64], "is an array of 2 items; it must be a positive integer"),
        (
            "llama.attention.layer_norm_rms_epsilon",
            6,
            float("nan"),
            "is nan; it must be a finite positive number",
        ),
    ],
    ids=["zero-heads", "string", "array", "nan-eps"],
)
def test_size_metadata_that_no_config_can_be_made_of_is_refused(files, tmp_path, key, vtype, value, why):
    layout = with_field(files["llama"].layout, key, vtype, value, 4 if vtype == ARRAY else None)
    path = write(tmp_path, "meta", layout)
    assert refusal(path) == f"{path}: metadata {key} {why}"


def test_a_layer_count_past_the_tensors_is_refused_before_a_config_is_made(files, tmp_path):
    """transformers builds a list per layer: 2**40 layers would never finish."""
    path = write(tmp_path, "layers", with_field(files["qwen3"].layout, "qwen3.block_count", 10, 1 << 40))
    assert refusal(path) == (
        f"{path}: metadata qwen3.block_count is 1,099,511,627,776, but the file holds 13 tensors (each layer "
        "has its own)"
    )


def test_inconsistent_head_counts_say_why(files, tmp_path):
    """transformers' config validator puts its reason on a second line: it is kept."""
    path = write(tmp_path, "heads", with_field(files["llama"].layout, "llama.attention.head_count", 4, 3))
    assert refusal(path) == (
        f"{path}: cannot read the model config from its metadata: Class validation error for validator "
        "'validate_architecture': ValueError: The hidden size (64) is not a multiple of the number of "
        "attention heads (3)."
    )


def test_kv_heads_that_do_not_divide_the_heads_are_refused(files, tmp_path):
    path = write(tmp_path, "kv", with_field(files["llama"].layout, "llama.attention.head_count_kv", 4, 3))
    assert refusal(path) == (
        f"{path}: the config's num_attention_heads (4) is not a multiple of its num_key_value_heads (3)"
    )


def test_a_cut_header_says_so(files, tmp_path):
    data, spots = encode(files["llama"].layout)
    cut = next(s.offset for s in spots if s.label == "key llama.block_count type") + 2
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:cut])
    assert refusal(path) == (
        f"{path} is not a valid GGUF file: its header is cut short at {cut:,} bytes (in metadata key "
        "'llama.block_count'; a truncated download?)"
    )


@pytest.mark.parametrize(
    "key,items",
    [("general.big", 20_000_000), ("tokenizer.ggml.tokens", 20_000_000), ("general.big", 65_537)],
    ids=["20M", "20M-tokenizer", "past-the-limit"],
)
def test_a_huge_metadata_array_is_refused_at_once(files, tmp_path, key, items):
    layout = with_field(files["llama"].layout, key, ARRAY, np.zeros(items, np.uint8), 0)
    path = write(tmp_path, "huge", layout)
    limit = "524,288" if key.startswith("tokenizer.") else "65,536"
    start = time.monotonic()
    assert refusal(path) == (
        f"{path} is not a valid GGUF file: metadata key {key!r} is an array of {items:,} items (the limit is {limit})"
    )
    assert time.monotonic() - start < 5


def test_a_huge_string_length_is_refused_before_anything_is_read(files, tmp_path):
    """numpy's "array is too big" from gguf-py before: the length is checked against the limit first."""
    data, spots = encode(files["llama"].layout)
    at = next(s.offset for s in spots if s.label == "key general.name length")
    path = tmp_path / "long.gguf"
    path.write_bytes(data[:at] + (1 << 62).to_bytes(8, "little") + data[at + 8 :])
    assert refusal(path) == (
        f"{path} is not a valid GGUF file: metadata key 'general.name' is a string of "
        "4,611,686,018,427,387,904 bytes (the limit is 16,777,216)"
    )


def test_a_big_endian_file_is_refused(files, tmp_path):
    data = bytearray(encode(files["llama"].layout)[0])
    data[4:8] = (3).to_bytes(4, "big")
    path = tmp_path / "be.gguf"
    path.write_bytes(bytes(data))
    assert (
        refusal(path)
        == f"{path} is not a valid GGUF file: it is a big-endian GGUF file; pagedinfer reads little-endian ones"
    )


# -- the vocabulary and tokenized text --------------------------------------------------------------


def test_text_that_tokenizes_past_the_embedding_fails_its_line(files, tmp_path):
    """A tokenizer of 321 tokens (320 and the converter's <|endoftext|>) over an embedding and lm_head of 256 rows (the metadata's vocab_size):
    the load notes it; a text whose tokens fall past row 255 fails its line (it reached the row lookup),
    the other lines run."""
    layout = with_field(files["llama"].layout, "llama.vocab_size", 4, 256)
    layout = with_tensor(with_tensor(layout, "token_embd.weight", 256, 64), "output.weight", 256, 64)
    path = write(tmp_path, "vocab", layout)
    prompts = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"id": "text", "prompt": "To be, or not to be", "max_tokens": 2},
            {"id": "ids", "prompt_token_ids": [3, 4, 5], "max_tokens": 2},
        ],
    )
    result = invoke("run", prompts, "--model", path, "--device", "cpu", "-q")
    assert result.exit_code == 1, result.output
    assert (
        f"pagedinfer: {path}: its tokenizer has 321 tokens but its embedding 256 rows: a prompt whose text "
        "tokenizes to an id of 256 or more fails its line"
    ) in result.stderr
    text, ids = read_jsonl(tmp_path / "p.out.jsonl")
    assert text["error"] == (
        "line 1: the prompt tokenizes to id 305 ('To'), outside the model's vocabulary of 256 tokens "
        "(its embedding's rows)"
    )
    assert ids["error"] is None and len(ids["outputs"][0]["token_ids"]) == 2


def test_check_module_refuses_an_lm_head_of_another_vocabulary():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
        )
    )
    model.lm_head = torch.nn.Linear(32, 80, bias=False)
    with pytest.raises(validate.ModelCheckError) as err:
        validate.check_module(model, [], "model.safetensors")
    assert str(err.value) == (
        "model.safetensors: the lm_head has 80 rows but the embedding 64: every sampled id must be one the "
        "embedding holds"
    )


# -- safetensors directories, through both implementations -----------------------------------------


@pytest.mark.parametrize("impl", ["pagedinfer", "transformers"])
def test_a_safetensors_q_projection_with_too_few_rows_is_refused(tmp_path, impl):
    def short_q(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.self_attn.q_proj.weight"] = t["model.layers.0.self_attn.q_proj.weight"][:24].clone()

    path = with_weights(tiny_model(), tmp_path / "model", short_q)
    weights = path / "model.safetensors"
    with pytest.raises(ModelLoadError) as err:
        LLM(str(path), device="cpu", model_impl=impl)
    expects = (
        "[32, 32] (num_attention_heads * head_dim, hidden_size = 32, 32)"
        if impl == "pagedinfer"
        else "[32, 32]"
    )
    assert str(err.value) == (
        f"{weights}: tensor 'model.layers.0.self_attn.q_proj.weight' has shape [24, 32]; the config expects {expects}"
    )


@pytest.mark.parametrize("impl", ["pagedinfer", "transformers"])
def test_a_safetensors_inf_weight_is_refused(tmp_path, impl):
    def inf(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.1.mlp.down_proj.weight"][2, 5] = float("inf")

    path = with_weights(tiny_model(), tmp_path / "model", inf)
    weights = path / "model.safetensors"
    with pytest.raises(ModelLoadError) as err:
        LLM(str(path), device="cpu", model_impl=impl)
    assert str(err.value) == f"{weights}: tensor 'model.layers.1.mlp.down_proj.weight' holds inf at [2, 5]"


# -- end to end ---------------------------------------------------------------------------------------


def test_pagedinfer_run_refuses_a_bad_gguf_in_one_line(files, tmp_path):
    path = write(tmp_path, "q48", with_tensor(files["llama"].layout, "blk.0.attn_q.weight", 48, 64))
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt_token_ids": [1, 2, 3], "max_tokens": 2}])
    result = invoke("run", prompts, "--model", path, "--device", "cpu", "-q")
    one_line_error(
        result,
        f"{path}: tensor 'blk.0.attn_q.weight' (model.layers.0.self_attn.q_proj.weight) has shape [48, 64]",
    )
    assert not (tmp_path / "p.out.jsonl").exists() or not read_jsonl(tmp_path / "p.out.jsonl")


def test_a_subprocess_run_of_a_hostile_file_ends_in_one_line(files, tmp_path):
    """In a process of its own (a signal or a hang would show as such): an lm_head wider than the
    embedding, which used to sample ids the panels' row lookup read past its buffer, is one error line."""
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt_token_ids": [1, 2, 3], "max_tokens": 2}])
    path = write(tmp_path, "wide", with_tensor(files["llama"].layout, "output.weight", 384, 64))
    cmd = [sys.executable, "-m", "pagedinfer", "run", str(prompts), "--model", str(path), "--device", "cpu"]
    proc = subprocess.run(cmd + ["-q"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        f"error: {path}: tensor 'output.weight' (lm_head.weight) has shape [384, 64]; the config expects "
        "[320, 64] (vocab_size, hidden_size = 320, 64)"
    ]


# -- the seeded fuzz subset -------------------------------------------------------------------------


@contextlib.contextmanager
def budget(seconds: float):
    def expire(signum, frame):
        raise TimeoutError(f"past {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_seeded_mutations_are_refused_in_one_line_or_run_correctly(files, tmp_path):
    """tests/gguf_fuzz.py's mutations, a fixed seed's sample: each file refused in one line naming it, or
    run with well-formed records (the base's exact tokens for a layout-only change). Both outcomes occur."""
    all_bases = list(files.values())
    for base in all_bases:
        base.neutral_tokens = greedy(write(tmp_path, f"base-{base.name}", base.layout))
    kinds = []
    for i, (base, case) in enumerate(cases(SUBSET, 0, all_bases)):
        path = tmp_path / f"case-{i}.gguf"
        path.write_bytes(case.data)
        with budget(CASE_BUDGET_S):
            kinds.append(check(path, case, base).kind)
        path.unlink()
    assert {"refused", "ran"} <= set(kinds)
