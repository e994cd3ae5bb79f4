#!/usr/bin/env python
"""A mixture of experts on our own layers against transformers' modules, alternating in one process.

    python scripts/bench_moe.py [--family olmoe] [--layers 2] [--vocab 50304] [--experts 64]
        [--dtype float32] [--quantization int8] [--gguf Q4_0] [--repeats 3] [--threads 2] [--out DIR]
        [--workloads b1,batch16] [--gguf-file FILE.gguf]

An OLMoE-1B-7B-like shape with fewer layers (hidden 2048, 16 heads, 64 experts of 1024, 8 per token,
vocabulary 50304), or with ``--family qwen2_moe`` a Qwen1.5-MoE-A2.7B-like one (hidden 2048, 16 heads
with q/k/v biases, 60 experts of 1408, 4 per token, a shared expert of 5632, vocabulary 151936), or
with ``--family gpt_oss`` a gpt-oss-20b-like one (hidden 2880, 64 query heads and 8 KV heads of 64,
biases and sinks, windows of 128 on every other layer, 32 experts of 2880, 4 per token, vocabulary
201088); ``--experts`` fewer experts per layer (a token runs as many: the memory, not the work,
shrinks); random weights from seed 0, saved once under --out; loaded twice: ``--model-impl
pagedinfer`` and ``--model-impl transformers`` (the same pagedinfer engine, paged attention and
sampler; only the layers differ). Our engine runs twice: decode steps in the one-call C step
(``pagedinfer``) and layer by layer (``pagedinfer-layers``: the runner's C step withheld, as
``PAGEDINFER_DECODE_STEP=0`` would, for that run alone). ``--gguf-file`` runs a GGUF made elsewhere
(``scripts/make_real_shape_gguf.py``'s OLMoE-1B-7B shape) on our layers only, both ways, no
transformers (its float32 checkpoint is not there). Two workloads, each run --repeats times per path, the paths
alternating, after a warm-up: b1 (one 32-token prompt, 64 greedy tokens) and a batch (16 prompts of
64 tokens, 32 greedy tokens each). The fastest run of each is kept, as generated tokens per wall
second; one JSON line per workload and path, with the CPU's name. ``--quantization`` / ``--gguf``
apply to our path only (transformers' reads the float32 checkpoint; a GGUF is written from it with
every matrix in that type). With few layers the lm_head's 50304 rows outweigh the experts a token
runs (16 layers of 8 experts in the real model); ``--vocab`` scales it down with the layer count
(4096 for one layer keeps about the real model's ratio of expert to lm_head bytes per token).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

# transformers' expert products are torch's float32 matmuls (MKL), which pagedinfer's import would hold to its slower
# COMPATIBLE path (MKL_CBWR): both paths run at MKL's own pace here, as users of transformers get it
os.environ.setdefault("MKL_CBWR", "AUTO")

import torch  # noqa: E402
import transformers as tf  # noqa: E402

from pagedinfer import LLM, SamplingParams  # noqa: E402
from pagedinfer.model import families  # noqa: E402
from pagedinfer.model.random_models import save_random_model  # noqa: E402

SHAPE = dict(  # OLMoE-1B-7B's (allenai/OLMoE-1B-7B-0924), but the layer count
    vocab_size=50304,
    hidden_size=2048,
    intermediate_size=1024,
    num_attention_heads=16,
    num_key_value_heads=16,
    num_experts=64,
    num_experts_per_tok=8,
    max_position_embeddings=4096,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=1,
)
SHAPES = {  # --family -> (its config class, its shape)
    "olmoe": (tf.OlmoeConfig, SHAPE),
    # Qwen1.5-MoE-A2.7B's (Qwen/Qwen1.5-MoE-A2.7B), but the layer count
    "qwen2_moe": (
        tf.Qwen2MoeConfig,
        {
            **SHAPE,
            "vocab_size": 151936,
            "intermediate_size": 5632,
            "moe_intermediate_size": 1408,
            "shared_expert_intermediate_size": 5632,
            "num_experts": 60,
            "num_experts_per_tok": 4,
        },
    ),
    # gpt-oss-20b's (openai/gpt-oss-20b), but the layer count
    "gpt_oss": (
        tf.GptOssConfig,
        dict(
            vocab_size=201088,
            hidden_size=2880,
            intermediate_size=2880,
            head_dim=64,
            num_attention_heads=64,
            num_key_value_heads=8,
            num_local_experts=32,
            num_experts_per_tok=4,
            sliding_window=128,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=1,
        ),
    ),
}
WORKLOADS = {  # name -> (prompts, prompt tokens, new tokens each)
    "b1": (1, 32, 64),
    "batch16": (16, 64, 32),
}


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(
            line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")
        )
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def model_dir(out: Path, family: str, layers: int, vocab: int | None, experts: int | None) -> Path:
    cls, shape = SHAPES[family]
    path = out / f"{family}-like-{layers}l" if vocab is None else out / f"{family}-like-{layers}l-v{vocab}"
    count = families.by_model_type(family).experts.count  # the config's expert count field
    if experts is not None:
        path = path.with_name(f"{path.name}-e{experts}")
    shape = {**shape, count: experts or shape[count]}
    if not (path / "config.json").exists():
        config = cls(**{**shape, "vocab_size": vocab or shape["vocab_size"]}, num_hidden_layers=layers)
        save_random_model(config, path, seed=0)
    return path


def gguf_file(path: Path, kind: str) -> Path:
    """The checkpoint as a GGUF with every matrix in ``kind`` (tests/gguf_models.py's writer); MXFP4:
    the experts' only, the other matrices float32 (llama.cpp's gpt-oss files hold the experts alone
    in MXFP4)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from gguf_models import save_gguf

    out = path.with_name(f"{path.name}-{kind}.gguf")
    if not out.exists():
        save_gguf(path, out, lambda name: kind if kind != "MXFP4" or "_exps" in name else "F32")
    return out


