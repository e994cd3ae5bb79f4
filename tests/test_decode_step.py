"""All layers of a decoding CPU step in one C call (model/decode_step.py): the same tokens as
transformers, the same bits as the layer-by-layer path (drafted rows too), and taken exactly when every
piece has a C kernel."""

import random

import pytest
import torch
from conftest import DEVICE, ENGINE
from models import hf_greedy, step_and_layer_path_agree

from pagedinfer import LLM, SamplingParams
from pagedinfer.engine.row_cost import Probe
from pagedinfer.model import decode_step, packed_linear

pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="the C decode step is the CPU's")
MAX_TOKENS = 12


@pytest.fixture
def steps(monkeypatch):
    """Every linear in cpu_gemm.c's panels (the tiny models are below the packing threshold, and an
    AVX-512 CI machine would pick oneDNN); counts the C steps run, and the rows each served."""
    monkeypatch.setattr(packed_linear, "MIN_WEIGHTS", 0)
    monkeypatch.setenv("PAGEDINFER_CPU_GEMM", "panels")
    rows: list[int] = []
    run = decode_step.DecodeStep.run
    monkeypatch.setattr(
        decode_step.DecodeStep, "run", lambda self, r, *a: rows.append(r.shape[0]) or run(self, r, *a)
    )
    return rows


def prompts(count: int = 6) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(2, 256) for _ in range(rng.randrange(1, 30))] for _ in range(count)]


@pytest.mark.parametrize(
    "family", ["llama", "qwen2", "qwen3", "mistral"]
)  # plain, qkv bias, q/k norms, window
@pytest.mark.parametrize("num_blocks", [256, 12], ids=["roomy-pool", "preempting-pool"])
def test_greedy_matches_transformers_through_the_c_step(tiny_model, steps, family, num_blocks):
    path = tiny_model(family)
    llm = LLM(str(path), block_size=4, num_blocks=num_blocks, model_impl="pagedinfer", **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ps = prompts()
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    for prompt, out in zip(ps, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, MAX_TOKENS), f"prompt of {len(prompt)}"
    decode_steps = sum(1 for b in llm.stats.batch_tokens if b) - len(ps)  # at least one prefill step each
    assert len(steps) >= decode_steps > 0  # decode-only steps went through the C step
    assert (llm.stats.preemptions > 0) == (num_blocks == 12)


# bfloat16 linears in the pair panels (wherever the kernel builds): the step serves them
BF16_STEP = packed_linear.panel_dtype(torch.bfloat16, 2)


@pytest.mark.parametrize(
    "dtype, kv, quantization",
    [
        ("float32", "auto", None),
        ("float32", "float16", None),  # --kv-cache-dtype: a 16-bit pool under float32 activations
        ("float32", "bfloat16", None),
        ("float32", "float16", "int8"),
        pytest.param(
            "bfloat16",
            "auto",
            None,
            marks=pytest.mark.skipif(not BF16_STEP, reason="the panel kernel did not build (no C compiler)"),
        ),
    ],
)
def test_c_step_gives_the_bits_of_the_layer_by_layer_path(
    tiny_model, steps, monkeypatch, dtype, kv, quantization
):
    """Seeded n=3 sampling (the completions fork the prompt's blocks, copy-on-write) with logprobs:
    tokens and log-probabilities exactly equal with the C step and without it, in float32 (with a
    float32 or 16-bit pool, float32 or int8 weights) and in bfloat16 (the same panel GEMMs, K/V
    writes and C chains, layer by layer or in one call)."""
    path = tiny_model("qwen3")

    def make_llm():
        return LLM(
            str(path),
            block_size=4,
            num_blocks=256,
            model_impl="pagedinfer",
            kv_cache_dtype=kv,
            quantization=quantization,
            **{**ENGINE, "dtype": dtype},
        )

    step_and_layer_path_agree(monkeypatch, steps, make_llm, prompts(4), MAX_TOKENS)


def test_the_c_step_serves_only_where_every_piece_has_a_c_kernel(tiny_model, steps, monkeypatch):
    """oneDNN-packed linears (no panels to hand to C) or PAGEDINFER_DECODE_STEP=0: layer by layer."""
    path = tiny_model("llama")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for env, value in (("PAGEDINFER_CPU_GEMM", "onednn"), ("PAGEDINFER_DECODE_STEP", "0")):
        monkeypatch.setenv(env, value)
        llm = LLM(str(path), block_size=4, num_blocks=64, model_impl="pagedinfer", **ENGINE)
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
        assert out[0].outputs[0].token_ids == hf_greedy(path, [5, 6, 7], 4)
        monkeypatch.delenv(env)
    assert steps == []


@pytest.mark.parametrize("family", ["qwen3", "mistral"])  # q/k norms; a sliding window
def test_drafted_rows_take_the_c_step_with_the_layer_paths_bits(tiny_model, steps, monkeypatch, family):
    """A step whose sequences decode with drafted rows after their pending token (1, 4 and 2 query
    rows) runs in the one C call, and each row's logits have the bits of the layer-by-layer path
    (each row attended over its own context, as a prompt row is); a prompt chunk longer than
    `MAX_QUERY_ROWS` stays layer by layer."""
    llm = LLM(str(tiny_model(family)), block_size=4, num_blocks=64, model_impl="pagedinfer", **ENGINE)
    runner, pool = llm.engine.runner, llm.engine.pool
    rng = random.Random(5)
    chunks = []
    for context, rows in ((13, 1), (9, 4), (22, 2)):
        tables: list[list[int]] = [[] for _ in range(pool.num_groups)]
        for g, table in enumerate(tables):
            pool.reserve(table, 0, context + rows, g)
        ids = [rng.randrange(2, 256) for _ in range(context + rows)]
        chunks.append(Probe(tables, rows, ids, start=context))
    prompt = Probe(chunks[2].block_tables, 22, chunks[2].token_ids)  # the longest context
    assert prompt.num_tokens > decode_step.MAX_QUERY_ROWS
    for c in chunks[:2]:  # the other contexts: a prompt chunk each
        runner.execute([Probe(c.block_tables, c.start, c.token_ids)], [])
    runner.execute([prompt], [])
    steps.clear()
    runner.execute([prompt], [])
    assert steps == []  # a long prompt chunk: layer by layer
    fast = runner.execute(chunks, [])  # [7, vocab]
    assert steps == [7]
    layered = runner.one_call
    monkeypatch.setattr(runner, "one_call", lambda meta, lora: None)
    slow = runner.execute(chunks, [])
    monkeypatch.setattr(runner, "one_call", layered)
    assert steps == [7] and fast.shape == slow.shape == (7, fast.shape[1])
    assert torch.equal(fast.view(torch.int32), slow.view(torch.int32))
