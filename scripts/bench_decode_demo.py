#!/usr/bin/env python
"""Decode tokens per second on the embedded demo model (or MODEL), one JSON line per batch size.

    python scripts/bench_decode_demo.py [--model MODEL] [--dtype float32] [--batch 1,32] [--tokens 128]
        [--repeats 3] [--threads 2]

B prompts of 4 tokens each generate --tokens greedy tokens (ignore_eos): the steps are decode steps
but the first. Each batch size runs --repeats times after a warm-up; the fastest run is kept, as
tokens / wall second and tokens / CPU second of the process (on a shared machine the latter moves
less with the other jobs). To compare two checkouts, run this file with each one's PYTHONPATH in
turn, alternating (docs/history/kernels-log.md has such runs).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from pagedinfer import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model path or hub id (default: the demo model)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", default="1,32", help="comma list of batch sizes")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, device="cpu", dtype=args.dtype, kv_cache_memory="256MiB")
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=0.0)
    for b in (int(n) for n in args.batch.split(",")):
        prompts = [{"prompt_token_ids": [5 + i % 200, 17, 30, 8]} for i in range(b)]
        llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)  # warm-up
        best = (0.0, 0.0)
        for _ in range(args.repeats):
            wall, cpu = time.perf_counter(), time.process_time()
            llm.generate(prompts, params, use_tqdm=False)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            best = max(best[0], b * args.tokens / wall), max(best[1], b * args.tokens / cpu)
        print(
            json.dumps(
                {"dtype": args.dtype, "batch": b, "tok_s": round(best[0], 1), "tok_cpu_s": round(best[1], 1)}
            )
        )


if __name__ == "__main__":
    main()
