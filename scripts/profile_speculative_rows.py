"""What a decode step of R rows costs against one of 1 row (speculative decoding's drafted rows), and
where the time goes: each step shape timed whole (median of repeats) on the default path (a decoding
step, drafted rows included, takes the one-call C step) and layer by layer, the two alternating, then
again with wall-clock timers around the model's linears (by attribute name), attention and the rest,
layer by layer. With ``--seqs``, a step of S sequences: the first has the R rows (its pending token and
R - 1 drafted ones), the others one each. The probe's positions start at ``--context`` (K/V there is
scratch: the cost is that of attending over as many positions).

    python scripts/profile_speculative_rows.py MODEL [--rows 1,2,3,4,6] [--seqs 1] [--context 384] \
        [--repeats 15] [--no-breakdown]
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
    ap.add_argument("--seqs", default="1", help="sequences in the step, a list: 1,8,64")
    ap.add_argument("--context", type=int, default=384)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--no-breakdown", action="store_true", help="skip the timed components")
    args = ap.parse_args()
    torch.set_num_threads(1)
    counts = [int(r) for r in args.rows.split(",")]
    seqs = [int(s) for s in args.seqs.split(",")]
    per_seq = -(-(args.context + max(counts)) // 16) + 1  # blocks of 16 a sequence needs, at most
    engine = LLM(args.model, num_blocks=max(256, max(seqs) * per_seq + 16)).engine
    runner = engine.runner
    tables = []  # per sequence: per layer group
    for _ in range(max(seqs)):
        tables.append([[] for _ in range(engine.pool.num_groups)])
        for g, table in enumerate(tables[-1]):
            engine.pool.reserve(table, 0, args.context + max(counts), g)

    def probe(rows: int, n: int = 1) -> list[_Probe]:
        return [_Later(tables[i], rows if i == 0 else 1, start=args.context) for i in range(n)]

    one_call = runner.one_call

    def layered(meta, lora):
        return None

    times = {(n, r, path): [] for n in seqs for r in counts for path in ("plain", "layered")}
    for i in range(args.repeats + 1):  # the first round warms up, untimed
        for n in seqs:
            for r in counts:
                for path in ("plain", "layered"):
                    runner.one_call = one_call if path == "plain" else layered
                    start = time.perf_counter()
                    runner.execute(probe(r, n), [])
                    if i:
                        times[n, r, path].append(time.perf_counter() - start)
    runner.one_call = one_call
    ms = {key: statistics.median(t) * 1e3 for key, t in times.items()}
    print(f"context {args.context}, median of {args.repeats}, 1 thread, paths alternating")
    print(f"{'seqs':>4s} {'rows':>4s} {'step ms':>8s} {'x 1-row':>8s} {'layered ms':>11s} {'x step':>7s}")
    for n in seqs:
        for r in counts:
            plain, slow = ms[n, r, "plain"], ms[n, r, "layered"]
            print(
                f"{n:4d} {r:4d} {plain:8.2f} {plain / ms[n, counts[0], 'plain']:8.2f} {slow:11.2f} {slow / plain:7.2f}"
            )
    if args.no_breakdown:
        return
    timers = Timers()
    timers.install(engine.loaded.model)
    runner.one_call = layered
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
