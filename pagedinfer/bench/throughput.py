"""Throughput benchmark: pagedinfer against transformers ``generate`` and ``generate_batch``, same prompts.

One run measures the machine's fp32 GEMM rate, builds random-weight Llama models from configs (saved
with ``save_pretrained`` and loaded from disk by every system), draws each workload's prompts from a
fixed seed and runs every chosen system on them, each in a fresh ``spawn`` subprocess so that its
peak RSS (``VmHWM``) is its own. Every system gets one small untimed warm-up call first; the
timed call is then the whole workload in one go (for ``hf_generate``, all its padded batches). With
``--repeats R`` the systems take turns (so a change in machine load hits each alike) and each
keeps its fastest run; the table also gives the process CPU time of that run.

Systems:

* ``pagedinfer``: ``LLM(...).generate`` with ``ignore_eos=True``.
* ``hf_generate``: ``model.generate`` on left-padded batches (default SDPA attention, a
  ``DynamicCache``, ``num_return_sequences=n``, ``eos_token_id=None`` so it never stops early).
  Prompts are sorted by length and cut into batches of ``hf_batch_size``; a batch runs to its
  largest ``max_tokens`` and only each prompt's own ``max_tokens`` count as output.
* ``hf_generate_batch``: transformers continuous batching with a ``ContinuousBatchingConfig`` of
  the same block size, the same number of KV blocks and the same token budget as pagedinfer. With
  one ``max_tokens`` for all prompts it is ``model.generate_batch``; with per-prompt ``max_tokens``
  it is the same manager driven through ``continuous_batching_context_manager`` and ``add_request``
  (``generate_batch`` takes a single ``max_new_tokens``).

Compute efficiency = (unique prompt tokens + generated tokens) x 2 x parameters / wall time,
divided by the GEMM rate (a square fp32 ``torch.matmul``, best of 10) measured at the start;
"eff. (CPU)" is the same with process CPU seconds on both sides (robust to other jobs on the machine).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import multiprocessing
import os
import platform
import random
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

SYSTEMS = ("pagedinfer", "hf_generate", "hf_generate_batch")

MODELS: dict[str, dict] = {
    # SmolLM-135M's shape, random weights
    "smollm135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
    ),
    # tiny: every step is overhead (Python, metadata, kernel launches), not FLOPs
    "tiny2l": dict(
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    ),
}


@dataclass(frozen=True)
class Workload:
    name: str
    title: str
    model: str
    num_prompts: int
    prompt_len: tuple[int, int]  # inclusive range of prompt lengths
    max_tokens: tuple[int, int]  # inclusive range of per-prompt max_tokens (equal ends: one value)
    n: int
    temperature: float
    seed: int
    hf_batch_size: int | None  # prompts per hf_generate batch; None: all in one batch

    def describe(self) -> str:
        mt = self.max_tokens
        tokens = f"{mt[0]} new tokens" if mt[0] == mt[1] else f"max_tokens {mt[0]}-{mt[1]} per prompt"
        sampling = "greedy" if self.temperature == 0 else f"temperature {self.temperature}"
        return (
            f"{self.num_prompts} prompts of {self.prompt_len[0]}-{self.prompt_len[1]} random tokens, "
            f"n={self.n}, {tokens}, {sampling}, ignore_eos"
        )


WORKLOADS: dict[str, Workload] = {
    "W0": Workload("W0", "overhead-bound", "tiny2l", 64, (8, 40), (32, 32), 1, 0.0, 1000, None),
    "W1": Workload("W1", "parallel sampling", "smollm135m", 16, (64, 192), (64, 64), 4, 0.8, 1001, None),
    "W2": Workload("W2", "mixed lengths", "smollm135m", 48, (32, 512), (16, 256), 1, 0.0, 1002, 16),
}

QUICK: dict[str, dict] = {
    "W0": dict(num_prompts=16, max_tokens=(8, 8)),
    "W1": dict(num_prompts=4, prompt_len=(16, 48), max_tokens=(8, 8)),
    "W2": dict(num_prompts=8, prompt_len=(16, 96), max_tokens=(4, 16), hf_batch_size=4),
}


# -- arguments ---------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench_throughput",
        description="pagedinfer vs transformers generate / generate_batch on the same prompts and model, on the CPU in float32.",
    )
    p.add_argument("--workloads", default="W0,W1,W2", help="comma list of W0, W1, W2 (default: all)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list of {', '.join(SYSTEMS)}")
    p.add_argument("--quick", action="store_true", help="scaled-down workloads: a smoke test")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads (default: all)")
    p.add_argument("--block-size", type=int, default=16, help="KV block size (both paged systems)")
    p.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="KV pool blocks for both paged systems (default: enough for every sample of the workload "
        "at full length without sharing, so neither system preempts)",
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step")
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequences per step")
    p.add_argument("--hf-batch-size", type=int, default=None, help="override prompts per hf_generate batch")
    p.add_argument(
        "--hf-cb-max-requests",
        type=int,
        default=None,
        help="max_requests_per_batch of hf_generate_batch (default: --max-num-seqs, like pagedinfer)",
    )
    p.add_argument("--repeats", type=int, default=1, help="timed runs per system (the fastest is kept)")
    p.add_argument("--gemm-size", type=int, default=2048, help="square fp32 matmul size for the peak")
    p.add_argument("--model-cache", type=Path, default=None, help="save/reuse the random models here")
    p.add_argument(
        "--in-process", action="store_true", help="run systems in this process (for profiling; RSS is shared)"
    )
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    return p


def default_args(**overrides) -> argparse.Namespace:
    """The command line's defaults with ``overrides`` (``workloads="W1"``, ``json=Path(...)``): for callers
    such as a CLI subcommand that build the arguments themselves."""
    args = build_parser().parse_args([])
    for key, value in overrides.items():
        if not hasattr(args, key):
            raise TypeError(f"unknown benchmark option {key!r}")
        setattr(args, key, value)
    return args


# -- setup: machine, models, prompts -----------------------------------------------------------
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def source_state() -> dict:
    """The git commit of the pagedinfer checkout and whether its working tree has changes (if a checkout)."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain"], capture_output=True, text=True
        )
    except OSError:
        return {}
    if head.returncode != 0:
        return {}
    return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip())}


