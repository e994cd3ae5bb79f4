"""The first run on a machine: the C kernels are compiled once, said in one line, all before the timed
generation (their time reported apart); the next run finds them cached and says nothing.

The kernels are built at -O1 (``PAGEDINFER_CC_FLAGS``, after the default -O3): what is tested is when
and how often they are built, not the optimiser's work, which takes -O3 about three times as long."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from cli_helpers import tiny_model

PROBE = """
import json, sys
from pathlib import Path
from pagedinfer import LLM, SamplingParams

cache = Path(sys.argv[2])
llm = LLM(sys.argv[1], device="cpu")
built = sorted(p.name.split("-")[0] for p in cache.glob("*.so"))
llm.generate(["To be"], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
after = sorted(p.name.split("-")[0] for p in cache.glob("*.so"))
print(json.dumps({"built": built, "after": after, "compile_s": llm.stats.kernel_compile_s}))
"""
KERNELS = [
    "cpu_decode_step",
    "cpu_gemm",
    "cpu_llama_ops",
    "cpu_lora",
    "cpu_moe",
    "cpu_paged_decode",
    "cpu_sampling",
]


def test_first_run_compiles_every_cpu_kernel_once_before_generating(tmp_path):
    cache = tmp_path / "kernels"
    env = {**os.environ, "PAGEDINFER_CACHE": str(cache), "PAGEDINFER_CC_FLAGS": "-O1"}
    runs = []
    for _ in range(2):
        run = subprocess.run(
            [sys.executable, "-c", PROBE, str(tiny_model()), str(cache)],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        notes = [line for line in run.stderr.splitlines() if line.startswith("pagedinfer:")]
        runs.append((json.loads(run.stdout.splitlines()[-1]), notes))
    (first, first_notes), (second, second_notes) = runs
    assert first_notes == [f"pagedinfer: compiling CPU kernels (once; cached in {cache})"]
    assert first["built"] == KERNELS and first["after"] == KERNELS  # nothing compiled while generating
    assert first["compile_s"] > 0
    assert second_notes == [] and second["compile_s"] == 0.0 and second["after"] == KERNELS
