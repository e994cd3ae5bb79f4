"""What ``pagedinfer bench`` runs and how (`BenchOptions`), each option declared once (`config.option`):
the command line is made of these declarations (`cli.options`). Nothing heavy is imported here, so
``pagedinfer bench --help`` stays fast."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from pagedinfer.bench.workloads import GPU_WORKLOADS, WORKLOADS, Shrink
from pagedinfer.config import DEVICES, option

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class BenchOptions:
    """What to run and how (the ``pagedinfer bench`` options; None: the workload's own choice)."""

    workloads: tuple[str, ...] = option(
        ("W0", "W1", "W2"),
        "Comma list: W0 overhead-bound, W1 parallel sampling, W2 mixed lengths, W3 shared prefix, W4 beam "
        "search, W5 Llama-3.2-1B shape (bfloat16 and float32); with --device cuda G1 Llama-3.2-1B shape, "
        "G2 Llama-3.1-8B shape. Default: W0,W1,W2 (cuda: G1,G2).",
        flags=("--workloads", "-w"),
        metavar="LIST",
        cli_type=str,
        cli_default=None,
        show_default=False,
    )
    device: str = option(  # "cuda": the GPU workloads (G1, G2)
        "cpu",
        "cpu (the W workloads) or cuda (the G workloads: every system on the GPU, random weights drawn "
        "there, GPU peaks measured, each system's GPU time profiled).",
        choices=DEVICES,
    )
    systems: tuple[str, ...] | None = option(  # None: every system the workload names
        None,
        "Comma list of pagedinfer, pagedinfer_no_prefix_cache, hf_generate, hf_generate_batch (default: "
        "every system each workload names).",
        metavar="LIST",
        cli_type=str,
    )
    dtypes: tuple[str, ...] | None = option(  # None: the workload's (float32; W5 bfloat16 and float32)
        None,
        "Comma list of float32, bfloat16, float16: run each workload in each, every system in that dtype "
        "(default: float32; W5 bfloat16,float32).",
        flags=("--dtype",),
        metavar="LIST",
        cli_type=str,
    )
    quick: bool = option(False, "Scaled-down workloads: a smoke test.")
    shrink: Shrink = field(default_factory=Shrink)  # its own options: --prompts, --max-prompt-len...
    threads: int = option(
        os.cpu_count() or 1,
        "Torch threads in every process (default: all cores).",
        cli_default=None,
        show_default=False,
    )
    block_size: int = option(16, "KV block size (both paged systems).")
    num_blocks: int | None = option(  # None: every completion at full length without sharing
        None,
        "KV pool blocks for both paged systems (default: every completion at full length without sharing, "
        "so neither preempts).",
    )
    max_num_batched_tokens: int = option(2048, "Token budget per step (both paged systems).")
    max_num_seqs: int = option(256, "Sequences per step.")
    hf_batch_size: int | None = option(None, "Prompts per hf_generate batch (override).")
    hf_cb_max_requests: int | None = option(
        None, "max_requests_per_batch of hf_generate_batch (default: --max-num-seqs)."
    )
    repeats: int = option(1, "Timed runs per system, taking turns; the fastest is kept.")
    gemm_size: int = option(2048, "Square matmul size of the GEMM rates.")
    model_cache: Path | None = option(None, "Save the random models here once and reuse them.", metavar="DIR")
    in_process: bool = option(False, "Run the systems in this process (profilers; RSS is shared).")
    json: Path | None = option(None, "Also write the results as JSON to FILE.", metavar="FILE")

    def check(self) -> None:
        """Raise ValueError (one line) for a name or a number the benchmark cannot use (or, with
        ``device="cuda"``, a machine without a CUDA device)."""
        from pagedinfer.bench.gpu import cuda_problem
        from pagedinfer.bench.systems import SYSTEMS

        for kind, names, known in (
            ("workload", self.workloads, WORKLOADS),
            ("system", self.systems or (), SYSTEMS),
            ("dtype", self.dtypes or (), DTYPES),
        ):
            for name in names:
                if name not in known:
                    raise ValueError(f"unknown {kind} {name!r}: choose from {', '.join(known)}")
        if not self.workloads:
            raise ValueError("no workload given")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"unknown device {self.device!r}: choose from cpu, cuda")
        for name in self.workloads:
            if WORKLOADS[name].device != self.device:
                raise ValueError(
                    f"{name} is a GPU workload: run it with --device cuda"
                    if self.device == "cpu"
                    else f"{name} is a CPU workload; with --device cuda the workloads are {', '.join(GPU_WORKLOADS)}"
                )
        for name, value in (
            ("--threads", self.threads),
            ("--repeats", self.repeats),
            ("--gemm-size", self.gemm_size),
            ("--block-size", self.block_size),
            ("--prompts", self.shrink.prompts),
            ("--max-prompt-len", self.shrink.prompt_len),
            ("--max-tokens", self.shrink.max_tokens),
            ("--hf-prompts", self.shrink.hf_prompts),
        ):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.device == "cuda" and (problem := cuda_problem()):
            raise ValueError(problem)