def measure_gemm(size: int, repeats: int = 10) -> tuple[float, float]:
    """Best fp32 FLOP/s of a ``size`` x ``size`` square matmul on this process's threads: per wall
    second, and per second of process CPU time (the steadier figure on a shared machine)."""
    import torch

    a = torch.randn(size, size)
    b = torch.randn(size, size)
    c = torch.empty(size, size)
    torch.matmul(a, b, out=c)  # warm-up
    wall = cpu = math.inf
    for _ in range(repeats):
        t, p = time.perf_counter(), time.process_time()
        torch.matmul(a, b, out=c)
        wall = min(wall, time.perf_counter() - t)
        cpu = min(cpu, time.process_time() - p)
    flops = 2 * size**3
    return flops / wall, flops / max(cpu, 1e-9)


def build_model(name: str, root: Path) -> tuple[Path, int]:
    """Save (or reuse) the random-weight model ``name`` under ``root``; return its dir and parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = root / name
    params_file = path / "bench_params.json"
    if params_file.exists():
        return path, json.loads(params_file.read_text())["parameters"]
    config = LlamaConfig(**MODELS[name], bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(path)
    params_file.write_text(json.dumps({"parameters": params}))
    return path, params


def make_prompts(w: Workload, vocab: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(w.seed)
    prompts = [
        [rng.randrange(1, vocab) for _ in range(rng.randint(*w.prompt_len))] for _ in range(w.num_prompts)
    ]
    max_tokens = [rng.randint(*w.max_tokens) for _ in range(w.num_prompts)]
    return prompts, max_tokens


def default_num_blocks(prompts: list[list[int]], max_tokens: list[int], n: int, block_size: int) -> int:
    """Blocks for every sample at full length with no sharing: nobody preempts, nobody runs out."""
    return sum(n * -(-(len(p) + m) // block_size) for p, m in zip(prompts, max_tokens, strict=True))


# -- the systems (each lives in its own subprocess) ------------------------------------------------
def _quiet() -> None:
    import logging

    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)


def _rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _peak_rss_bytes() -> int:
    """This process's RSS high-water mark (VmHWM: reset by exec, unlike ru_maxrss, which keeps the parent's)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PagedinferRunner:
    def __init__(self, job: dict) -> None:
        from pagedinfer import LLM

        self.job = job
        self.llm = LLM(
            job["model_dir"],
            block_size=job["block_size"],
            num_blocks=job["num_blocks"],
            max_num_seqs=job["max_num_seqs"],
            max_num_batched_tokens=job["max_num_batched_tokens"],
            device="cpu",
        )
        self.prompts = [{"prompt_token_ids": p} for p in job["prompts"]]
        self.llm.generate(self.prompts[:2], self._params(4), use_tqdm=False)  # warm-up

    def _params(self, max_tokens: int):
        from pagedinfer import SamplingParams

        j = self.job
        return SamplingParams(
            n=j["n"], temperature=j["temperature"], max_tokens=max_tokens, ignore_eos=True, seed=j["seed"]
        )

    def run(self) -> dict:
        params = [self._params(m) for m in self.job["max_tokens"]]
        outs = self.llm.generate(self.prompts, params, use_tqdm=False)
        stats = self.llm.stats.to_dict()
        stats["usage"].pop("blocks_used_per_step", None)
        return {
            "outputs": [[c.token_ids for c in o.outputs] for o in outs],
            "stats": stats,
            "peak_kv_bytes": stats["usage"]["peak_kv_bytes"],
            "kv_pool_bytes": stats["pool"]["kv_bytes_total"],
        }

    def info(self) -> dict:
        return {"kv_note": "peak blocks used x bytes per block"}


