#!/usr/bin/env python
"""Where a benchmark workload's time goes, op by op (torch.profiler), for pagedinfer alone.

    python scripts/profile_ops.py --workload W1 --model-cache /tmp/mc --threads 2

Runs one untimed warm-up, then the whole workload under ``torch.profiler`` and prints the wall
time and the ops by self CPU time. Our C decode kernel runs through ctypes and so is not an op:
its time is the wall time the table does not account for (with the interpreter's).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from pagedinfer import LLM, SamplingParams
from pagedinfer.bench import MODELS, WORKLOADS, build_model, default_num_blocks, make_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="W1", choices=sorted(WORKLOADS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model-cache", type=Path, help="directory where the random models are saved once")
    ap.add_argument("--rows", type=int, default=25, help="ops to print")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    w = WORKLOADS[args.workload]
    model_dir, _ = build_model(w.model, args.model_cache or Path(tempfile.mkdtemp()))
    prompts, max_tokens = make_prompts(w, MODELS[w.model]["vocab_size"])
    blocks = default_num_blocks(prompts, max_tokens, w.n, 16)
    llm = LLM(str(model_dir), block_size=16, num_blocks=blocks, max_num_seqs=256, max_num_batched_tokens=2048)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    params = [
        SamplingParams(n=w.n, temperature=w.temperature, max_tokens=m, ignore_eos=True, seed=w.seed)
        for m in max_tokens
    ]
    llm.generate(inputs[:2], params[:2], use_tqdm=False)  # warm-up: kernel build, oneDNN primitives
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        llm.generate(inputs, params, use_tqdm=False)
        wall = time.perf_counter() - start
    print(f"{args.workload}: {wall:.2f} s wall under the profiler, {args.threads} threads")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
