"""scripts/bench_speculative_w6.py runs end to end (off, gated, gate open; batch 1 and 8) on the demo
model, every run's tokens those of the run without speculation."""

from __future__ import annotations

from pathlib import Path

from cli_helpers import run_script

DEMO = Path(__file__).resolve().parents[1] / "pagedinfer" / "demo_model"


def test_runs_end_to_end_with_the_same_tokens_on_and_off():
    lines = [line.split() for line in run_script("bench_speculative_w6.py", f"{DEMO} 1").splitlines()]
    assert [(f[1], f[2]) for f in lines] == [(b, m) for b in ("b1", "b8") for m in ("off", "gated", "open")]
    assert {f[3] for f in lines} == {lines[0][3]}  # the same token count in every run
    assert all(f[7] == "identical" for f in lines)