def _load_hf(job: dict):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=torch.float32).eval()


def _gen_config(job: dict, **kw):
    from transformers import GenerationConfig

    sample = job["temperature"] > 0
    extra = dict(temperature=job["temperature"], top_k=0, top_p=1.0) if sample else {}
    return GenerationConfig(
        do_sample=sample,
        num_return_sequences=job["n"],
        eos_token_id=None,
        pad_token_id=0,
        bos_token_id=None,
        **extra,
        **kw,
    )


def _cache_bytes(cache) -> int:
    layers = getattr(cache, "layers", None) or []
    return sum(
        layer.keys.nbytes + layer.values.nbytes
        for layer in layers
        if getattr(layer, "keys", None) is not None
    )


class HFGenerateRunner:
    def __init__(self, job: dict) -> None:
        self.job = job
        self.model = _load_hf(job)
        cfg = self.model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * 4
        prompts = job["prompts"]
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        self.size = job["hf_batch_size"] or len(prompts)
        self.batches = [order[i : i + self.size] for i in range(0, len(order), self.size)]
        self._generate([0], 2, 0)  # warm-up

    def _generate(self, idx: list[int], new: int, seed: int):
        import torch

        prompts, n = self.job["prompts"], self.job["n"]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.zeros(len(idx), width, dtype=torch.long)
        mask = torch.zeros(len(idx), width, dtype=torch.long)
        for row, i in enumerate(idx):  # left padding
            ids[row, width - len(prompts[i]) :] = torch.tensor(prompts[i])
            mask[row, width - len(prompts[i]) :] = 1
        torch.manual_seed(seed)
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                generation_config=_gen_config(self.job, max_new_tokens=new, return_dict_in_generate=True),
            )
        seqs = out.sequences[:, width:]  # [B * n, new]
        kv = _cache_bytes(out.past_key_values) or len(idx) * n * (width + new - 1) * self.per_token
        return seqs, kv

    def run(self) -> dict:
        max_tokens, n = self.job["max_tokens"], self.job["n"]
        outputs: list = [None] * len(max_tokens)
        peak_kv = computed = 0
        for b, idx in enumerate(self.batches):
            seqs, kv = self._generate(idx, max(max_tokens[i] for i in idx), self.job["seed"] + b)
            peak_kv = max(peak_kv, kv)
            computed += seqs.numel()
            for row, i in enumerate(idx):
                outputs[i] = [seqs[row * n + j, : max_tokens[i]].tolist() for j in range(n)]
        return {"outputs": outputs, "peak_kv_bytes": peak_kv, "generated_incl_discarded": computed}

    def info(self) -> dict:
        return {
            "kv_note": "largest batch's DynamicCache tensors at the end of generate",
            "batches": [len(b) for b in self.batches],
            "batching": f"{len(self.batches)} left-padded batch(es) of <= {self.size} prompts sorted by "
            "length, each run to its largest max_tokens; only each prompt's own max_tokens counted",
            "attn_implementation": self.model.config._attn_implementation,
        }


