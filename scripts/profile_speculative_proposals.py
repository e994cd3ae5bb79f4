"""What the speculator's proposals cost on one of scripts/bench_llamacpp.py's workloads (default D: one
prompt, n=64, where drafts rarely match): the run with speculation off and gated, alternating,
``THREADS`` torch threads (default 1), each run's wall, the seconds spent in `Speculator.propose` (the
lookups and the gate's prices, for every decoding sequence and step), and the gated run's drafted
and accepted tokens by source and refused sequence-steps.

    python scripts/profile_speculative_proposals.py MODEL [WORKLOAD] [REPEATS] [THREADS]
"""

from __future__ import annotations

import sys
import time

import torch
from bench_speculative_w6 import SPEC, peer_workload, view

from pagedinfer import LLM
from pagedinfer.core import speculative


def main(model: str, workload: str = "D", repeats: int = 2, threads: int = 1) -> None:
    torch.set_num_threads(threads)
    base = LLM(model, num_blocks=16)  # each run's engine has its own pool (`view`)
    prompts, sampling, blocks = peer_workload(workload, base.vocab_size)
    spent = {"seconds": 0.0, "calls": 0}
    propose = speculative.Speculator.propose

    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return propose(self, *args, **kwargs)
        finally:
            spent["seconds"] += time.perf_counter() - start
            spent["calls"] += 1

    speculative.Speculator.propose = timed
    for rep in range(repeats):
        for mode in ("off", "gated"):
            llm = view(base, None if mode == "off" else SPEC, 256, False, blocks)
            spent.update(seconds=0.0, calls=0)
            start = time.perf_counter()
            llm.generate(prompts, sampling, use_tqdm=False)
            wall = time.perf_counter() - start
            seen = llm.engine.stats.to_dict().get("speculation", {})
            drafts = {
                k: (v["accepted"], v["drafted"]) for k, v in seen.get("sources", {}).items() if v["drafted"]
            }
            print(
                rep,
                mode,
                f"wall {wall:.2f} s, propose {spent['seconds']:.2f} s in {spent['calls']} calls,",
                f"(accepted, drafted) {drafts}, refused {seen.get('gated_seq_steps')}",
                flush=True,
            )


if __name__ == "__main__":
    main(sys.argv[1], *sys.argv[2:3], *(int(a) for a in sys.argv[3:5]))
