"""Which attention backend the engine picks, and the engine running end to end on the CUDA kernels.

There is no GPU here, so the CUDA path runs through the CPU harness (the same .cu sources compiled
with g++ and a CUDA shim): every step's cache writes, copy-on-write copies and attention go through
the kernels, and greedy outputs must still equal transformers' generate.
"""

import pytest
import torch
import transformers as tf
from models import COMMON, hf_greedy

from pagedinfer import LLM, SamplingParams
from pagedinfer.attention import cuda_kernels, cuda_on_cpu


@pytest.fixture(scope="module")
def head64_model(tmp_path_factory):
    """A tiny Llama whose head size (64) has kernels; GQA 4 query heads over 2 KV heads."""
    path = tmp_path_factory.mktemp("head64")
    torch.manual_seed(0)
    config = tf.LlamaConfig(
        **COMMON,
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.2,
    )
    model = tf.LlamaForCausalLM(config)
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    return path


def test_cpu_runs_the_torch_path(tiny_model):
    llm = LLM(str(tiny_model("llama")), num_blocks=16, device="cpu")
    assert llm.engine.runner.use_cuda_kernels is False


def test_kernels_refuse_what_they_cannot_serve(tiny_model):
    with pytest.raises(ValueError, match="head size 16"):
        LLM(str(tiny_model("qwen3")), num_blocks=16, block_size=8, device="cpu", use_cuda_kernels=True)


def test_engine_on_the_cuda_kernels_matches_transformers(head64_model):
    cuda_kernels.set_raw_module_factory(cuda_on_cpu.RawModule)
    try:
        llm = LLM(str(head64_model), block_size=8, num_blocks=64, device="cpu", use_cuda_kernels=True)
        assert llm.engine.runner.use_cuda_kernels is True
        prompts = [list(range(3, 3 + n)) for n in (5, 12)]
        params = SamplingParams(n=2, temperature=0, max_tokens=6)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        cuda_kernels.set_raw_module_factory(None)
    for prompt, out in zip(prompts, outs, strict=True):
        want = hf_greedy(head64_model, prompt, 6)
        assert [c.token_ids for c in out.outputs] == [want, want]
    assert llm.stats.cow_copies == 2  # each prompt's partial last block, copied by its first completion
    assert llm.engine.pool.num_used == 0