@contextlib.contextmanager
def layer_by_layer(llm: LLM, on: bool):
    """``llm``'s decode steps layer by layer (the runner offered no one-call C step) where ``on``."""
    runner = llm.engine.runner
    if on:
        runner.one_call = lambda meta, lora: None
    try:
        yield
    finally:
        if on:
            del runner.one_call


def run(llm: LLM, workload: str) -> float:
    """Generated tokens per wall second of one run of ``workload``."""
    n, prompt_len, new = WORKLOADS[workload]
    ids = min(50000, llm.engine.loaded.model.config.vocab_size - 2)  # prompts' ids from 2 to 2 + ids
    prompts = [
        {"prompt_token_ids": [(7 * i + 13 * j) % ids + 2 for j in range(prompt_len)]} for i in range(n)
    ]
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return n * new / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=tuple(SHAPES), default="olmoe")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=None, help="the family's own by default")
    parser.add_argument("--experts", type=int, default=None, help="experts per layer (the family's own)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantization", default=None, help="our path's weights: int8, int4, ...")
    parser.add_argument("--gguf", default=None, help="our path on a GGUF of this type (Q4_0, Q8_0, ...)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("/tmp/pagedinfer-bench-moe"))
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="of " + ", ".join(WORKLOADS))
    parser.add_argument("--gguf-file", type=Path, default=None, help="a GGUF to run on our layers alone")
    args = parser.parse_args()
    workloads = args.workloads.split(",")
    if unknown := [w for w in workloads if w not in WORKLOADS]:
        parser.error(f"--workloads: no workload {unknown[0]!r} (there are {', '.join(WORKLOADS)})")
    torch.set_num_threads(args.threads)
    engine = dict(device="cpu", kv_cache_memory="512MiB")
    if args.gguf_file is not None:
        if not args.gguf_file.is_file():
            parser.error(f"--gguf-file: {args.gguf_file} is not a file")
        own = LLM(str(args.gguf_file), dtype="auto", model_impl="pagedinfer", **engine)
        ref = None
    else:
        path = model_dir(args.out, args.family, args.layers, args.vocab, args.experts)
        own_path = gguf_file(path, args.gguf) if args.gguf else path
        own_dtype = "auto" if args.gguf else args.dtype
        own = LLM(
            str(own_path), dtype=own_dtype, quantization=args.quantization, model_impl="pagedinfer", **engine
        )
        ref = LLM(str(path), dtype=args.dtype, model_impl="transformers", **engine)
    runs = {"pagedinfer": (own, False), "pagedinfer-layers": (own, True)}  # impl -> (engine, layer by layer)
    if ref is not None:
        runs["transformers"] = (ref, False)
    best: dict[tuple[str, str], float] = {}
    for workload in workloads:
        for llm, layered in runs.values():
            with layer_by_layer(llm, layered):
                run(llm, workload)  # warm-up
        for _ in range(args.repeats):
            for impl, (llm, layered) in runs.items():
                key = (workload, impl)
                with layer_by_layer(llm, layered):
                    best[key] = max(best.get(key, 0.0), run(llm, workload))
    weights = args.gguf or args.quantization or args.dtype
    for (workload, impl), tok_s in best.items():
        record = {"workload": workload, "impl": impl, "tok_s": round(tok_s, 2)}
        if args.gguf_file is not None:
            record |= {"gguf": str(args.gguf_file)}
        else:
            record |= {"family": args.family, "layers": args.layers}
            record |= {"vocab": args.vocab or SHAPES[args.family][1]["vocab_size"]}
            record |= {"experts": args.experts} if args.experts else {}
            record |= {"weights": weights if impl != "transformers" else args.dtype}
        print(json.dumps({**record, "threads": args.threads, "cpu": cpu_name()}))
    for workload in workloads:
        for base in ("pagedinfer-layers", "transformers"):
            if (workload, base) in best:
                ratio = best[(workload, "pagedinfer")] / best[(workload, base)]
                print(json.dumps({"workload": workload, "speedup": round(ratio, 2), "over": base}))


if __name__ == "__main__":
    main()
