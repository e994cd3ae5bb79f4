"""Start-up wall time of the CLI: the median of several runs of each command, per checkout.

    python scripts/bench_startup.py [--checkout DIR ...] [--runs 5] [--gguf FILE.gguf] [--llamacpp]

Commands timed (each its own process, kernels already cached, output to a temporary folder):
  demo    pagedinfer run prompts/example.jsonl on the demo model
  blocks  pagedinfer blocks (its built-in example)
  gguf    pagedinfer run of one chat line on FILE.gguf, one new token (--max-line-tokens 1)
  help    pagedinfer --help
Each gets its median wall time and the median CPU time (user and system) of its process.
With several checkouts (e.g. the base commit exported into a folder, and this one) the runs alternate
between them, so a machine that gets busier mid-run weighs on both alike. ``--llamacpp`` also times
llama.cpp's load of the same GGUF with one token decoded (the driver scripts/bench_llamacpp.py builds).
``--bytecode`` runs them as an installed package runs, its modules byte-compiled once (into the temporary
folder), where the environment sets PYTHONDONTWRITEBYTECODE and every run would compile them again.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMACPP_DRIVER = Path.home() / ".cache" / "pagedinfer-llamacpp" / "llamacpp_driver"
CHAT_LINE = '{"id": "q", "messages": [{"role": "user", "content": "Who art thou?"}]}\n'


def commands(checkout: Path, tmp: Path, gguf: str | None) -> dict[str, list[str]]:
    """Each timed command's argv, run from ``checkout``."""
    cli = [sys.executable, "-m", "pagedinfer"]
    out = str(tmp / "out.jsonl")
    timed = {
        "demo": cli + ["run", "prompts/example.jsonl", "-o", out, "--quiet"],
        "blocks": cli + ["blocks"],
        "help": cli + ["--help"],
    }
    if gguf is not None:
        chat = tmp / "chat1.jsonl"
        chat.write_text(CHAT_LINE, encoding="utf-8")
        timed["gguf"] = cli + [
            "run",
            str(chat),
            "--model",
            gguf,
            "-o",
            out,
            "--quiet",
            "--max-line-tokens",
            "1",
        ]
    return timed


def wall(argv: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, float]:
    """Seconds ``argv`` ran in ``cwd`` (its own code first on the path) under ``env``, and the CPU
    seconds (user and system) it used: on a busy machine the second moves far less than the first.
    Raises if it failed."""
    env = dict(env, PYTHONPATH=str(cwd))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    res = subprocess.run(argv, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed in {cwd} ({res.returncode}): {res.stderr[-400:]}")
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return elapsed, cpu


def llamacpp_argv(gguf: str, tmp: Path) -> list[str]:
    """The llama.cpp driver loading ``gguf`` and decoding one token of a one-token prompt."""
    spec = tmp / "workload-load.txt"
    spec.write_text("1 1 1 1\n1 1\n1 1\n", encoding="utf-8")  # n max_new prompts warm_new; warm-up; prompt
    return [str(LLAMACPP_DRIVER), gguf, str(spec), "2"]


def cpu_name() -> str:
    """The CPU's model name (lscpu's), or the platform's processor string."""
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--checkout", type=Path, action="append", help="a source tree to time (default: this one)"
    )
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--gguf", help="a GGUF model for the one-line run")
    parser.add_argument("--llamacpp", action="store_true", help="also time llama.cpp's load of --gguf")
    parser.add_argument("--only", nargs="*", help="command names to time (demo blocks gguf help)")
    parser.add_argument("--bytecode", action="store_true", help="modules byte-compiled once, as installed")
    args = parser.parse_args()
    checkouts = [c.resolve() for c in (args.checkout or [ROOT])]
    times: dict[tuple[str, str], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        env = dict(os.environ)
        if args.bytecode:  # written by the untimed runs below, read by the timed ones
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            env["PYTHONPYCACHEPREFIX"] = str(tmp / "bytecode")
        timed = {c: commands(c, tmp, args.gguf) for c in checkouts}
        names = [n for n in timed[checkouts[0]] if not args.only or n in args.only]
        for checkout in checkouts:  # one untimed run each: byte-compiled modules, kernels cached
            for name in names:
                wall(timed[checkout][name], checkout, env)
        extra = llamacpp_argv(args.gguf, tmp) if args.llamacpp and args.gguf else None
        for _ in range(args.runs):
            for name in names:
                for checkout in checkouts:
                    run = wall(timed[checkout][name], checkout, env)
                    times.setdefault((str(checkout), name), []).append(run)
                if extra is not None and name == "gguf":
                    times.setdefault(("llama.cpp", "gguf load"), []).append(wall(extra, tmp, env))
    compiled = "byte-compiled modules" if args.bytecode else "modules as the environment has them"
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores; {compiled}; median of {args.runs} runs (min-max), s")
    print(f"{'command':10s} {'wall':>6s}  {'(min-max)':13s}  {'cpu':>6s}  checkout")
    for (where, name), runs in times.items():
        walls, cpus = [w for w, _ in runs], [c for _, c in runs]
        spread = f"({min(walls):.2f}-{max(walls):.2f})"
        print(
            f"{name:10s} {statistics.median(walls):6.2f}  {spread:13s}  {statistics.median(cpus):6.2f}  {where}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
