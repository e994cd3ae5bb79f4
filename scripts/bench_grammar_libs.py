"""llguidance against xgrammar on the CPU: compile time and token-mask time per step at batch 1, 16, 64.

The 64 JSON schemas of prompts/extraction.jsonl on SmolLM2-135M-Instruct's tokenizer (49152 tokens).
Each matcher follows a valid JSON document of its schema, token by token (the tokenizer's own
tokenization): every step fills one bitmask row per live matcher, in one batched call of each
library (llguidance `LLExecutor`, xgrammar `BatchGrammarMatcher`), then each matcher accepts its next
token. The libraries run alternately, several repeats. xgrammar is not a dependency of pagedinfer:
install it beside it to run this (``pip install --target DIR --no-deps xgrammar apache-tvm-ffi`` and
``PYTHONPATH=DIR``; its triton dependency is only for GPUs).

    python scripts/bench_grammar_libs.py --model ~/.cache/pagedinfer-tests/SmolLM2-135M-Instruct-float32
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

REPO = Path(__file__).resolve().parents[1]
# one valid document per schema kind of prompts/extraction.jsonl (the id's prefix)
DOCS = {
    "person": {"name": "Maria Lopez", "age": 34, "city": "Madrid"},
    "product": {"product": "AeroPress coffee maker", "price": 39.95, "currency": "USD", "in_stock": True},
    "event": {"title": "Python Developers Summit", "date": "2025-05-14", "attendees": 1200},
    "book": {"title": "Dune", "author": "Frank Herbert", "year": 1965, "genres": ["science fiction"]},
    "sentiment": {"sentiment": "positive", "confidence": 0.93},
    "address": {"street": "221B Baker Street", "city": "London", "postal_code": "NW1 6XE", "country": "UK"},
    "order": {"order_id": "A-1043", "items": [{"name": "notebook", "quantity": 2}], "total": 12.5},
    "weather": {"location": "Oslo", "temperature_c": -3, "condition": "snowy"},
}


def workload(tok) -> list[tuple[str, list[int]]]:
    """(schema as JSON text, the token ids of a valid document + EOS) for each of the 64 lines."""
    out = []
    for line in (REPO / "prompts" / "extraction.jsonl").open():
        obj = json.loads(line)
        schema = obj["structured_outputs"]["json"]
        doc = DOCS[obj["id"].split("-")[0]]
        ids = tok(json.dumps(doc), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        out.append((json.dumps(schema), ids))
    return out


class Guidance:
    name = "llguidance"

    def __init__(self, tok, vocab: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll, self.llt = llguidance, llguidance.torch
        self.tokenizer = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
        self.executor = llguidance.LLExecutor()
        self.vocab = vocab

    def compile(self, schema: str):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema)
        matcher = self.ll.LLMatcher(self.tokenizer, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, matchers, bitmask) -> None:
        self.llt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def accept(self, matcher, token: int) -> None:
        assert matcher.consume_token(token), matcher.get_error()


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok, vocab: int) -> None:
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
        self.compiler = xgrammar.GrammarCompiler(
            info, max_threads=torch.get_num_threads(), cache_enabled=False
        )
        self.batch = xgrammar.BatchGrammarMatcher()

    def compile(self, schema: str):
        return self.compiler.compile_json_schema(schema)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matchers, bitmask) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matcher, token: int) -> None:
        assert matcher.accept_token(token)


def run(lib, work: list[tuple[str, list[int]]], batch: int, vocab: int, compiled: dict) -> dict:
    """Compile the schemas not in ``compiled`` yet, then step ``batch`` matchers to their ends."""
    rows = work[:batch] if batch <= len(work) else (work * (batch // len(work) + 1))[:batch]
    t0 = time.perf_counter()
    for schema, _ in rows:
        if schema not in compiled:
            compiled[schema] = lib.compile(schema)
    compile_s = time.perf_counter() - t0
    matchers = [lib.matcher(compiled[s]) for s, _ in rows]
    bitmask = torch.full((batch, (vocab + 31) // 32), -1, dtype=torch.int32)
    live = list(range(batch))
    step, mask_s, tokens = 0, 0.0, 0
    while live:
        t = time.perf_counter()
        lib.fill([matchers[i] for i in live], bitmask)
        mask_s += time.perf_counter() - t
        for i in live:
            lib.accept(matchers[i], rows[i][1][step])
        tokens += len(live)
        step += 1
        live = [i for i in live if step < len(rows[i][1])]
    return {
        "compile_s": compile_s,
        "mask_ms_per_step": 1e3 * mask_s / step,
        "mask_us_per_token": 1e6 * mask_s / tokens,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a model directory with SmolLM2's tokenizer")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    vocab = 49152
    work = workload(tok)
    libs = []
    for cls in (Guidance, XGrammar):
        try:
            libs.append(cls(tok, vocab))
        except ImportError as e:
            print(f"{cls.name}: not installed ({e})")
    results: dict = {}
    for batch in map(int, args.batches.split(",")):
        for _ in range(args.repeats):
            for lib in libs:  # alternating; "cold": schemas compiled now, "warm": the same compiled again
                compiled: dict = {}
                for state in ("cold", "warm"):
                    results.setdefault((lib.name, batch, state), []).append(
                        run(lib, work, batch, vocab, compiled)
                    )
    print("| library | batch | grammars | compile s | mask ms / step | mask us / token |")
    print("| --- | --- | --- | --- | --- | --- |")
    for (name, batch, state), runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(
            f"| {name} | {batch} | {state} | {med['compile_s']:.3f} | {med['mask_ms_per_step']:.3f} | "
            f"{med['mask_us_per_token']:.1f} |"
        )


if __name__ == "__main__":
    main()
