"""scripts/bench_gemv.py: the linear it times is copies of one linear's panels in memory of their own
(each copy's columns equal the original's products), and it runs end to end on tiny shapes."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch
from cli_helpers import run_script
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import bench_gemv  # noqa: E402
from bench_gemm import build  # noqa: E402


def test_copies_give_the_original_products_in_memory_of_their_own():
    torch.manual_seed(0)
    one = build("Q4_0", [nn.Linear(64, 48, bias=False)])[0]
    big, n = bench_gemv.copies_of(one, 1)  # 1 MB of 64 x 48 Q4_0 panels: many copies
    assert n == -(-(1 << 20) // sum(s.nbytes for s in one.segments)) and len(big.segments) == n
    assert len({s.panels.data_ptr() for s in big.segments}) == n
    x = torch.randn(3, 64)  # [rows, in]
    with torch.inference_mode():
        assert torch.equal(big(x), one(x).repeat(1, n))


def test_runs_end_to_end_on_tiny_shapes():
    args = "--rows 1,3 --threads 1 --repeats 1 --mb 1 --paths f32,int8 --shapes 64x48,96x32 --cpu-time"
    lines = run_script("bench_gemv.py", args).splitlines()
    assert re.fullmatch(r"read rate \(sum of 4 MB float32, 1 threads\): [\d.]+ GB/s", lines[0])
    cell = r"[\d.]+ \([\d.]+, ([\d.]+)\)"
    rows = [
        re.fullmatch(rf"\| (\S+) \| (\S+) \| ([\d.]+) \| {cell} \| {cell} \|", line) for line in lines[3:]
    ]
    assert [(m[1], m[2]) for m in rows] == [(s, p) for s in ("64x48", "96x32") for p in ("f32", "int8")]
    # float32; int8 with a float32 scale per column (48 and 32: whole panels of 16, no padding)
    assert [m[3] for m in rows] == ["4.000", f"{1 + 4 / 64:.3f}", "4.000", f"{1 + 4 / 96:.3f}"]
    assert all(m[4] == "1.00" for m in rows)  # the first row count is the reference
