"""Run every ``prompts/*.jsonl`` on the demo model (and, with ``--gguf``, the chat lines on a GGUF model)
and write each output file, with the fields that are the wall clock by definition masked, into one
folder: two checkouts' folders are then compared with ``diff -r`` (a refactoring must leave them equal).

    python scripts/snapshot_outputs.py OUT_DIR [--gguf FILE.gguf] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLOCK_FIELDS = ("created",)  # OpenAI records: the Unix time the record was made


def masked(line: str) -> str:
    """``line`` (one output record) with the wall-clock fields set to 0, wherever they nest."""

    def walk(value):
        if isinstance(value, dict):
            return {k: (0 if k in CLOCK_FIELDS else walk(v)) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        return value

    return json.dumps(walk(json.loads(line)), ensure_ascii=False)


def run(prompts: Path, out: Path, model: str | None) -> int:
    """One ``pagedinfer run`` of ``prompts`` into ``out`` (masked); its exit code."""
    raw = out.with_suffix(".raw")
    command = [sys.executable, "-m", "pagedinfer", "run", str(prompts), "-o", str(raw), "--quiet"]
    if model is not None:  # chat lines run to the end of the context unless capped
        command += ["--model", model, "--max-line-tokens", "64"]
    code = subprocess.run(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
    lines = raw.read_text(encoding="utf-8").splitlines() if raw.exists() else []
    out.write_text("".join(masked(line) + "\n" for line in lines), encoding="utf-8")
    raw.unlink(missing_ok=True)
    return code


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", type=Path)
    parser.add_argument(
        "--gguf", help="a GGUF model to run prompts/chat.jsonl and prompts/questions.jsonl on"
    )
    parser.add_argument("--only", nargs="*", help="prompt file names (without .jsonl) to run")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    jobs = [(p, args.out / f"demo-{p.stem}.jsonl", None) for p in sorted((ROOT / "prompts").glob("*.jsonl"))]
    if args.gguf:
        jobs += [
            (ROOT / "prompts" / f"{name}.jsonl", args.out / f"gguf-{name}.jsonl", args.gguf)
            for name in ("chat", "questions")
        ]
    if args.only:
        jobs = [job for job in jobs if job[0].stem in args.only]
    for prompts, out, model in jobs:
        code = run(prompts, out, model)
        print(f"{out.name}: exit {code}, {len(out.read_text().splitlines())} records", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