class HFContinuousBatchingRunner:
    def __init__(self, job: dict) -> None:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
        from transformers.generation.continuous_batching import cache as cb_cache

        self.job = job
        self.model = _load_hf(job)
        self.pools: list[dict] = []
        original_init = cb_cache.PagedAttentionCache.__init__
        pools = self.pools

        def recording_init(cache, *args, **kwargs):  # record the pool the manager really allocates
            original_init(cache, *args, **kwargs)
            pools.append(
                {
                    "cache_tensor_bytes": cache.cache_tensor.nbytes,
                    "num_blocks": cache.num_blocks,
                    "max_batch_tokens": cache.max_batch_tokens,
                }
            )

        cb_cache.PagedAttentionCache.__init__ = recording_init
        self.cb_config = ContinuousBatchingConfig(
            page_size=job["block_size"],
            num_blocks=job["num_blocks"],
            max_batch_tokens=job["max_num_batched_tokens"],
            max_requests_per_batch=job["hf_cb_max_requests"] or job["max_num_seqs"],
            seed=job["seed"],
        )
        self.uniform = len(set(job["max_tokens"])) == 1
        self._generate(job["prompts"][:2], [4] * min(2, len(job["prompts"])))  # warm-up

    def _generate(self, inputs: list[list[int]], limits: list[int]) -> list[list[list[int]]]:
        from transformers.generation.continuous_batching.utils import WorkloadHints

        n = self.job["n"]
        if len(set(limits)) == 1:
            res = self.model.generate_batch(
                inputs,
                generation_config=_gen_config(self.job, max_new_tokens=limits[0]),
                continuous_batching_config=self.cb_config,
            )
            flat = [r.generated_tokens for r in res.values()]  # n per prompt, in input order
            if len(flat) != len(inputs) * n:
                raise RuntimeError(f"generate_batch returned {len(flat)} of {len(inputs) * n} sequences")
            return [flat[i * n : (i + 1) * n] for i in range(len(inputs))]
        hints = WorkloadHints(
            max_prompt_length=max(map(len, inputs)),
            max_generated_length=max(limits),
            num_requests=len(inputs) * n,
        )
        results: dict[str, list] = {}
        with self.model.continuous_batching_context_manager(
            generation_config=_gen_config(self.job, max_new_tokens=max(limits)),
            continuous_batching_config=self.cb_config,
            block=True,
            timeout=5,
            workload_hints=hints,
        ) as manager:
            for i, (ids, m) in enumerate(zip(inputs, limits, strict=True)):
                manager.add_request(ids, request_id=f"p{i}", max_new_tokens=m, eos_token_id=-1)
            done = 0
            while done < len(inputs) * n:
                r = manager.get_result(timeout=1)
                if r is None:
                    if not manager.is_running():
                        raise RuntimeError("the continuous batching thread stopped early")
                    continue
                if r.is_finished():
                    results.setdefault(r.request_id.split("__child#")[0], []).append(r.generated_tokens)
                    done += 1
        return [results[f"p{i}"] for i in range(len(inputs))]

    def run(self) -> dict:
        self.pools.clear()
        outputs = self._generate(self.job["prompts"], self.job["max_tokens"])
        pool = self.pools[-1] if self.pools else {}
        size = pool.get("cache_tensor_bytes", 0)
        return {"outputs": outputs, "peak_kv_bytes": size, "kv_pool_bytes": size, "pool": pool}

    def info(self) -> dict:
        c = self.cb_config
        return {
            "kv_note": "its preallocated pool (the cache tensor, with its 2 trash sectors)",
            "api": "model.generate_batch"
            if self.uniform
            else "continuous_batching_context_manager + add_request(max_new_tokens=per prompt)",
            "config": {
                "page_size": c.page_size,
                "num_blocks": c.num_blocks,
                "max_batch_tokens": c.max_batch_tokens,
                "max_requests_per_batch": c.max_requests_per_batch,
            },
            "attn_implementation": self.model.config._attn_implementation,
        }


