"""scripts/bench_gemm.py --shape: copies of one linear of that shape (64 MB of float32 in all) stand in for
SmolLM2's stack, and every row count is timed for every path."""

from __future__ import annotations

import re

from cli_helpers import run_script


def test_shape_sweep_runs_copies_of_one_linear():
    args = "--shape 2048x2048 --rows 1,7 --threads 1 --repeats 1 --paths f32,int8 --cpu-time"
    lines = run_script("bench_gemm.py", args).splitlines()
    assert lines[0] == "4 linears, 67 MB float32, 1 threads"  # 64 MB / (2048 * 2048 * 4 bytes)
    # int8: a byte a weight and a float32 scale per output column
    assert lines[1] == f"bytes per weight: f32 4.000, int8 {1 + 4 / 2048:.3f}"
    cell = r"[\d.]+ \([\d.]+, \d+\)"
    assert [re.fullmatch(rf"\| (\d+) \| {cell} \| {cell} \|", line)[1] for line in lines[4:]] == ["1", "7"]
