"""The sampler's per-step cost before and after the logits pipeline, alternating in one process.

Loads ``pagedinfer/model/sampler.py`` as it is at ``--baseline`` (git) beside the current one and times
``sample`` on the same float32 logits (batch 64, SmolLM2's vocabulary of 49152 by default) in each
mode: greedy, temperature alone (the C draw), seeded sampling (temperature, top-p, top-k),
penalties + min_tokens, logprobs. Both must draw the same tokens and logprobs (checked, with
generators seeded alike); the table gives the median (``--stat min``: the minimum) time per call
of each and their ratio. Rows with a logit control exist only in the new sampler and are timed
alone.

    python scripts/bench_sampler.py --baseline main --batch 64 --repeats 30

``--baseline none`` times the sampler of the ``pagedinfer`` on ``PYTHONPATH`` alone: a change to the
C loops or the logits pipeline (which an in-process baseline shares with the current code) is
compared by running it once per checkout, alternating.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from pagedinfer.logits.controls import AllowedTokens, BadWords, LogitBias, MinTokens, Penalties
from pagedinfer.logits.processor import LogitsPipeline
from pagedinfer.model import sampler as new
from pagedinfer.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[1]
EOS = {2}
MODES = {
    "greedy": dict(temperature=0),
    "temperature": dict(temperature=0.8),  # the C draw
    "sampled": dict(temperature=0.8, top_p=0.9, top_k=50),
    "penalties": dict(temperature=0.8, repetition_penalty=1.2, frequency_penalty=0.3, min_tokens=4),
    "logprobs": dict(temperature=0, logprobs=5),
}
NEW_ONLY = {
    "logit_bias": dict(temperature=0.8, logit_bias={i: 2.0 for i in range(0, 400, 7)}),
    "allowed_token_ids": dict(temperature=0, allowed_token_ids=list(range(0, 2000, 3))),
}


def baseline(rev: str):
    source = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{rev}:pagedinfer/model/sampler.py"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    path = Path(tempfile.mkdtemp()) / "sampler_baseline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("sampler_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _piped(module) -> bool:
    """Whether ``module``'s sampler takes the logits pipeline (its rows carry processor states)."""
    return "state" in module.SampleRow.__dataclass_fields__


def rows(module, params: SamplingParams, batch: int, history: list[list[int]], seed: int):
    gens = [torch.Generator().manual_seed(seed + i) for i in range(batch)]
    if _piped(module):
        return [module.SampleRow(params, h, 8, None, g) for h, g in zip(history, gens, strict=True)]
    return [module.SampleRow(params, g, h, 8) for h, g in zip(history, gens, strict=True)]


def call(module, logits: torch.Tensor, r, pipeline):
    return module.sample(logits, r, pipeline) if _piped(module) else module.sample(logits, r, EOS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default="main", help="git revision of the sampler to compare with, or none")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--stat",
        choices=("median", "min"),
        default="median",
        help="the time per call reported; on a loaded machine the minimum is the steadier figure",
    )
    ap.add_argument("--modes", help="comma list of the modes to time (default: all)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    old = None if args.baseline == "none" else baseline(args.baseline)
    pipeline = LogitsPipeline(
        [
            AllowedTokens(args.vocab),
            BadWords(None, args.vocab),
            MinTokens(EOS, args.vocab),
            LogitBias(args.vocab),
            Penalties(),
        ]
    )
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(args.batch, args.vocab, generator=gen) * 4  # [B, V]
    history = [torch.randint(0, args.vocab, (40,), generator=gen).tolist() for _ in range(args.batch)]
    print(
        f"sampler at batch {args.batch}, vocabulary {args.vocab}, {args.threads} threads, {args.repeats} repeats, "
        f"{args.stat} per call"
    )
    print("| mode | baseline ms | new ms | new / baseline | same tokens and logprobs (digest) |")
    print("| --- | --- | --- | --- | --- |")
    stat = {"median": statistics.median, "min": min}[args.stat]
    chosen = args.modes.split(",") if args.modes else [*MODES, *NEW_ONLY]
    for mode, fields in {**MODES, **NEW_ONLY}.items():
        if mode not in chosen:
            continue
        params = SamplingParams(**fields)
        modules = (old, new) if mode in MODES and old is not None else (new,)
        times: dict = {m: [] for m in modules}
        results = {}
        for rep in range(args.repeats):
            for m in modules if rep % 2 else modules[::-1]:  # alternating which runs first
                x = logits.clone()
                r = rows(m, params, args.batch, history, 1000)
                start = time.perf_counter()
                out = call(m, x, r, pipeline)
                times[m].append(time.perf_counter() - start)
                results[m] = (out.token_ids, out.logprobs)
        med = {m: 1e3 * stat(t) for m, t in times.items()}
        if len(modules) == 2:
            same = results[old] == results[new]
            print(f"| {mode} | {med[old]:.3f} | {med[new]:.3f} | {med[new] / med[old]:.3f} | {same} |")
            if not same:
                sys.exit(f"{mode}: the samplers differ")
        else:  # a digest of the draws, to compare with a run of another checkout
            digest = hashlib.sha256(repr(results[new]).encode()).hexdigest()[:12]
            print(f"| {mode} | - | {med[new]:.3f} | - | {digest} |")


if __name__ == "__main__":
    main()
