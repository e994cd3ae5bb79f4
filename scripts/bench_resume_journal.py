"""The cost of keeping unfinished lines' tokens for ``--resume`` (the journal beside the output): a W1-like
job through ``pagedinfer run`` with the journal at its defaults and with ``--resume-every-tokens 0``,
alternating, each run a fresh process and a fresh output; prints each run's generated tok/s (from
``--report-json``) and tokens per CPU second of the process (steadier than the wall clock on a
shared machine), the median of each mode; then one run in this process with the journal on, timing
the journal's own work (`LineJournal.step`: the checks, the writes and their fsyncs) against the run.

    python scripts/bench_resume_journal.py [--model smollm135m|PATH] [--max-tokens N] [--repeats R]
        [--threads T] [--every N]   # --every: the journal's --resume-every-tokens when on (default: its default)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pagedinfer.bench.models import build_model
from pagedinfer.bench.workloads import WORKLOADS, make_prompts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm135m", help="a bench model's name (W1's), or a model path")
    ap.add_argument("--max-tokens", type=int, default=None, help="new tokens per prompt (W1: 64)")
    ap.add_argument("--max-prompt-len", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
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
    per_cpu: dict[str, list[float]] = {m: [] for m in modes}
    report = work / "report.json"
    run = ["run", str(job), "--model", model, "-q", "--device", "cpu", "--no-report"]
    run += ["--threads", str(args.threads)]
    for r in range(args.repeats):
        for mode, extra in modes.items():
            out = work / f"out-{r}-{mode[-3:].strip()}.jsonl"
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            cmd = [sys.executable, "-m", "pagedinfer", *run, "-o", str(out), "--report-json", str(report)]
            subprocess.run([*cmd, *extra], check=True, capture_output=True)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime  # startup included
            doc = json.loads(report.read_text())["throughput"]
            tokens = doc["generated_tokens_per_s"] * doc["wall_time_s"]
            rates[mode].append(doc["generated_tokens_per_s"])
            per_cpu[mode].append(tokens / cpu)
            print(
                f"  {r} {mode:12s} {doc['generated_tokens_per_s']:9.1f} tok/s ({doc['wall_time_s']:.2f} s)"
                f"  {tokens / cpu:9.1f} tok per CPU s ({cpu:.2f} s)",
                flush=True,
            )
    for mode in modes:
        print(
            f"{mode:12s} median {statistics.median(rates[mode]):9.1f} tok/s, "
            f"{statistics.median(per_cpu[mode]):9.1f} tok per CPU s, over {args.repeats} runs"
        )
    for name, got in (("tok/s", rates), ("tok per CPU s", per_cpu)):
        ratio = statistics.median(got["journal on"]) / statistics.median(got["journal off"])
        print(f"on / off ({name}): {ratio:.4f}")
    print(f"the journal's own work in one run: {_journal_share(run, on, work):.3%} of its wall time")


def _journal_share(run: list[str], on: list[str], work: Path) -> float:
    """One run here with the journal on: the time spent in `LineJournal.step` over the run's wall time."""
    import torch

    from pagedinfer.cli.app import app
    from pagedinfer.cli.line_journal import LineJournal

    spent = [0.0]
    step = LineJournal.step

    def timed(self, *a, **kw):
        start = time.perf_counter()
        try:
            return step(self, *a, **kw)
        finally:
            spent[0] += time.perf_counter() - start

    LineJournal.step = timed
    torch.set_num_threads(int(run[run.index("--threads") + 1]))
    start = time.perf_counter()
    with contextlib.suppress(SystemExit):
        app([*run, "-o", str(work / "in-process.jsonl"), *on], standalone_mode=False)
    return spent[0] / (time.perf_counter() - start)


if __name__ == "__main__":
    main()
