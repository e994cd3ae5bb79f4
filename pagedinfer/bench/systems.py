"""The systems by name, and the three calls a system's subprocess serves: set up, time a run, finish."""

from __future__ import annotations

import time
from collections.abc import Callable

from pagedinfer.bench.hf_systems import HFGenerateBatchSystem, HFGenerateSystem
from pagedinfer.bench.job import Job, RunResult, System
from pagedinfer.bench.machine import peak_rss_bytes, rss_bytes
from pagedinfer.bench.pagedinfer_system import PagedinferSystem

SYSTEMS: dict[str, Callable[[Job], System]] = {
    "pagedinfer": PagedinferSystem,
    "pagedinfer_no_prefix_cache": PagedinferSystem,  # its job says enable_prefix_caching=False
    "hf_generate": HFGenerateSystem,
    "hf_generate_batch": HFGenerateBatchSystem,
}

_LIVE: dict[str, System] = {}  # system name -> the loaded system, in whichever process hosts it


def quiet_transformers() -> None:
    import logging

    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)


def setup_system(name: str, job: Job) -> dict:
    """Load the system's model and warm it up (untimed)."""
    import torch

    torch.set_num_threads(job.threads)
    quiet_transformers()
    start = time.perf_counter()
    _LIVE[name] = SYSTEMS[name](job)
    return {
        "setup_s": time.perf_counter() - start,
        "rss_before_run_bytes": rss_bytes(),
        "threads": torch.get_num_threads(),
    }


def time_system(name: str, device: str = "cpu") -> RunResult:
    """One timed run of the whole workload, with its wall time and process CPU time; on CUDA the GPU's
    work is waited for, and the peak of allocated GPU memory during the run is in ``details``."""
    import torch

    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    cpu, wall = time.process_time(), time.perf_counter()
    result = _LIVE[name].run()
    if cuda:
        torch.cuda.synchronize()
    result.wall_s = time.perf_counter() - wall
    result.cpu_s = time.process_time() - cpu
    if cuda:
        result.details["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
    return result


def profile_system(name: str) -> dict:
    """The GPU time split of a few steps of an untimed run (`bench.gpu.profiled_split`)."""
    return _LIVE[name].profile()


def finish_system(name: str) -> dict:
    info = _LIVE.pop(name).info()
    info["peak_rss_bytes"] = peak_rss_bytes()
    return info
