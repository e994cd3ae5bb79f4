"""bfloat16 and float16 on the CPU end to end: prefill (torch SDPA), decode (the C kernel's 16-bit
instantiations) and the sampler.

16-bit greedy output is not token-identical to transformers' 16-bit ``generate`` (a packed batch and a
one-prompt run round differently, and one flipped argmax changes the rest), so the check is on the
distribution: the log-probability we report for every generated token equals, within the 16-bit
rounding, float32 transformers' log-probability of that token after the same prefix (teacher-forced).
A wrong position, block or K/V row moves it by nats. Measured worst cases here: bfloat16 0.19 nats
(llama_d64's sharp logits), float16 0.02; tolerance 0.5 and 0.1.
"""

import random

import pytest
import torch
from models import _hf_model

from pagedinfer import LLM, SamplingParams
from pagedinfer.kernels import paged_decode

TOLERANCE = {"bfloat16": 0.5, "float16": 0.1}
LENGTHS = (1, 5, 9, 16, 23, 30)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("family,block_size", [("llama_d64", 16), ("mistral", 4), ("gemma2", 4)])
def test_half_precision_logprobs_match_float32_transformers(
    tiny_model, family, block_size, dtype, monkeypatch
):
    if not paged_decode.available(getattr(torch, dtype)):
        pytest.fail(f"the CPU kernel has no {dtype} instantiation (is a C compiler installed?)")
    calls = []
    decode = paged_decode.paged_decode
    monkeypatch.setattr(paged_decode, "paged_decode", lambda *a: calls.append(a[2].dtype) or decode(*a))
    path = tiny_model(family)
    rng = random.Random(1)
    prompts = [[rng.randrange(2, 256) for _ in range(n)] for n in LENGTHS]
    llm = LLM(str(path), device="cpu", dtype=dtype, block_size=block_size, num_blocks=64)
    assert llm.engine.kv.k[0].dtype == getattr(torch, dtype) and llm.stats.dtype == dtype
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert calls and set(calls) == {getattr(torch, dtype)}  # decode went through the 16-bit kernel
    ref = _hf_model(str(path))  # float32, eager attention
    for prompt, out in zip(prompts, outs, strict=True):
        tokens = out.outputs[0].token_ids
        with torch.no_grad():
            logp = ref(torch.tensor([prompt + tokens])).logits[0].log_softmax(-1)  # [P + N, V]
        want = logp[len(prompt) - 1 : -1].gather(1, torch.tensor(tokens)[:, None])[:, 0]  # [N]
        got = torch.tensor([out.outputs[0].logprobs[i][t].logprob for i, t in enumerate(tokens)])  # [N]
        torch.testing.assert_close(got, want, atol=TOLERANCE[dtype], rtol=0)
