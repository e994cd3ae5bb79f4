"""The CPU GEMM layouts side by side on one model: panels (and the one-call decode step) against oneDNN.

Each layout runs in its own process (``PAGEDINFER_CPU_GEMM=panels|onednn``), alternating ``--rounds``
times: a prefill of 64 random 128-token prompts (``max_tokens`` 1) and a batch-1 decode of 64 tokens,
each with its wall and CPU seconds (on a shared machine the CPU seconds sway less).

    python scripts/probe_gemm_layouts.py --model ~/.cache/pagedinfer-tests/SmolLM2-135M-Instruct-float32
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time


def probe(model: str, threads: int) -> None:
    import torch

    from pagedinfer import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(model, device="cpu", dtype="float32")
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(128)]} for _ in range(64)]
    one = [{"prompt_token_ids": prompts[0]["prompt_token_ids"][:32]}]
    for name, batch, params in (
        ("prefill 64 x 128", prompts, SamplingParams(temperature=0, max_tokens=1)),
        ("batch-1 decode, 64 new", one, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)),
    ):
        llm.reset_prefix_cache()
        wall, cpu = time.perf_counter(), time.process_time()
        llm.generate(batch, params, use_tqdm=False)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        print(f"  {name}: {wall:.2f} s wall, {cpu:.2f} s CPU", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a float32 model directory")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)  # one layout, in a child
    args = ap.parse_args()
    if args.probe:
        probe(args.model, args.threads)
        return
    for _ in range(args.rounds):
        for layout in ("onednn", "panels"):
            print(f"{layout} (load {os.getloadavg()[0]:.1f})", flush=True)
            cmd = [sys.executable, __file__, "--probe", "--model", args.model, "--threads", str(args.threads)]
            subprocess.run(cmd, env={**os.environ, "PAGEDINFER_CPU_GEMM": layout}, check=True)


if __name__ == "__main__":
    main()
