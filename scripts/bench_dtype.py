"""bfloat16 vs float32 on the CPU: GEMM rates, then pagedinfer and transformers ``generate`` in both dtypes.

A stand-in for benchmarks W5 and W1 in bfloat16 (issue 14) until ``pagedinfer bench`` grows a dtype option: a random-weight
Llama-3.2-1B-shaped model (hidden 2048, 16 layers, 32/8 heads of 64, intermediate 8192, vocab 128256, tied),
(or, with ``--model smollm135m``, W1's SmolLM2-135M-shaped one), stored in bfloat16, run by both systems in each dtype on the same prompts, in one process, one after another.
W5 proper is 32 prompts of 128-512 tokens, n=2, 128 new tokens; ``--prompts/--prompt-len/--max-tokens``
scale it down for slow machines (the output says what ran).

    python scripts/bench_dtype.py --prompts 4 --prompt-len 64,128 --max-tokens 16 --json out.json
    python scripts/bench_dtype.py --agreement ~/.cache/pagedinfer-tests/SmolLM2-135M-Instruct-float32

``--agreement DIR``: instead, the share of 8 chat prompts whose 128-token greedy output in bfloat16 equals
transformers' bfloat16 ``generate`` (eager attention), on a real model directory.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's pagedinfer

from pagedinfer import LLM, SamplingParams  # noqa: E402
from pagedinfer.bench.models import LLAMA_COMMON  # noqa: E402
from pagedinfer.bench.models import MODELS as BENCH_MODELS  # noqa: E402
from pagedinfer.model.dtype import cpu_bf16_flags  # noqa: E402

# the bench's W5 and W1 model shapes (LlamaConfig fields), not a copy of them
MODELS = {name: BENCH_MODELS[name][0] for name in ("llama1b", "smollm135m")}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "Explain in two sentences what a CPU does.",
    "What is 12 times 7?",
    "Give me a tip for learning to cook.",
    "Who wrote Romeo and Juliet?",
    "Describe a cat to someone who has never seen one.",
]


def machine() -> dict:
    name = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if "model name" in ln
        ),
        "?",
    )
    return {
        "cpu": name,
        "bf16_flags": cpu_bf16_flags(),
        "threads": torch.get_num_threads(),
        "loadavg": os.getloadavg(),
    }


def gemm_rate(m: int, k: int, n: int, dtype: torch.dtype, repeats: int = 3) -> float:
    """Best GFLOP/s of an ``[m, k] x [k, n]`` matmul in ``dtype``."""
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)  # [m, k], [k, n]
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(repeats))
    return 2 * m * k * n / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def build_model(root: Path, name: str) -> Path:
    """The random-weight model ``name``, built and stored in bfloat16 (half the memory of float32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = root / f"{name}-bf16"
    if (path / "config.json").exists():
        return path
    torch.manual_seed(0)
    config = LlamaConfig(**MODELS[name], **LLAMA_COMMON)
    torch.set_default_dtype(torch.bfloat16)
    try:
        LlamaForCausalLM(config).save_pretrained(path)
    finally:
        torch.set_default_dtype(torch.float32)
    return path


def run_pagedinfer(path: Path, dtype: str, prompts: list[list[int]], n: int, max_tokens: int) -> dict:
    llm = LLM(str(path), device="cpu", dtype=dtype, kv_cache_memory="2GiB")
    params = SamplingParams(n=n, temperature=0.8, seed=1, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(
        {"prompt_token_ids": prompts[0][:8]}, SamplingParams(max_tokens=2), use_tqdm=False
    )  # warm-up
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for r in outs for o in r.outputs)
    reason = llm.engine.loaded.dtype_reason
    del llm
    gc.collect()
    return {
        "wall_s": round(wall, 2),
        "tokens": tokens,
        "tok_per_s": round(tokens / wall, 2),
        "reason": reason,
    }


def run_generate(path: Path, dtype: str, prompts: list[list[int]], n: int, max_tokens: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).eval()
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)  # [B, W], left-padded
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    kw = dict(do_sample=True, temperature=0.8, num_return_sequences=n, pad_token_id=0, eos_token_id=None)
    model.generate(ids[:1, -8:], attention_mask=mask[:1, -8:], max_new_tokens=2, **kw)  # warm-up
    torch.manual_seed(1)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens, **kw
        )
    wall = time.perf_counter() - start
    tokens = (out.shape[1] - width) * out.shape[0]
    del model
    gc.collect()
    return {"wall_s": round(wall, 2), "tokens": tokens, "tok_per_s": round(tokens / wall, 2)}


def throughput(args) -> dict:
    result: dict = {"machine": machine(), "gemm_gflops": {}}
    for shape in ((1024, 1024, 1024), (64, 2048, 8192), (64, 576, 49152)):
        for name, dtype in DTYPES.items():
            result["gemm_gflops"][f"{'x'.join(map(str, shape))} {name}"] = round(gemm_rate(*shape, dtype), 1)
    print(json.dumps(result, indent=1), flush=True)
    path = build_model(Path(args.root), args.model)
    vocab = MODELS[args.model]["vocab_size"]
    lo, hi = args.prompt_len
    rng = random.Random(1005)
    prompts = [[rng.randrange(1, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(args.prompts)]
    result["workload"] = (
        f"{args.model}: {args.prompts} prompts of {lo}-{hi} random tokens, n={args.n}, {args.max_tokens} new tokens, "
        "temperature 0.8, ignore_eos (W5 proper: 32 prompts of 128-512, n=2, 128 new tokens)"
    )
    result["runs"] = {}
    for dtype in args.dtypes.split(","):
        for system, fn in (("pagedinfer", run_pagedinfer), ("hf_generate", run_generate)):
            res = fn(path, dtype, prompts, args.n, args.max_tokens)
            result["runs"][f"{system} {dtype}"] = res
            print(f"{system:12} {dtype:9} {json.dumps(res)}", flush=True)
    return result


def agreement(model_dir: str, max_tokens: int = 128) -> dict:
    """Prompts whose bfloat16 greedy output equals transformers' bfloat16 generate (eager, one at a time)."""
    from transformers import AutoModelForCausalLM

    llm = LLM(model_dir, device="cpu", dtype="bfloat16")
    tok = llm.tokenizer
    ids = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)["input_ids"]
        for q in QUESTIONS
    ]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ours = [
        o.outputs[0].token_ids
        for o in llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    ]
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, attn_implementation="eager"
    ).eval()
    same, first_diff = 0, []
    for p, got in zip(ids, ours, strict=True):
        x = torch.tensor([p])  # [1, P]
        want = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(p) :].tolist()
        same += got == want
        first_diff.append(next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None))
    return {"prompts": len(ids), "equal": same, "first_difference_at": first_diff, "tokens": max_tokens}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model", choices=sorted(MODELS), default="llama1b", help="llama1b: W5's; smollm135m: W1's"
    )
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=lambda s: tuple(map(int, s.split(","))), default=(128, 512))
    p.add_argument("--n", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--root", default="/tmp/pagedinfer-bench-dtype", help="where the random model is saved")
    p.add_argument(
        "--agreement", metavar="DIR", help="measure bfloat16 greedy agreement on this model instead"
    )
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    result = agreement(args.agreement) if args.agreement else throughput(args)
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
