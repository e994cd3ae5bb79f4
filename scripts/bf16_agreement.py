"""bfloat16 greedy agreement with transformers on a real model (issue 14's acceptance figure).

The share of 8 chat prompts whose 128-token greedy output from pagedinfer in bfloat16 equals
transformers' bfloat16 ``generate`` (eager attention, one prompt at a time), and where each first
differs. Not asserted by the tests: a packed bfloat16 batch and a single sequence round differently,
so a near-tie between two tokens can go either way. Throughput in bfloat16 against float32 is
``pagedinfer bench --dtype float32,bfloat16`` (docs/bench.md).

    python scripts/bf16_agreement.py ~/.cache/pagedinfer-tests/SmolLM2-135M-Instruct-float32
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's pagedinfer

from pagedinfer import LLM, SamplingParams  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = [  # the real-model tier's chat prompts (tests/test_real_model.py)
    json.loads(line)["messages"][-1]["content"] for line in (ROOT / "prompts" / "questions.jsonl").open()
]


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
    p.add_argument("model_dir", help="a real model directory (e.g. the real-model tier's converted SmolLM2)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    result = agreement(args.model_dir, args.max_tokens)
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
