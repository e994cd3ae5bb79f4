"""pagedinfer: offline batch LLM inference on a paged KV cache with copy-on-write parallel sampling.

The public names are imported on first use, so ``python -m pagedinfer`` can guard its own start
(a Ctrl-C while torch loads exits 130 with one line, not a traceback).
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING

# libgomp's threads (torch's, and our kernels', which share them) spin about 300,000 times at a
# barrier before they sleep. Where the machine has more runnable threads than cores (shared, or
# busy with other jobs) a spinning thread holds the core its partner needs, and each parallel region
# waits a scheduler time slice; 10,000 spins still cover the gaps between a step's parallel regions on
# an idle machine (docs/bench.md, "OpenMP spinning"). libgomp reads this once, as torch loads it: it
# takes effect where pagedinfer is imported before torch; a value already set wins.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")
# MKL computes torch's float32 exp, log, sin, cos, tanh, sqrt, erf, atan (its VML) and BLAS calls on
# a code path chosen by the CPU (AVX-512 on an Intel CPU, others elsewhere), each rounding its own way;
# the sampler's exponentials and the logprobs' logsumexp are such calls. Its conditional numerical
# reproducibility mode COMPATIBLE takes one path on every x86-64 CPU, the one an AMD CPU takes anyway
# (docs/reproducibility.md). MKL reads this at its first call: it takes effect where pagedinfer is
# imported before anything calls MKL; a value already set wins (`fingerprint.mkl_branch` tells).
os.environ.setdefault("MKL_CBWR", "COMPATIBLE")

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "BeamSearchParams",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "LoRARequest",
    "__version__",
]
_HOME = {
    "LLM": "pagedinfer.llm",
    "SamplingParams": "pagedinfer.sampling_params",
    "RequestOutput": "pagedinfer.outputs",
    "CompletionOutput": "pagedinfer.outputs",
    "Logprob": "pagedinfer.outputs",
    "BeamSearchParams": "pagedinfer.sampling_params",
    "BeamSearchOutput": "pagedinfer.outputs",
    "BeamSearchSequence": "pagedinfer.outputs",
    "LoRARequest": "pagedinfer.lora.request",
}

if TYPE_CHECKING:
    from pagedinfer.llm import LLM
    from pagedinfer.lora.request import LoRARequest
    from pagedinfer.outputs import (
        BeamSearchOutput,
        BeamSearchSequence,
        CompletionOutput,
        Logprob,
        RequestOutput,
    )
    from pagedinfer.sampling_params import BeamSearchParams, SamplingParams


def __getattr__(name: str):
    if name in _HOME:
        value = getattr(importlib.import_module(_HOME[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pagedinfer' has no attribute {name!r}")
