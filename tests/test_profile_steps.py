"""scripts/profile_steps.py's bound: the bytes it counts are every linear's weights once per forward
pass and the K/V of every block a step's sequences attend over, on the demo model end to end."""

from __future__ import annotations

import re
from pathlib import Path

from cli_helpers import run_script

DEMO = Path(__file__).resolve().parents[1] / "pagedinfer" / "demo_model"


def test_the_bound_counts_each_pass_weights_and_each_steps_context():
    args = f"{DEMO} --prompts 8 --prompt-len 64 --max-new 8 --threads 1 --fma-peak 100 --read-rate 10"
    out = run_script("profile_steps.py", args)
    m = re.search(
        r"^bound: ([\d.]+) GFLOP at 100.0 GFLOP/s = [\d.]+ s, plus (\d+) passes x ([\d.]+) MB "
        r"of weights and ([\d.]+) MB of K/V at 10.0 GB/s",
        out,
        re.M,
    )
    assert m, out
    # one prompt step and 7 decode steps
    assert int(m[2]) == 8
    # the demo model's linears (4 layers of 256 -> 512 QKV, 256 -> 256, 256 -> 2 x 688, 688 -> 256, and the
    # tied 4096 x 256 head), float32
    assert m[3] == f"{(4 * 256 * (512 + 256 + 1376 + 688) + 4096 * 256) * 4 / 1e6:.1f}"
    # K/V of a token: 4 layers x K and V x 2 KV heads x 64 x 4 bytes; the prompt step reads each prompt's 64
    # positions, decode step t (1-7) each sequence's 64 + t
    tokens = 8 * 64 + sum(8 * (64 + t) for t in range(1, 8))
    assert m[4] == f"{tokens * 4 * 2 * 2 * 64 * 4 / 1e6:.1f}"
