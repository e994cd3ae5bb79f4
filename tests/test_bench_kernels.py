"""scripts/bench_kernels.py end to end in its CPU smoke mode (tiny shapes through the CUDA shim), so the
script the GPU run depends on is known to work before a GPU is available."""

from __future__ import annotations

import re
from pathlib import Path

from cli_helpers import run_script

ROOT = Path(__file__).resolve().parents[1]


def table_rows(output: str, title: str) -> list[list[str]]:
    """The data rows of the Markdown table under the heading that starts with ``title``."""
    section = output.split(f"## {title}", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[2:]]  # past header and rule


def test_bench_kernels_smoke_prints_both_tables():
    out = run_script("bench_kernels.py", "--smoke")
    assert "WRONG" not in out
    decode = table_rows(out, "decode:")
    # 2 dtypes x batch {1, 3} x context {40, 300}, less batch 3 x context 300 over the memory budget
    assert sorted((r[0], r[2], r[3]) for r in decode) == sorted(
        (d, b, c) for d in ("bf16", "fp16") for b, c in (("1", "40"), ("1", "300"), ("3", "40"))
    )
    assert all(re.fullmatch(r"\d+\.\d+x", r[6]) and r[7].endswith("%") for r in decode)
    assert [r[8] for r in decode if r[3] == "300"] == ["2", "2"]  # 2 partitions of 256 keys
    assert "bf16 head 64 batch 3 context 300" in out.split("skipped (", 1)[1].splitlines()[0]
    sweep = table_rows(out, "decode partition sweep")
    assert [r[1] for r in sweep] == ["1", "2"]  # DECODE_BLOCKS_PER_SM 0 and 4 (default)
    prefill = table_rows(out, "prefill/extend")
    assert [(r[0], r[1]) for r in prefill] == [("16", "0"), ("16", "50"), ("40", "0"), ("40", "50")]
    assert all(re.fullmatch(r"\d+\.\d+x", r[5]) for r in prefill)
