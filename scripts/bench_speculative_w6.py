"""W6 (prompts/w6.jsonl) through the API with one model load: speculation off, on with the gate
measured at start-up, and on with the gate open (every match drafted), alternating at batch 1 and 8;
each run's tokens compared with the run off. One torch thread (a shared machine's figures vary less).

    python scripts/bench_speculative_w6.py MODEL REPEATS
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import torch

from pagedinfer import LLM, SamplingParams
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


def view(base: LLM, spec: dict | None, batch: int, gate_open: bool) -> LLM:
    """An `LLM` over ``base``'s loaded model with other engine settings."""
    llm = LLM.__new__(LLM)
    config = dataclasses.replace(base.engine.config, speculative_config=spec, max_num_seqs=batch)
    llm.engine = LLMEngine(base.engine.loaded, config)
    if gate_open:
        llm.engine.set_row_cost(RowCost(math.inf))
    return llm


def main(model: str, repeats: int) -> None:
    torch.set_num_threads(1)
    lines = [json.loads(text) for text in W6.read_text().splitlines()]
    convs, sampling = [line["messages"] for line in lines], [params(line) for line in lines]
    base = LLM(model, num_blocks=256)
    reference: dict[int, list[list[int]]] = {}
    for rep in range(repeats):
        for batch in (1, 8):
            for mode in ("off", "gated", "open"):
                llm = view(base, None if mode == "off" else SPEC, batch, mode == "open")
                start = time.perf_counter()
                outs = llm.chat(convs, sampling, use_tqdm=False)
                wall = time.perf_counter() - start
                tokens = [list(o.outputs[0].token_ids) for o in outs]
                reference.setdefault(batch, tokens)
                spec = llm.engine.stats.to_dict()["speculation"]
                n = sum(map(len, tokens))
                accepted = {k: (v["accepted"], v["drafted"]) for k, v in spec.get("sources", {}).items()}
                print(
                    rep,
                    f"b{batch}",
                    mode,
                    n,
                    f"{wall:.2f}s",
                    f"{n / wall:.2f} tok/s",
                    "identical" if tokens == reference[batch] else "DIFFERENT",
                    spec.get("tokens_per_seq_step"),
                    spec.get("fixed_over_row_cost"),
                    accepted,
                    spec.get("gated_seq_steps"),
                    flush=True,
                )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
