"""The cost of keeping unfinished lines' tokens for ``--resume`` (the journal beside the output): a W1-like
job through ``pagedinfer run`` with the journal at its defaults and with ``--resume-every-tokens 0``,
alternating, each run a fresh process and a fresh output; prints each run's generated tok/s (from
``--report-json``) and the median of each mode.

    python scripts/bench_resume_journal.py [--model smollm135m|PATH] [--max-tokens N] [--repeats R]
        [--threads T] [--every N]   # --every: the journal's --resume-every-tokens when on (default: its default)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from pagedinfer.bench.models import build_model
from pagedinfer.bench.workloads import WORKLOADS, make_prompts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm135m", help="a bench model's name (W1's), or a model path")
    ap.add_argument("--max-tokens", type=int, default=None, help="new tokens per prompt (W1: 64)")
    ap.add_argument("--max-prompt-len", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--every", type=int, default=None)
    ap.add_argument(
        "--model-cache", type=Path, default=Path(tempfile.gettempdir()) / "pagedinfer-bench-models"
    )
    args = ap.parse_args()
    w = WORKLOADS["W1"]
    if Path(args.model).exists():
        model, vocab = args.model, json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    else:
        built = build_model(args.model, args.model_cache)
        model, vocab = str(built.path), built.vocab_size
    prompts, max_tokens = make_prompts(w, vocab)
    work = Path(tempfile.mkdtemp(prefix="bench-resume-"))
    job = work / "w1.jsonl"
    with job.open("w") as f:
        for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True)):
            line = {"id": i, "prompt_token_ids": p[: args.max_prompt_len], "max_tokens": args.max_tokens or m}
            f.write(json.dumps({**line, "n": w.n, "temperature": w.temperature, "ignore_eos": True}) + "\n")
    on = [] if args.every is None else ["--resume-every-tokens", str(args.every)]
    modes = {"journal on": on, "journal off": ["--resume-every-tokens", "0"]}
    print(
        f"W1-like: {len(prompts)} prompts, n={w.n}, model {model}, threads {args.threads}, on: {on or 'defaults'}"
    )
    rates: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(args.repeats):
        for mode, extra in modes.items():
            out, report = work / f"out-{r}-{mode[-3:].strip()}.jsonl", work / "report.json"
            cmd = [
                sys.executable,
                "-m",
                "pagedinfer",
                "run",
                str(job),
                "--model",
                model,
                "-o",
                str(out),
                "-q",
            ]
            cmd += [
                "--device",
                "cpu",
                "--no-report",
                "--threads",
                str(args.threads),
                "--report-json",
                str(report),
            ]
            subprocess.run([*cmd, *extra], check=True, capture_output=True)
            doc = json.loads(report.read_text())["throughput"]
            rates[mode].append(doc["generated_tokens_per_s"])
            print(
                f"  {r} {mode:12s} {doc['generated_tokens_per_s']:9.1f} tok/s  ({doc['wall_time_s']:.2f} s)",
                flush=True,
            )
    for mode, got in rates.items():
        print(f"{mode:12s} median {statistics.median(got):9.1f} tok/s over {len(got)} runs")
    ratio = statistics.median(rates["journal on"]) / statistics.median(rates["journal off"])
    print(f"on / off: {ratio:.4f}")


if __name__ == "__main__":
    main()
