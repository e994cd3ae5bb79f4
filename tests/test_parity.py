"""Greedy outputs are token-identical to transformers' generate, across families, with and without preemption."""

import random

import pytest
from conftest import DEVICE, ENGINE
from models import hf_greedy

from pagedinfer import LLM, SamplingParams

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma2", "phi3", "gpt2", "opt", "gpt_oss"]
OWN = {
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "phi3",
}  # families pagedinfer's own modeling (the fast path) serves
# every layer windowed (8 tokens): each sequence's table gives blocks back as it decodes, so 12 blocks
# serve the prompts below without preempting (tests/test_sliding_window.py preempts windowed models)
WINDOWED_ONLY = {"mistral"}
CASES = [
    (f, impl)
    for f in FAMILIES
    for impl in ("transformers", "pagedinfer")
    if impl == "transformers" or f in OWN
]
IMPLS = ["transformers", "pagedinfer"]
LENGTHS = (1, 5, 9, 16, 23, 30)  # below, at and across block boundaries; beyond mistral's window of 8
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(1)
    return [[rng.randrange(2, 256) for _ in range(n)] for n in LENGTHS]


@pytest.mark.parametrize(("family", "impl"), CASES)
@pytest.mark.parametrize("num_blocks", [256, 12], ids=["roomy-pool", "preempting-pool"])
def test_greedy_matches_transformers(tiny_model, prompts, family, impl, num_blocks):
    path = tiny_model(family)
    llm = LLM(str(path), block_size=4, num_blocks=num_blocks, model_impl=impl, **ENGINE)
    assert llm.engine.loaded.impl == impl
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, MAX_TOKENS), f"prompt of {len(prompt)}"
        assert out.outputs[0].finish_reason == "length"
    assert llm.engine.pool.num_used == 0
    if num_blocks == 12 and family not in WINDOWED_ONLY:
        assert llm.stats.preemptions > 0  # 6 requests of up to 42 tokens cannot share 48 slots
    else:
        assert llm.stats.preemptions == 0


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("num_blocks", [64, 6], ids=["roomy-pool", "preempting-pool"])
def test_greedy_matches_transformers_through_the_kernels(tiny_model, prompts, num_blocks, impl, monkeypatch):
    """Head size 64 and blocks of 16: decode goes through the C kernel on the CPU, CuPy's on CUDA."""
    from pagedinfer.kernels import paged_decode

    calls = []
    decode = paged_decode.paged_decode
    monkeypatch.setattr(paged_decode, "paged_decode", lambda *a: calls.append(1) or decode(*a))
    path = tiny_model("llama_d64")
    llm = LLM(str(path), block_size=16, num_blocks=num_blocks, model_impl=impl, **ENGINE)
    assert llm.engine.runner.use_cuda_kernels == (DEVICE == "cuda")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, MAX_TOKENS), f"prompt of {len(prompt)}"
    assert (llm.stats.preemptions > 0) == (num_blocks == 6)  # 6 requests of up to 3 blocks each
    assert bool(calls) == (DEVICE == "cpu" and paged_decode.available())


@pytest.mark.parametrize("impl", IMPLS)
def test_chunked_prefill_matches_transformers(tiny_model, prompts, impl):
    """A token budget of 7 splits every long prompt into chunks that attend to their cached prefix."""
    path = tiny_model("mistral")
    llm = LLM(str(path), block_size=4, num_blocks=256, max_num_batched_tokens=7, model_impl=impl, **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, MAX_TOKENS)
    assert max(llm.stats.batch_tokens) <= 7


@pytest.mark.parametrize(  # gpt2: Conv1D layers + a tied Linear head
    ("family", "impl"),
    [("llama", "transformers"), ("llama", "pagedinfer"), ("gpt2", "auto"), ("opt", "auto")],
)
def test_greedy_matches_transformers_with_every_linear_packed(tiny_model, prompts, family, impl, monkeypatch):
    """The tiny models' weights are below the packing threshold; force oneDNN packing on all of them."""
    from pagedinfer.model import packed_linear

    monkeypatch.setattr(packed_linear, "MIN_WEIGHTS", 0)
    path = tiny_model(family)
    llm = LLM(str(path), block_size=4, num_blocks=256, model_impl=impl, **ENGINE)
    if DEVICE == "cpu":
        assert any(isinstance(m, packed_linear.PackedLinear) for m in llm.engine.loaded.model.modules())
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, MAX_TOKENS), f"prompt of {len(prompt)}"
