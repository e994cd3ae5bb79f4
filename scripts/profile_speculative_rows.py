"""What a decode step of R rows costs against one of 1 row (speculative decoding's drafted rows), and
where the time goes: each step shape timed whole (median of repeats, alternating), then again with
wall-clock timers around the model's linears (by attribute name), attention and the rest, on the
layer-by-layer path (a 1-row step is also timed on the one-call C decode step, the path a plain
decode step takes). The probe's positions start at ``--context`` (K/V there is scratch: the cost is
that of attending over as many positions).

    python scripts/profile_speculative_rows.py MODEL [--rows 1,2,3,4,6] [--context 384] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_ops import Timers  # noqa: E402

from pagedinfer import LLM  # noqa: E402
from pagedinfer.engine.row_cost import _Probe  # noqa: E402


class _Later(_Probe):
    """A probe whose rows sit at positions ``start`` .. ``start + num_tokens``."""

    def __post_init__(self) -> None:
        self.token_ids = [0] * (self.start + self.num_tokens)

    @property
    def step_token_ids(self) -> list[int]:
        return self.token_ids[self.start :]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--rows", default="1,2,3,4,6")
    ap.add_argument("--context", type=int, default=384)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(1)
    engine = LLM(args.model, num_blocks=256).engine
    runner, counts = engine.runner, [int(r) for r in args.rows.split(",")]
    tables: list[list[int]] = [[] for _ in range(engine.pool.num_groups)]  # per layer group
    for g, table in enumerate(tables):
        engine.pool.reserve(table, 0, args.context + max(counts), g)

    def probe(rows: int) -> list[_Probe]:
        return [_Later(tables, rows, start=args.context)]

    def timed(layered: bool) -> dict[int, float]:
        one_call = runner.one_call
        if layered:
            runner.one_call = lambda meta, lora: None
        times: dict[int, list[float]] = {r: [] for r in counts}
        try:
            for i in range(args.repeats + 1):
                for r in counts:
                    start = time.perf_counter()
                    runner.execute(probe(r), [])
                    if i:
                        times[r].append(time.perf_counter() - start)
        finally:
            runner.one_call = one_call
        return {r: statistics.median(t) * 1e3 for r, t in times.items()}

    plain = timed(False)
    layered = timed(True)
    print(f"context {args.context}, median of {args.repeats}, 1 thread")
    print(f"{'rows':>4s} {'step ms':>8s} {'x 1-row':>8s} {'layered ms':>11s}")
    for r in counts:
        print(f"{r:4d} {plain[r]:8.2f} {plain[r] / plain[counts[0]]:8.2f} {layered[r]:11.2f}")
    timers = Timers()
    timers.install(engine.loaded.model)
    runner.one_call = lambda meta, lora: None
    for r in counts:
        timers.seconds.clear()
        timers.calls.clear()
        for _ in range(args.repeats):
            runner.execute(probe(r), [])
        print(f"\n{r} rows, layer by layer, ms per step (inclusive):")
        for name, s in sorted(timers.seconds.items(), key=lambda kv: -kv[1]):
            print(f"  {name:34s} {s / args.repeats * 1e3:8.2f}")


if __name__ == "__main__":
    main()
