"""Structured outputs against free generation: the 64 JSON-schema extraction prompts of
prompts/extraction.jsonl on SmolLM2-135M-Instruct, in one process.

For each setting (n=1 greedy, n=4 sampled at temperature 1, n=4 greedy) it runs, alternately and
``--repeats`` times, the constrained requests (each line's ``structured_outputs``) and the same
prompts unconstrained. The unconstrained run generates exactly as many tokens per request as the
constrained one's longest completion (``min_tokens = max_tokens``, EOS ignored), so both decode the same
batches for as many steps and the ratio of their tokens/s is what the grammar costs. The prefix
cache is reset before every run. Reported: tokens/s of both and their ratio, the grammar masks'
share of the constrained run's wall time (llguidance filling them, overlapping the forward pass;
the sampler waiting for them; applying them), the compile cache's figures, and the fraction of
constrained outputs that parse and validate against their schema (``jsonschema``).

    python scripts/bench_structured.py --model ~/.cache/pagedinfer-tests/SmolLM2-135M-Instruct-float32
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jsonschema
import torch

from pagedinfer import LLM, SamplingParams

REPO = Path(__file__).resolve().parents[1]
SETTINGS = {
    "n=1 greedy": dict(n=1, temperature=0),
    "n=4 sampled": dict(n=4, temperature=1.0, seed=1234),
    "n=4 greedy": dict(n=4, temperature=0),
}


def load_lines(tokenizer) -> list[tuple[list[int], dict, int]]:
    """(prompt token ids, structured_outputs, max_tokens) per line, the chat template applied."""
    out = []
    for line in (REPO / "prompts" / "extraction.jsonl").open():
        obj = json.loads(line)
        ids = tokenizer.apply_chat_template(obj["messages"], add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        out.append((list(ids), obj["structured_outputs"], obj["max_tokens"]))
    return out


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[list, float]:
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - start
    errors = [o.error for o in outs if o.error]
    if errors:
        raise SystemExit(f"requests failed: {errors[:3]}")
    return outs, wall


def valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="SmolLM2-135M-Instruct as a float32 model directory")
    ap.add_argument("--settings", default=",".join(SETTINGS), help=f"comma list of: {', '.join(SETTINGS)}")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, help="also write every figure here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, device="cpu", dtype="float32")
    lines = load_lines(llm.tokenizer)
    prompts = [p for p, _, _ in lines]
    report: dict = {}
    for name in args.settings.split(","):
        fields = SETTINGS[name]
        rows: dict = {"constrained": [], "free": []}
        for _ in range(args.repeats):
            params = [SamplingParams(**fields, max_tokens=m, structured_outputs=so) for _, so, m in lines]
            outs, wall = run(llm, prompts, params)
            s = llm.stats
            tokens = s.generated_tokens
            ok = [
                valid(c.text, so["json"])
                for o, (_, so, _) in zip(outs, lines, strict=True)
                for c in o.outputs
            ]
            stopped = sum(c.finish_reason == "stop" for o in outs for c in o.outputs)
            rows["constrained"].append(
                {
                    "tokens": tokens,
                    "wall_s": wall,
                    "tok_s": tokens / wall,
                    "valid": sum(ok) / len(ok),
                    "stopped": stopped / len(ok),
                    "mask_fill_share": s.structured.mask_s / wall,
                    "mask_wait_share": s.structured.mask_wait_s / wall,
                    "mask_apply_share": s.structured.apply_s / wall,
                    "grammars_compiled": s.structured.compiles,
                    "grammar_cache_hits": s.structured.cache_hits,
                    "compile_s": s.structured.compile_s,
                    "peak_running_seqs": s.peak_running_seqs,
                }
            )
            lengths = [max(len(c.token_ids) for c in o.outputs) for o in outs]
            free_params = [
                SamplingParams(**fields, max_tokens=m, min_tokens=m, ignore_eos=True) for m in lengths
            ]
            _, wall = run(llm, prompts, free_params)
            tokens = llm.stats.generated_tokens
            rows["free"].append({"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall})
        report[name] = rows
        c, f = rows["constrained"], rows["free"]
        ratio = statistics.median(a["tok_s"] / b["tok_s"] for a, b in zip(c, f, strict=True))
        med = {k: statistics.median(r[k] for r in c) for k in c[0]}
        print(
            f"{name}: constrained {med['tok_s']:.1f} tok/s ({med['tokens']:.0f} tokens, peak batch "
            f"{med['peak_running_seqs']:.0f}) vs unconstrained {statistics.median(r['tok_s'] for r in f):.1f} "
            f"tok/s: ratio {ratio:.3f} (median of {len(c)} alternating pairs); masks: fill "
            f"{100 * med['mask_fill_share']:.2f}% of wall (overlapped), wait {100 * med['mask_wait_share']:.2f}%, "
            f"apply {100 * med['mask_apply_share']:.2f}%; valid {100 * min(r['valid'] for r in c):.1f}% "
            f"(stopped {100 * min(r['stopped'] for r in c):.1f}%); grammars compiled "
            f"{c[0]['grammars_compiled']} in {c[0]['compile_s']:.3f} s, cache hits {c[0]['grammar_cache_hits']}",
            flush=True,
        )
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
