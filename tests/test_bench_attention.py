"""scripts/bench_attention.py: its batches hold what the kernel is timed on, and it runs end to end on
tiny shapes, one line per shape and pool type."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch
from cli_helpers import run_script

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import bench_attention  # noqa: E402


def test_prompt_batch_gives_each_row_its_sequences_blocks():
    """Two prompts of 40 and 3 tokens as prompt rows: each row reads its own sequence's table, the two
    sequences' blocks are distinct blocks of the pool, and the shapes are SmolLM2's."""
    lens = [t + 1 for t in range(40)] + [1, 2, 3]
    tables_of = [0] * 40 + [1] * 3
    q, k, v, tables, ctx, rows = bench_attention.batch(lens, tables_of, torch.float16, [9, 3, 64], seed=0)
    assert q.shape == (43, 9, 64) and q.dtype == torch.float32
    assert k.shape == v.shape == (4, 16, 3, 64) and k.dtype == torch.float16  # 3 blocks, then 1
    assert ctx.tolist() == lens and rows.tolist() == list(range(43))
    first, second = tables[0, :3].tolist(), tables[40, :1].tolist()
    assert all(tables[i, :3].tolist() == first for i in range(40))
    assert sorted(first + second) == [0, 1, 2, 3]


def test_runs_end_to_end_on_tiny_shapes():
    args = "--isa native --no-machine --prompt-contexts 20 --prompt-batches 1 --decode-contexts 33"
    args += " --decode-batches 2 --seconds 0.001 --repeats 1 --kv-dtype float32,float16"
    args += " --draft-contexts 33 --draft-rows 3"
    lines = run_script("bench_attention.py", args, BENCH_ATTENTION_CHILD="1").splitlines()
    assert lines[0].startswith("CPU: ") and "1 thread(s), thread CPU time" in lines[0]
    rates = [
        re.fullmatch(
            r"\s+(prompt|decode)\s+context\s+(\d+) batch\s+(\d+):\s+[\d.]+ ms\s+([\d.]+) (GFLOP/s|GB/s of K/V)",
            line,
        )
        for line in lines
        if "context" in line and "drafted" not in line
    ]
    assert [(m[1], m[2], m[3], m[5]) for m in rates] == [
        ("prompt", "20", "1", "GFLOP/s"),
        ("decode", "33", "2", "GB/s of K/V"),
    ] * 2
    assert all(float(m[4]) > 0 for m in rates)
    drafted = [
        re.fullmatch(
            r"\s+drafted context\s+33: 1 row [\d.]+ ms, 3 rows of one sequence [\d.]+ ms \([\d.]+x\), "
            r"of 3 sequences [\d.]+ ms \([\d.]+x\)",
            line,
        )
        for line in lines
        if "drafted" in line
    ]
    assert len(drafted) == 2 and all(drafted)  # one a K/V dtype
