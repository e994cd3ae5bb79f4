"""One memory report for N replicas: their `EngineStats` merged, plus a per-replica table.

Replicas step concurrently and independently, so the merged per-step series add the replicas'
i-th steps together (aligned by step number, not by wall clock): the merged peak is the most KV
in use at once across all pools, to within the replicas' drift. Pool sizes and totals add up;
the wall time is the driver's.
"""

from __future__ import annotations

from dataclasses import fields, replace
from itertools import zip_longest

from pagedinfer.core.kv_cache_manager import KVCacheStats
from pagedinfer.core.scheduler import SchedulerCounters
from pagedinfer.engine.stats import AdapterUse, EngineStats

SERIES = ("blocks_used", "slots_filled", "logical_blocks", "running_seqs", "batch_tokens", "cached_blocks")
TOTALS = (
    "graph_steps",
    "requests",
    "failed_requests",
    "completions",
    "prompt_tokens",
    "prompt_tokens_requested",
    "completion_tokens",
)


def merge(replicas: list[EngineStats], wall_time_s: float) -> EngineStats:
    """The replicas as one engine: pools and totals summed, step series summed step by step."""
    first = replicas[0]
    merged = EngineStats(
        num_blocks=sum(s.num_blocks for s in replicas),
        block_size=first.block_size,
        bytes_per_token=first.bytes_per_token,
        bytes_per_block=first.bytes_per_block,
        pool_size=replace(first.pool_size, num_blocks=sum(s.num_blocks for s in replicas)),
        max_model_len=first.max_model_len,
        dtype=first.dtype,
        dtype_reason=first.dtype_reason,
        dtype_emulated=first.dtype_emulated,
        matmul_numerics=first.matmul_numerics,
        kv_cache_dtype=first.kv_cache_dtype,
        prefix_caching=first.prefix_caching,
        schedule_policy=first.schedule_policy,
        cuda_graphs=first.cuda_graphs,
        graph_capture_s=max(s.graph_capture_s for s in replicas),
        kernel_compile_s=max(s.kernel_compile_s for s in replicas),
        wall_time_s=wall_time_s,
        reproducibility=first.reproducibility,
        # replicas on unlike machines may differ (a bfloat16 path, say): each one is named
        system_fingerprint=",".join(sorted({s.system_fingerprint for s in replicas})),
        counters=_summed(SchedulerCounters, [s.counters for s in replicas]),
        kv=_summed(KVCacheStats, [s.kv for s in replicas]),
        layer_groups=first.layer_groups,
    )
    for name in SERIES:
        columns = zip_longest(*(getattr(s, name) for s in replicas), fillvalue=0)
        setattr(merged, name, [sum(col) for col in columns])
    idle = (0,) * len(first.layer_groups)  # a replica past its last step
    columns = zip_longest(*(s.group_blocks_used for s in replicas), fillvalue=idle)
    merged.group_blocks_used = [_added(col) for col in columns]
    for name in TOTALS:
        setattr(merged, name, sum(getattr(s, name) for s in replicas))
    # every replica names the same --lora adapters at startup: the first one's list is the run's
    merged.lora_enabled, merged.lora_adapters = first.lora_enabled, first.lora_adapters
    for s in replicas:  # requests and tokens per adapter (by name; None: the base model)
        for name, use in s.lora_usage.items():
            total = merged.lora_usage.setdefault(name, AdapterUse())
            total.requests += use.requests
            total.prompt_tokens += use.prompt_tokens
            total.completion_tokens += use.completion_tokens
        merged.adapter_counters.reads += s.adapter_counters.reads
        merged.adapter_counters.slot_loads += s.adapter_counters.slot_loads
    return merged


def _summed(cls: type, parts: list) -> object:
    """A ``cls`` record whose every field is the sum of ``parts``' (the replicas' snapshots)."""
    return cls(**{f.name: _added([getattr(p, f.name) for p in parts]) for f in fields(cls)})


def _added(values: list) -> object:
    """The sum of numbers, or of tuples element by element (per layer group)."""
    if values and isinstance(values[0], tuple):
        return tuple(sum(col) for col in zip(*values, strict=True))
    return sum(values)


def replica_rows(replicas: list[EngineStats], infos: list[dict], restarts: list[int]) -> list[dict]:
    """Per-replica figures for the table and ``--report-json``'s ``replicas`` list."""
    rows = []
    for i, (s, info, again) in enumerate(zip(replicas, infos, restarts, strict=True)):
        rows.append(
            {
                "replica": i,
                "host": info["host"],
                "node": info["node"],
                "pid": info["pid"],
                "device": info["device"],
                "threads": info["threads"],
                "restarts": again,
                "num_blocks": s.num_blocks,
                "kv_bytes_total": s.kv_bytes_total,
                "requests": s.requests,
                "completions": s.completions,
                "steps": s.steps,
                "peak_blocks_used": s.peak_blocks_used,
                "peak_kv_bytes": s.peak_blocks_used * s.bytes_per_block,
                "generated_tokens": s.generated_tokens,
                "busy_s": round(s.wall_time_s, 3),
                "generated_tokens_per_s": round(s.generated_tokens / s.wall_time_s, 3)
                if s.wall_time_s
                else 0.0,
            }
        )
    return rows
