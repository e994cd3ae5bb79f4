"""Runs the benchmark: the GEMM rates, then each workload in each dtype, each system in its own process.

Each system runs in a fresh ``spawn`` subprocess (so that its peak RSS, ``VmHWM``, is its own), loads
the model from disk, makes one small untimed warm-up call, and then times the whole workload in one
call. With ``repeats`` > 1 the systems take turns (a change in machine load hits each alike) and each
keeps its fastest run.
"""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import os
import platform
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

from pagedinfer.bench import report
from pagedinfer.bench.gpu import measure_gpu
from pagedinfer.bench.job import Beam, Job, RunResult, SystemUnavailable
from pagedinfer.bench.machine import cpu_model, measure_gemm, source_state
from pagedinfer.bench.models import BuiltModel, build_model
from pagedinfer.bench.options import DTYPES, BenchOptions
from pagedinfer.bench.systems import (
    finish_system,
    profile_system,
    quiet_transformers,
    setup_system,
    time_system,
)
from pagedinfer.bench.workloads import (
    WORKLOADS,
    Shrink,
    Workload,
    default_num_blocks,
    make_prompts,
    quick,
)
from pagedinfer.kernels.build import cpu_flags

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
REPORTED_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")  # the ones that decide GEMM speed


def make_job(w: Workload, opts: BenchOptions, model: BuiltModel, dtype: str) -> Job:
    """Everything a system's subprocess needs to run ``w`` in ``dtype``."""
    prompts, max_tokens = make_prompts(w, model.vocab_size, opts.shrink)
    num_blocks = opts.num_blocks or default_num_blocks(prompts, max_tokens, w.n, opts.block_size)
    gpu = {}
    if w.device == "cuda":  # as many blocks as max_num_seqs completions at full length can use, at most
        longest = max(len(p) + m for p, m in zip(prompts, max_tokens, strict=True))
        if not opts.num_blocks:
            num_blocks = min(num_blocks, opts.max_num_seqs * -(-longest // opts.block_size))
        gpu = dict(device="cuda", load_format="dummy", max_model_len=longest)
    return Job(
        model_dir=str(model.path),
        dtype=dtype,
        prompts=tuple(tuple(p) for p in prompts),
        max_tokens=tuple(max_tokens),
        n=w.n,
        temperature=w.temperature,
        seed=w.seed,
        beam=Beam(w.n) if w.beam_search else None,
        threads=opts.threads,
        block_size=opts.block_size,
        num_blocks=num_blocks,
        max_num_seqs=opts.max_num_seqs,
        max_num_batched_tokens=opts.max_num_batched_tokens,
        hf_batch_size=opts.hf_batch_size or w.hf_batch_size,
        hf_cb_max_requests=opts.hf_cb_max_requests,
        **gpu,
    )


def job_for(system: str, job: Job, w: Workload, shrink: Shrink | None = None) -> Job:
    """The job as ``system`` runs it: prefix caching stated explicitly where the workload is about it;
    the transformers systems on their first ``shrink.hf_prompts`` prompts."""
    if system.startswith("hf_") and shrink is not None and shrink.hf_prompts:
        return replace(
            job, prompts=job.prompts[: shrink.hf_prompts], max_tokens=job.max_tokens[: shrink.hf_prompts]
        )
    if system == "pagedinfer_no_prefix_cache":
        return replace(job, prefix_caching=False)
    if system == "pagedinfer" and w.shared_prefix:
        return replace(job, prefix_caching=True)
    return job


class _Host:
    """Runs one system's calls in a fresh spawned process (or in this one, with ``in_process``). A
    transformers baseline's process lets MKL take the CPU's own code path, as it would outside
    pagedinfer, whose import holds MKL to the one every CPU shares (``MKL_CBWR``: float32 GEMMs several
    times slower, docs/kernels.md)."""

    def __init__(self, in_process: bool, own: bool) -> None:
        self.pool = None
        if not in_process:
            ctx = multiprocessing.get_context("spawn")
            self.pool = concurrent.futures.ProcessPoolExecutor(
                max_workers=1, mp_context=ctx, initializer=None if own else _mkl_on_the_cpus_path
            )

    def call(self, fn, *args):
        return fn(*args) if self.pool is None else self.pool.submit(fn, *args).result()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()


def _mkl_on_the_cpus_path() -> None:
    os.environ["MKL_CBWR"] = "AUTO"  # MKL reads it at its first call, which comes after this


def _check_lengths(system: str, label: str, result: RunResult, job: Job) -> None:
    expected = [[m] * job.n for m in job.max_tokens]
    if [[len(t) for t in s] for s in result.outputs] != expected:
        raise RuntimeError(f"{system} on {label}: output lengths differ from max_tokens (ignore_eos)")


def _header(w: Workload, dtype: str, opts: BenchOptions, model: BuiltModel, job: Job) -> dict:
    return {
        "spec": asdict(w),
        "description": w.describe(),
        "shrink": opts.shrink.describe(),
        "dtype": dtype,
        "device": w.device,
        "model": w.model,
        "parameters": model.parameters,
        "kv_bytes_per_token": model.kv_elements_per_token * DTYPE_BYTES[dtype],
        "prompt_tokens": sum(map(len, job.prompts)),
        "expected_output_tokens": job.n * sum(job.max_tokens),
        "settings": {
            "block_size": job.block_size,
            "num_blocks": job.num_blocks,
            "max_num_seqs": job.max_num_seqs,
            "max_num_batched_tokens": job.max_num_batched_tokens,
        },
        "not_applicable": [s for s in (opts.systems or ()) if s not in w.systems],
        "failed": {},
        "systems": {},
    }


def _figures(runs: list[RunResult], head: dict, job: Job, rates: dict) -> dict:
    """A system's figures from its fastest run (over its own job's tokens): throughput, and compute
    efficiency against ``rates`` (CPU: the GEMM rate per wall and per CPU second; GPU: the bfloat16
    matmul rate and the copy bandwidth the device reached at the start of this run)."""
    best = min(runs, key=lambda r: r.wall_s)
    generated = job.n * sum(job.max_tokens)
    tokens = sum(map(len, job.prompts)) + generated
    flops = tokens * 2 * head["parameters"]
    out = {
        **best.details,
        "wall_s": best.wall_s,
        "cpu_s": best.cpu_s,
        "wall_s_all": [r.wall_s for r in runs],
        "peak_kv_bytes": best.peak_kv_bytes,
        "prompts": len(job.prompts),
        "output_tokens": generated,
        "output_tokens_per_s": generated / best.wall_s,
        "total_tokens_per_s": tokens / best.wall_s,
    }
    if head["device"] != "cuda":
        return {
            **out,
            "efficiency": flops / best.wall_s / rates["flops"],
            "efficiency_cpu": flops / best.cpu_s / rates["flops_per_cpu_s"],
        }
    steps = best.details.get("forward_passes")
    hbm = None if steps is None else hbm_bytes(job, head["parameters"] * DTYPE_BYTES[job.dtype], head, steps)
    return {
        **out,
        "flops_per_s": flops / best.wall_s,
        "matmul_peak_fraction": flops / best.wall_s / rates["bf16_flops"],
        "hbm_bytes": hbm,
        "hbm_fraction": None if hbm is None else hbm / best.wall_s / rates["copy_bytes_per_s"],
    }


def hbm_bytes(job: Job, weight_bytes: int, head: dict, forward_passes: int) -> int:
    """The least HBM traffic of a run: every forward pass reads the weights once, and every generated
    token reads the K and V of its context once (prompt plus the tokens before it)."""
    per_completion = sum(
        m * len(p) + m * (m - 1) // 2 for p, m in zip(job.prompts, job.max_tokens, strict=True)
    )
    return forward_passes * weight_bytes + job.n * per_completion * head["kv_bytes_per_token"]


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def _profile(host: _Host, system: str) -> dict:
    """The system's profile window; a failure is reported in its place, the timed figures stay."""
    try:
        return host.call(profile_system, system)
    except Exception as e:  # noqa: BLE001
        return {"error": f"profiling failed: {_one_line(e)}"}


def run_workload(w: Workload, dtype: str, opts: BenchOptions, model: BuiltModel, rates: dict) -> dict:
    """Every chosen system on ``w`` in ``dtype``; the figures of each and the ratios to pagedinfer.

    On the CPU the systems' processes stay up together, so that repeats interleave; on a GPU each
    system's process ends before the next starts (two 8B models and their KV pools do not fit at once),
    and after its timed runs each system profiles a few steps of an untimed run."""
    label = f"{w.name} {dtype}"
    job = make_job(w, opts, model, dtype)
    out = _header(w, dtype, opts, model, job)
    systems = [s for s in w.systems if opts.systems is None or s in opts.systems]
    jobs = {s: job_for(s, job, w, opts.shrink) for s in systems}
    cuda = w.device == "cuda"
    runs: dict[str, list[RunResult]] = {}
    for group in [[s] for s in systems] if cuda else [systems]:
        hosts = {s: _Host(opts.in_process, own=s.startswith("pagedinfer")) for s in group}
        setups: dict[str, dict] = {}
        try:
            for system in group:
                print(f"[{label}] loading {system} ...", flush=True)
                try:
                    setups[system] = hosts[system].call(setup_system, system, jobs[system])
                except SystemUnavailable as e:
                    print(f"[{label}] {system} cannot run: {e}", flush=True)
                    out["failed"][system] = str(e)
            out["loadavg_before"] = os.getloadavg()
            for rep in range(opts.repeats):  # interleaved, so that load changes hit every system alike
                for system in setups:
                    res = hosts[system].call(time_system, system, w.device)
                    _check_lengths(system, label, res, jobs[system])
                    runs.setdefault(system, []).append(res)
                    print(
                        f"[{label}] {system} run {rep + 1}: {res.wall_s:.2f} s wall, {res.cpu_s:.2f} s CPU",
                        flush=True,
                    )
            out["loadavg_after"] = os.getloadavg()
            for system in setups:
                extra = {"profile": _profile(hosts[system], system)} if cuda else {}
                info = hosts[system].call(finish_system, system)
                out["systems"][system] = {
                    **setups[system],
                    **info,
                    **extra,
                    **_figures(runs[system], out, jobs[system], rates),
                }
        except Exception as e:  # noqa: BLE001 - on a GPU, one system's failure must not lose the others' figures
            if not cuda:
                raise
            (system,) = group
            out["failed"][system] = f"error: {_one_line(e)}"
            out["errors"] = [*out.get("errors", []), system]
            runs.pop(system, None)
            print(f"[{label}] {system} failed: {_one_line(e)}", flush=True)
        finally:
            for host in hosts.values():
                host.close()
    compare = w.temperature == 0 or w.beam_search  # the first run's tokens of each system
    out["ratios"] = report.ratios(out["systems"], {s: r[0] for s, r in runs.items()} if compare else None)
    return out


def run_bench(opts: BenchOptions) -> dict:
    """Run the benchmark described by ``opts``; print each table as it completes; return the results."""
    import torch
    import transformers

    opts.check()
    torch.set_num_threads(opts.threads)
    quiet_transformers()
    chosen = {name: quick(WORKLOADS[name]) if opts.quick else WORKLOADS[name] for name in opts.workloads}
    dtypes_of = {name: opts.dtypes or w.dtypes for name, w in chosen.items()}
    machine = {
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(REPORTED_CPU_FLAGS),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
    if opts.device == "cuda":
        gpu = asdict(measure_gpu())
        torch.cuda.empty_cache()  # the measurement's buffers, before the systems' processes start
        machine["gpu"] = gpu
        rates = dict.fromkeys(
            DTYPES, gpu
        )  # the bfloat16 peaks, whatever the dtype (the workloads' is bfloat16)
    else:
        gemm_dtypes = dict.fromkeys(["float32", "bfloat16", *(d for ds in dtypes_of.values() for d in ds)])
        gemm = {d: measure_gemm(opts.gemm_size, d) for d in gemm_dtypes}
        machine["gemm"] = {d: asdict(g) for d, g in gemm.items()}
        rates = machine["gemm"]
    result = {
        "machine": machine,
        "pagedinfer_source": source_state(),
        "quick": opts.quick,
        "shrink": opts.shrink.describe(),
        "workloads": {},
    }
    print(report.format_machine(machine), flush=True)
    with tempfile.TemporaryDirectory(prefix="pagedinfer-bench-") as tmp:
        root = opts.model_cache or Path(tmp)
        for name, w in chosen.items():
            model = build_model(w.model, root, weights=w.device == "cpu")
            per_dtype = result["workloads"].setdefault(name, {})
            for dtype in dtypes_of[name]:
                res = run_workload(w, dtype, opts, model, rates[dtype])
                per_dtype[dtype] = res
                print(report.format_workload(name, res, machine), flush=True)
            if len(per_dtype) > 1:
                print(report.format_dtype_ratios(name, per_dtype), flush=True)
    if opts.json:
        opts.json.write_text(json.dumps(result, indent=2))
    return result