RUNNERS = {
    "pagedinfer": PagedinferRunner,
    "hf_generate": HFGenerateRunner,
    "hf_generate_batch": HFContinuousBatchingRunner,
}
_LIVE: dict[str, object] = {}  # system -> runner, in whichever process hosts it


def setup_system(system: str, job: dict) -> dict:
    """Load the system's model and warm it up (untimed)."""
    import torch

    torch.set_num_threads(job["threads"])
    _quiet()
    t = time.perf_counter()
    _LIVE[system] = RUNNERS[system](job)
    return {
        "setup_s": time.perf_counter() - t,
        "rss_before_run_bytes": _rss_bytes(),
        "threads": torch.get_num_threads(),
    }


def time_system(system: str) -> dict:
    """One timed run of the whole workload: its outputs, wall time and process CPU time."""
    cpu, wall = time.process_time(), time.perf_counter()
    out = _LIVE[system].run()
    out["wall_s"] = time.perf_counter() - wall
    out["cpu_s"] = time.process_time() - cpu
    return out


def finish_system(system: str) -> dict:
    info = _LIVE.pop(system).info()
    info["peak_rss_bytes"] = _peak_rss_bytes()
    return info


# -- orchestration -------------------------------------------------------------------------------
class _Host:
    """Runs one system's calls in a fresh spawned process (or in this one, with ``in_process``)."""

    def __init__(self, in_process: bool) -> None:
        self.pool = None
        if not in_process:
            ctx = multiprocessing.get_context("spawn")
            self.pool = concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx)

    def call(self, fn, *args):
        return fn(*args) if self.pool is None else self.pool.submit(fn, *args).result()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()


def _agreement(ref: list, other: list) -> dict:
    """Greedy runs: share of sequences identical to pagedinfer's, and of tokens before the first difference."""
    same = total = prefix = tokens = 0
    for samples_a, samples_b in zip(ref, other, strict=True):
        for a, b in zip(samples_a, samples_b, strict=True):
            total += 1
            same += a == b
            k = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            prefix += k
            tokens += len(a)
    return {
        "identical_sequences": same / total if total else 0.0,
        "prefix_token_share": prefix / tokens if tokens else 0.0,
    }


def make_job(w: Workload, args: argparse.Namespace, model_dir: Path, vocab: int) -> dict:
    """Everything a system's subprocess needs to run workload ``w`` (plain data: it is pickled)."""
    prompts, max_tokens = make_prompts(w, vocab)
    num_blocks = args.num_blocks or default_num_blocks(prompts, max_tokens, w.n, args.block_size)
    return {
        "model_dir": str(model_dir),
        "prompts": prompts,
        "max_tokens": max_tokens,
        "n": w.n,
        "temperature": w.temperature,
        "seed": w.seed,
        "threads": args.threads,
        "block_size": args.block_size,
        "num_blocks": num_blocks,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "hf_batch_size": args.hf_batch_size or w.hf_batch_size,
        "hf_cb_max_requests": args.hf_cb_max_requests,
    }


