"""Does cache-aware admission (``--schedule-policy lpm``) raise the prefix-cache hit rate?

Offline batches often interleave requests of a few prompt families (several system prompts or
documents, each asked many questions). With a pool too small to keep every family's prefix cached,
first-come-first-served admission runs the families side by side, so a family's cached prefix is
evicted before its next request arrives; ``lpm`` admits the waiting requests whose prefix is cached
first. This runs the same batch under both policies in one process and prints the hit rate, the
prompt tokens computed and the wall time, and checks that greedy outputs are equal.

Usage: python scripts/bench_admission.py [--families 8] [--per-family 16] [--prefix 256]
       [--num-blocks 96] [--max-num-seqs 8] [--threads 2]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig

from pagedinfer import LLM, SamplingParams
from pagedinfer.model.random_models import save_random_model


def prompts(families: int, per_family: int, prefix: int, vocab: int, grouped: bool) -> list[list[int]]:
    """``families`` shared prefixes, each followed by ``per_family`` distinct 16-48-token questions."""
    rng = random.Random(0)
    heads = [[rng.randrange(3, vocab) for _ in range(prefix)] for _ in range(families)]
    lines = [
        heads[f] + [rng.randrange(3, vocab) for _ in range(rng.randint(16, 48))]
        for _ in range(per_family)
        for f in range(families)
    ]  # round-robin over the families: the worst order for first come first served
    return sorted(lines, key=lambda p: heads.index(p[:prefix])) if grouped else lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", type=int, default=8)
    ap.add_argument("--per-family", type=int, default=16)
    ap.add_argument("--prefix", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=96, help="pool size: small enough to evict")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    config = LlamaConfig(
        vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        eos_token_id=None, bos_token_id=None, tie_word_embeddings=True,
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        save_random_model(config, Path(tmp))
        print(
            f"{args.families} families x {args.per_family} requests, {args.prefix}-token prefixes, "
            f"{args.max_tokens} new tokens; pool {args.num_blocks} blocks of 16, max_num_seqs {args.max_num_seqs}"
        )
        print(
            f"{'order':<12} {'policy':<6} {'hit rate':>8} {'computed':>9} {'requested':>9} {'evictions':>9} {'wall s':>7}"
        )
        for grouped in (False, True):
            lines = prompts(args.families, args.per_family, args.prefix, config.vocab_size, grouped)
            outputs = {}
            for policy in ("fcfs", "lpm"):
                llm = LLM(
                    tmp, device="cpu", dtype="float32", num_blocks=args.num_blocks,
                    max_num_seqs=args.max_num_seqs, schedule_policy=policy,
                )  # fmt: skip
                start = time.perf_counter()
                outs = llm.generate([{"prompt_token_ids": p} for p in lines], params, use_tqdm=False)
                wall = time.perf_counter() - start
                s = llm.stats
                outputs[policy] = [o.outputs[0].token_ids for o in outs]
                order = "grouped" if grouped else "interleaved"
                print(
                    f"{order:<12} {policy:<6} {s.prefix_cache_hit_rate:>8.1%} {s.prompt_tokens_computed:>9,} "
                    f"{s.prompt_tokens_requested:>9,} {s.prefix_cache_evictions:>9,} {wall:>7.2f}"
                )
            print(f"{'':<12} greedy outputs equal: {outputs['fcfs'] == outputs['lpm']}")


if __name__ == "__main__":
    main()
