"""W6 (prompts/w6.jsonl) through the API with one model load: speculation off, on with the gate
(seeded at start-up, refit from the run's decode steps), and on with the gate open (every match
drafted), alternating at batch 1 and 8; each run's tokens compared with the run off. One torch thread
(a shared machine's figures vary less).

    python scripts/bench_speculative_w6.py MODEL REPEATS [w6|w1|A|B|C|D|b1] [DRAFT_MODEL]

``w1``: W1's shape instead, smaller (docs/bench.md: 8 prompts of 64-192 random token ids, n=4 at
temperature 0.8, 32 tokens each, EOS ignored; at batch 4 and 32), where drafts rarely match: what
speculation costs where it cannot help. ``A`` .. ``D``, ``b1``: scripts/bench_llamacpp.py's workloads
(random token ids, greedy, EOS ignored; b1 at batch 1, the others all at once). ``DRAFT_MODEL``:
drafts from that model (``{"method": "draft_model", "model": DRAFT_MODEL, "num_speculative_tokens":
4}``) instead of n-grams.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
from bench_llamacpp import WORKLOADS, workloads

from pagedinfer import LLM, SamplingParams
from pagedinfer.bench.workloads import default_num_blocks
from pagedinfer.core.speculative import RowCost
from pagedinfer.engine.llm_engine import LLMEngine
from pagedinfer.sampling_params import StructuredOutputsParams

SPEC = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
W6 = Path(__file__).resolve().parent.parent / "prompts" / "w6.jsonl"


def params(line: dict) -> SamplingParams:
    so = line.get("structured_outputs")
    return SamplingParams(
        max_tokens=line["max_tokens"],
        temperature=0.0,
        structured_outputs=StructuredOutputsParams(json=so["json"]) if so else None,
    )


def w1() -> tuple[list[dict], list[SamplingParams]]:
    rng = random.Random(1)
    prompts = [
        {"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(rng.randint(64, 192))]}
        for _ in range(8)
    ]
    params = [SamplingParams(n=4, temperature=0.8, max_tokens=32, ignore_eos=True, seed=i) for i in range(8)]
    return prompts, params


def peer_workload(name: str, vocab: int) -> tuple[list[dict], SamplingParams, int]:
    """bench_llamacpp.py's workload ``name``: its prompts, their sampling and the blocks they need."""
    w = workloads(vocab)[name]
    params = SamplingParams(n=w.n, temperature=0.0, max_tokens=w.max_new, ignore_eos=True)
    blocks = default_num_blocks(w.prompts, [w.max_new] * len(w.prompts), w.n, 16)
    return [{"prompt_token_ids": p} for p in w.prompts], params, blocks


def view(base: LLM, spec: dict | None, batch: int, gate_open: bool, blocks: int) -> LLM:
    """An `LLM` over ``base``'s loaded model with other engine settings."""
    llm = LLM.__new__(LLM)
    config = dataclasses.replace(
        base.engine.config, speculative_config=spec, max_num_seqs=batch, num_blocks=blocks
    )
    llm.engine = LLMEngine(base.engine.loaded, config)
    if gate_open:
        llm.engine.set_row_cost(RowCost(math.inf))
    return llm


def main(model: str, repeats: int, workload: str = "w6", draft: str | None = None) -> None:
    torch.set_num_threads(1)
    spec = SPEC if draft is None else {"method": "draft_model", "model": draft, "num_speculative_tokens": 4}
    lines = [json.loads(text) for text in W6.read_text().splitlines()]
    convs, sampling = [line["messages"] for line in lines], [params(line) for line in lines]
    base = LLM(model, num_blocks=16)  # each run's engine has its own pool (`view`)
    blocks, batches = 256, (1, 8)
    if workload == "w1":
        prompts, sampling = w1()
        blocks, batches = 1024, (4, 32)
    elif workload in WORKLOADS:
        prompts, sampling, blocks = peer_workload(workload, base.vocab_size)
        batches = (1,) if workload == "b1" else (256,)
    reference: dict[int, list[list[int]]] = {}
    for rep in range(repeats):
        for batch in batches:
            for mode in ("off", "gated", "open"):
                llm = view(base, None if mode == "off" else spec, batch, mode == "open", blocks)
                start = time.perf_counter()
                if workload != "w6":
                    outs = llm.generate(prompts, sampling, use_tqdm=False)
                else:
                    outs = llm.chat(convs, sampling, use_tqdm=False)
                wall = time.perf_counter() - start
                tokens = [list(c.token_ids) for o in outs for c in o.outputs]
                reference.setdefault(batch, tokens)
                seen = llm.engine.stats.to_dict()["speculation"]
                n = sum(map(len, tokens))
                accepted = {k: (v["accepted"], v["drafted"]) for k, v in seen.get("sources", {}).items()}
                print(
                    rep,
                    f"b{batch}",
                    mode,
                    n,
                    f"{wall:.2f}s",
                    f"{n / wall:.2f} tok/s",
                    "identical" if tokens == reference[batch] else "DIFFERENT",
                    seen.get("tokens_per_seq_step"),
                    seen.get("fixed_over_row_cost"),
                    accepted,
                    seen.get("gated_seq_steps"),
                    flush=True,
                )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), *sys.argv[3:5])