def run_workload(
    w: Workload, args, model_dir: Path, params: int, vocab: int, gemm: tuple[float, float], systems
) -> dict:
    job = make_job(w, args, model_dir, vocab)
    prompts, max_tokens = job["prompts"], job["max_tokens"]
    prompt_tokens = sum(map(len, prompts))
    expected = [[m] * w.n for m in max_tokens]
    out: dict = {
        "spec": asdict(w),
        "description": w.describe(),
        "model": w.model,
        "parameters": params,
        "prompt_tokens": prompt_tokens,
        "expected_output_tokens": w.n * sum(max_tokens),
        "settings": {
            k: job[k] for k in ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens")
        },
        "systems": {},
    }
    hosts = {s: _Host(args.in_process) for s in systems}
    outputs: dict[str, list] = {}
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    try:
        setups = {}
        for system in systems:
            print(f"[{w.name}] loading {system} ...", flush=True)
            setups[system] = hosts[system].call(setup_system, system, job)
        out["loadavg_before"] = os.getloadavg()
        for rep in range(args.repeats):  # interleaved, so that load changes hit every system alike
            for system in systems:
                res = hosts[system].call(time_system, system)
                toks = res.pop("outputs")
                lengths = [[len(t) for t in s] for s in toks]
                if lengths != expected:
                    raise RuntimeError(
                        f"{system} on {w.name}: output lengths differ from max_tokens (ignore_eos)"
                    )
                outputs.setdefault(system, toks)
                runs[system].append(res)
                print(
                    f"[{w.name}] {system} run {rep + 1}: {res['wall_s']:.2f} s wall, {res['cpu_s']:.2f} s CPU",
                    flush=True,
                )
        out["loadavg_after"] = os.getloadavg()
        for system in systems:
            res = min(runs[system], key=lambda r: r["wall_s"])
            res.update(setups[system])
            res.update(hosts[system].call(finish_system, system))
            res["wall_s_all"] = [r["wall_s"] for r in runs[system]]
            gen = w.n * sum(max_tokens)
            wall = res["wall_s"]
            res.update(
                output_tokens=gen,
                output_tokens_per_s=gen / wall,
                total_tokens_per_s=(prompt_tokens + gen) / wall,
                efficiency=(prompt_tokens + gen) * 2 * params / wall / gemm[0],
                efficiency_cpu=(prompt_tokens + gen) * 2 * params / res["cpu_s"] / gemm[1],
            )
            out["systems"][system] = res
    finally:
        for host in hosts.values():
            host.close()
    ours = out["systems"].get("pagedinfer")
    out["ratios"] = {}
    for peer, res in out["systems"].items():
        if ours is None or peer == "pagedinfer":
            continue
        r = {
            "output_tokens_per_s": ours["output_tokens_per_s"] / res["output_tokens_per_s"],
            "wall_s": ours["wall_s"] / res["wall_s"],
            "peak_rss": ours["peak_rss_bytes"] / res["peak_rss_bytes"],
            "peak_kv": ours["peak_kv_bytes"] / res["peak_kv_bytes"] if res["peak_kv_bytes"] else None,
        }
        if w.temperature == 0:
            r["greedy_agreement"] = _agreement(outputs["pagedinfer"], outputs[peer])
        out["ratios"][peer] = r
    return out


