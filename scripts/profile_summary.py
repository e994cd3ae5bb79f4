#!/usr/bin/env python
"""Summarise a py-spy ``--format raw`` profile of pagedinfer into where the step time goes.

Record the timed part of a benchmark run, then summarise it::

    py-spy record --rate 200 --format raw -o w1.txt -- \\
        python scripts/bench_throughput.py --workloads W1 --systems pagedinfer --in-process
    python scripts/profile_summary.py w1.txt

Only samples under ``--root`` (default ``time_system``: the timed runs, not loading or warm-up)
count. Each sample goes to the category of its deepest recognised Python frame; with
``py-spy --native`` each category is also split by where the leaf frame is: the Python interpreter
and torch's Python bindings (``python``), ATen/libc kernels and dispatch (``aten``) or our own
compiled kernel (``kernel``).
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict

PLUMBING = ("Module._call_impl", "Module._wrapped_call_impl", "wrapped_func", "wrapper")

# (category, file substring, function substring or None), tried on each Python frame, deepest first
RULES = [
    ("attention: decode kernel (C, paged_decode.paged_decode)", "pagedinfer/attention/paged_decode.py", None),
    ("attention: CUDA kernels", "pagedinfer/attention/cuda_kernels.py", None),
    (
        "metadata: per-step attention plan (PortablePlan.build/_masks)",
        "pagedinfer/attention/portable_backend.py",
        "PortablePlan.build",
    ),
    (
        "metadata: per-step attention plan (PortablePlan.build/_masks)",
        "pagedinfer/attention/portable_backend.py",
        "PortablePlan._masks",
    ),
    ("attention: KV write + torch attend (prefill chunks)", "pagedinfer/attention/", None),
    ("metadata: ModelRunner.build_metadata", "pagedinfer/model/runner.py", "build_metadata"),
    ("runner glue (ModelRunner.execute: keep rows, logits.float)", "pagedinfer/model/runner.py", None),
    ("sampler", "pagedinfer/model/sampler.py", None),
    ("scheduler + block pool", "pagedinfer/core/", None),
    ("model: one-call C decode step (GEMMs, attention, norms)", "pagedinfer/model/decode_step.py", None),
    ("model: Linear matmuls (q/k/v/o, MLP, lm_head)", "torch/nn/modules/linear.py", None),
    ("model: Linear matmuls (q/k/v/o, MLP, lm_head)", "pagedinfer/model/packed_linear.py", None),
    ("model: other ops (norm, RoPE, SiLU, embedding)", "pagedinfer/model/", None),
    ("model: other ops + HF/nn.Module Python (norm, RoPE, SiLU, embedding)", "transformers/", None),
    ("model: other ops + HF/nn.Module Python (norm, RoPE, SiLU, embedding)", "torch/nn/", None),
    ("engine loop (step, _advance, _append, stats)", "pagedinfer/", None),
]
FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?)(?::\d+)?\)$")


def classify(frames: list[str]) -> str:
    parsed = [m.groupdict() for f in frames if (m := FRAME.match(f))]
    python = [p for p in parsed if ".py" in p["file"]]
    for depth in range(len(python) - 1, -1, -1):
        func, file = python[depth]["func"], python[depth]["file"]
        for category, where, name in RULES:
            if where in file and (name is None or name in func):
                if "linear.py" in file:
                    parent = next(
                        (p["func"] for p in reversed(python[:depth]) if not p["func"].endswith(PLUMBING)), ""
                    )
                    if parent.endswith("ForCausalLM.forward"):
                        return "model: lm_head matmul"
                return category
    return "other (harness, Python runtime)"


def leaf_kind(frames: list[str]) -> str:
    m = FRAME.match(frames[-1])
    file = m.group("file") if m else ""
    if ".py" in file or "libpython" in file or "libtorch_python" in file or file.endswith(".c"):
        return "python"
    if "cpu_paged_decode" in file or "pagedinfer" in file:
        return "kernel"
    return "aten"


def summarise(path: str, root: str) -> tuple[int, Counter, dict[str, Counter], bool]:
    totals: Counter = Counter()
    kinds: dict[str, Counter] = defaultdict(Counter)
    native = False
    count = 0
    with open(path) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if root not in stack:
                continue
            frames = stack.split(";")
            category = classify(frames)
            totals[category] += int(n)
            kind = leaf_kind(frames)
            native |= kind != "python"
            kinds[category][kind] += int(n)
            count += int(n)
    return count, totals, kinds, native


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("profile", help="py-spy --format raw output")
    p.add_argument(
        "--root", default="time_system", help="only samples with this frame (default: the timed runs)"
    )
    args = p.parse_args(argv)
    count, totals, kinds, native = summarise(args.profile, args.root)
    if not count:
        raise SystemExit(f"no samples under {args.root!r} in {args.profile}")
    print(f"{count} samples under {args.root}")
    header = "| category | share |" + (" python | aten | kernel |" if native else "")
    print(header)
    print("|---|---:|" + ("---:|---:|---:|" if native else ""))
    for category, n in totals.most_common():
        row = f"| {category} | {100 * n / count:.1f}% |"
        if native:
            row += "".join(
                f" {100 * kinds[category][k] / count:.1f}% |" for k in ("python", "aten", "kernel")
            )
        print(row)
    if native:
        overall = Counter()
        for c in kinds.values():
            overall.update(c)
        print(
            "leaf frames overall: "
            + ", ".join(f"{k} {100 * overall[k] / count:.1f}%" for k in ("python", "aten", "kernel"))
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