def run_bench(args: argparse.Namespace) -> dict:
    """Run the benchmark described by ``args`` (see `build_parser`); return the results as a dict."""
    import torch
    import transformers

    workloads = [s.strip() for s in args.workloads.split(",") if s.strip()]
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    for name in workloads:
        if name not in WORKLOADS:
            raise ValueError(f"unknown workload {name!r}: choose from {', '.join(WORKLOADS)}")
    for name in systems:
        if name not in SYSTEMS:
            raise ValueError(f"unknown system {name!r}: choose from {', '.join(SYSTEMS)}")
    torch.set_num_threads(args.threads)
    _quiet()
    gemm, gemm_cpu = measure_gemm(args.gemm_size)
    result = {
        "machine": {
            "cpu": cpu_model(),
            "cores": os.cpu_count(),
            "threads": torch.get_num_threads(),
            "gemm_size": args.gemm_size,
            "gemm_flops": gemm,
            "gemm_flops_per_cpu_s": gemm_cpu,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "pagedinfer_source": source_state(),
        "quick": args.quick,
        "workloads": {},
    }
    print(
        f"{result['machine']['cpu']}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}; "
        f"fp32 GEMM {args.gemm_size}^3: {gemm / 1e9:.1f} GFLOP/s ({gemm_cpu / 1e9:.1f} per CPU-second)",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="pagedinfer-bench-") as tmp:
        root = args.model_cache or Path(tmp)
        for name in workloads:
            w = WORKLOADS[name]
            if args.quick:
                w = replace(w, **QUICK[name])
            model_dir, params = build_model(w.model, root)
            res = run_workload(
                w, args, model_dir, params, MODELS[w.model]["vocab_size"], (gemm, gemm_cpu), systems
            )
            result["workloads"][name] = res
            print(format_workload(name, res, result["machine"]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


# -- report --------------------------------------------------------------------------------------
def _mib(b: float) -> str:
    return f"{b / 2**20:,.1f}"


def format_workload(name: str, res: dict, machine: dict) -> str:
    w = res["spec"]
    s = res["settings"]
    lines = [
        f"\n### {name} {w['title']}: {res['description']}",
        f"model {res['model']} ({res['parameters'] / 1e6:.2f}M params), {res['prompt_tokens']} prompt tokens, "
        f"{res['expected_output_tokens']} output tokens; {machine['threads']} threads; "
        f"block {s['block_size']}, {s['num_blocks']} KV blocks, {s['max_num_batched_tokens']} tokens/step, "
        f"{s['max_num_seqs']} seqs/step (pagedinfer and hf_generate_batch)",
        "",
        "| system | wall s | CPU s | output tok/s | total tok/s | peak RSS MiB | peak KV MiB | eff. (wall) | eff. (CPU) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for system, r in res["systems"].items():
        lines.append(
            f"| {system} | {r['wall_s']:.2f} | {r['cpu_s']:.2f} | {r['output_tokens_per_s']:,.1f} "
            f"| {r['total_tokens_per_s']:,.1f} "
            f"| {_mib(r['peak_rss_bytes'])} | {_mib(r['peak_kv_bytes'])} | {100 * r['efficiency']:.2f}% "
            f"| {100 * r['efficiency_cpu']:.2f}% |"
        )
    for peer, r in res["ratios"].items():
        kv = f"{r['peak_kv']:.3f}x" if r["peak_kv"] is not None else "n/a"
        line = (
            f"- pagedinfer / {peer}: output tok/s {r['output_tokens_per_s']:.2f}x, wall {r['wall_s']:.2f}x, "
            f"peak RSS {r['peak_rss']:.2f}x, peak KV {kv}"
        )
        if "greedy_agreement" in r:
            g = r["greedy_agreement"]
            line += (
                f"; greedy outputs identical {100 * g['identical_sequences']:.0f}%"
                f" (tokens before first difference {100 * g['prefix_token_share']:.0f}%)"
            )
        lines.append(line)
    notes = []
    if "hf_generate" in res["systems"]:
        notes.append(f"hf_generate: {res['systems']['hf_generate']['batching']}")
    if "hf_generate_batch" in res["systems"]:
        cb = res["systems"]["hf_generate_batch"]
        notes.append(f"hf_generate_batch: {cb['api']}, {cb['config']}")
    if "pagedinfer" in res["systems"]:
        st = res["systems"]["pagedinfer"]["stats"]
        notes.append(
            f"pagedinfer: {st['usage']['steps']} steps, peak {st['usage']['peak_blocks_used']} blocks, "
            f"{st['scheduling']['preemptions']} preemptions, prompt tokens computed "
            f"{st['sharing']['prompt_tokens_computed']} of {st['sharing']['prompt_tokens_requested']} requested"
        )
    if "loadavg_before" in res:
        before, after = res["loadavg_before"][0], res["loadavg_after"][0]
        notes.append(f"1-min load average {before:.1f} before the timed runs, {after:.1f} after")
    lines += [f"- {n}" for n in notes]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run_bench(args)
    return 0
