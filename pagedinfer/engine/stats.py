"""Where every byte of KV memory went: the figures behind the memory-usage report.

The pool's use is recorded once per engine step (after scheduling, when this step's blocks are
allocated and its slots assigned); the counts are the snapshots of the engine's parts, taken when the
figures are read (`LLMEngine.stats`). ``to_dict`` gives the stable, documented keys of
``--report-json``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagedinfer.config import EngineConfig, PoolSize
from pagedinfer.core.kv_cache_manager import KVCacheStats
from pagedinfer.core.scheduler import SchedulerCounters, SchedulerStats
from pagedinfer.core.sequence import Request
from pagedinfer.core.speculative import SpeculationStats
from pagedinfer.engine.fingerprint import Reproducibility
from pagedinfer.logits.structured import StructuredCounters
from pagedinfer.lora.registry import AdapterCounters, LoadedAdapter


@dataclass
class AdapterUse:
    """The requests (lines) that ran with one adapter (or the base model) and their tokens."""

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add_request(self, prompt_tokens: int) -> None:
        self.requests += 1
        self.prompt_tokens += prompt_tokens


@dataclass
class EngineStats:
    """One run's figures, assembled by the engine: its own record (the pool's geometry, each step's
    use, the requests it was given) and the snapshots its parts return (`Scheduler.make_stats`, with
    the KV-cache manager's; `GrammarCompiler.make_stats`; `AdapterRegistry.make_stats`)."""

    # pool geometry
    num_blocks: int
    block_size: int
    bytes_per_token: int
    bytes_per_block: int
    pool_size: PoolSize  # how the size was chosen
    max_model_len: int
    dtype: str = ""  # weights and activations, e.g. "float32" (the pool's: kv_cache_dtype)
    dtype_reason: str = ""  # why: "--dtype bfloat16", or what --dtype auto found on this machine
    dtype_emulated: bool = False  # a 16-bit dtype this CPU has no native matrix instructions for
    matmul_numerics: str = "exact"  # how the quantized weights multiplied (config.MATMUL_NUMERICS)
    kv_cache_dtype: str = ""  # the pool's: the model's dtype, or 16-bit under float32 (--kv-cache-dtype)
    weight_bytes: int = 0  # every weight tensor the model holds (panels, scales, embeddings, norms)
    linear_bits_per_weight: float = 0.0  # the linears' storage per weight (4.5-8.5 quantized, 32 float32)
    prefix_caching: bool = True
    schedule_policy: str = EngineConfig.schedule_policy  # the scheduler's admission order
    # CUDA graphs for decode steps: what ran ("on: ...", "off: why"), the capture time at startup,
    # and how many of this run's steps replayed a graph
    cuda_graphs: str = ""
    graph_capture_s: float = 0.0
    graph_steps: int = 0
    # speculative decoding: what ran ("off", "on: ...", "off: why") and the speculator's counts
    speculation_mode: str = "off"
    speculation: SpeculationStats | None = None
    # per step (`record_step`)
    blocks_used: list[int] = field(default_factory=list)
    slots_filled: list[int] = field(default_factory=list)
    logical_blocks: list[int] = field(default_factory=list)
    running_seqs: list[int] = field(default_factory=list)
    batch_tokens: list[int] = field(default_factory=list)
    cached_blocks: list[int] = field(default_factory=list)  # cached blocks nobody references
    group_blocks_used: list[tuple[int, ...]] = field(default_factory=list)  # per layer group
    # the pool's layer groups (`attention.kv_cache.group_layers`): (window, layers) each; one group
    # (window 0) where every layer keeps every block
    layer_groups: tuple[tuple[int, tuple[int, ...]], ...] = ()
    # the requests given (`count_added`, `count_finished`)
    requests: int = 0
    failed_requests: int = 0
    completions: int = 0
    prompt_tokens: int = 0  # unique prompt tokens of the requests that ran
    prompt_tokens_requested: int = 0  # prompt tokens x n: what prefilling every completion would cost
    # tokens in the finished requests' outputs (their records' usage.completion_tokens add up to it);
    # generated_tokens counts the tokens sampled: under beam search the returned beams repeat their
    # common history, and pruned beams' tokens are not returned, so the two differ
    completion_tokens: int = 0
    wall_time_s: float = 0.0
    kernel_compile_s: float = 0.0  # compiling the CPU kernels when the model loaded: not in wall_time_s
    # the scheduler's counts as it applies each step (prompt tokens computed, recomputed, generated)
    counters: SchedulerCounters = field(default_factory=SchedulerCounters)
    # the KV-cache manager's counts: copy-on-write copies, and the prefix cache's lookups (prompt
    # tokens looked up at admission, those its blocks saved from computing), reuse and evictions
    kv: KVCacheStats = field(default_factory=KVCacheStats)
    # structured outputs: the grammar compile cache and the token masks (counted as they happen)
    structured: StructuredCounters = field(default_factory=StructuredCounters)
    # LoRA: whether enabled, the adapters named (by name, in the order first named), each one's
    # requests and tokens in this run (by name; None: the base model), and the adapters read from
    # disk and installed into slots (swapped in) during it
    lora_enabled: bool = False
    lora_adapters: dict[str, LoadedAdapter] = field(default_factory=dict)
    lora_usage: dict[str | None, AdapterUse] = field(default_factory=dict)
    adapter_counters: AdapterCounters = field(default_factory=AdapterCounters)
    # the reproducibility contract (engine/fingerprint.py): is the run's path covered, and the hash of
    # what decides its records' bytes
    reproducibility: Reproducibility = Reproducibility(False, "unknown")
    system_fingerprint: str = ""

    def lora_use(self, adapter: LoadedAdapter | None) -> AdapterUse:
        return self.lora_usage.setdefault(None if adapter is None else adapter.name, AdapterUse())

    def record_step(self, scheduler: SchedulerStats, tokens: int) -> None:
        """One step's use, once it is scheduled (its blocks allocated, nothing freed yet)."""
        kv = scheduler.kv
        self.cached_blocks.append(kv.num_cached_blocks)
        self.blocks_used.append(kv.num_used_blocks)
        self.group_blocks_used.append(kv.group_used_blocks)
        self.slots_filled.append(kv.num_filled_slots)
        self.logical_blocks.append(scheduler.logical_blocks)
        self.running_seqs.append(scheduler.running_seqs)
        self.batch_tokens.append(tokens)

    def count_added(self, req: Request) -> None:
        """A request queued (or answered at once when ``req.error`` is set: it can never run)."""
        self.requests += 1
        if req.error:
            self.failed_requests += 1
            return
        self.prompt_tokens += req.num_prompt_tokens
        self.prompt_tokens_requested += req.num_prompt_tokens * req.params.n
        self.completions += req.params.n
        self.lora_use(req.lora).add_request(req.num_prompt_tokens)

    def count_finished(self, finished: list[Request]) -> None:
        """The tokens the callers get back from the requests that finished without an error."""
        for r in finished:
            if not r.error:
                self.completion_tokens += r.completion_tokens()
                self.lora_use(r.lora).completion_tokens += r.completion_tokens()

    # -- the scheduler's counts ------------------------------------------------------------
    @property
    def prompt_tokens_computed(self) -> int:
        return self.counters.prompt_tokens_computed

    @property
    def output_tokens_recomputed(self) -> int:
        return self.counters.output_tokens_recomputed

    @property
    def output_tokens_restored(self) -> int:
        return self.counters.output_tokens_restored

    @property
    def output_tokens_kept(self) -> int:
        return self.counters.output_tokens_kept

    @property
    def generated_tokens(self) -> int:
        return self.counters.generated_tokens

    @property
    def preemptions(self) -> int:
        return self.counters.preemptions

    @property
    def prompt_tokens_readmitted(self) -> int:
        return self.counters.prompt_tokens_readmitted

    # -- the KV-cache manager's counts -----------------------------------------------------
    @property
    def cow_copies(self) -> int:
        return self.kv.cow_copies

    @property
    def prefix_cache_queries(self) -> int:
        return self.kv.prefix_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.kv.prefix_hits

    @property
    def prefix_cache_blocks_reused(self) -> int:
        """Blocks handed to a new sequence by a hit."""
        return self.kv.blocks_reused

    @property
    def prefix_cache_evictions(self) -> int:
        """Cached blocks reclaimed for new contents."""
        return self.kv.evictions

    # -- derived figures -------------------------------------------------------------------
    @property
    def steps(self) -> int:
        return len(self.blocks_used)

    @property
    def kv_bytes_total(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def peak_blocks_used(self) -> int:
        return max(self.blocks_used, default=0)

    @property
    def mean_blocks_used(self) -> float:
        return sum(self.blocks_used) / self.steps if self.steps else 0.0

    @property
    def peak_step(self) -> int:
        return self.blocks_used.index(self.peak_blocks_used) if self.steps else 0

    @property
    def peak_running_seqs(self) -> int:
        return max(self.running_seqs, default=0)

    def _waste(self, step: int) -> tuple[int, int]:
        allocated = self.blocks_used[step] * self.block_size
        return allocated - self.slots_filled[step], allocated

    @property
    def empty_slots_at_peak(self) -> int:
        return self._waste(self.peak_step)[0] if self.steps else 0

    @property
    def fragmentation_at_peak(self) -> float:
        """Allocated-but-empty share of the allocated slots at the peak step."""
        empty, allocated = self._waste(self.peak_step) if self.steps else (0, 0)
        return empty / allocated if allocated else 0.0

    @property
    def mean_fragmentation(self) -> float:
        empty = sum(self._waste(i)[0] for i in range(self.steps))
        allocated = sum(self._waste(i)[1] for i in range(self.steps))
        return empty / allocated if allocated else 0.0

    @property
    def _per_seq_slots(self) -> int:
        """Slots a contiguous reservation of max_model_len takes per sequence: in every layer group."""
        return self.max_model_len * max(1, len(self.layer_groups))

    @property
    def naive_slots_at_peak(self) -> int:
        """Slots a contiguous max_model_len reservation per sequence holds at our peak step."""
        return self.running_seqs[self.peak_step] * self._per_seq_slots if self.steps else 0

    @property
    def naive_waste_at_peak(self) -> float:
        reserved = self.naive_slots_at_peak
        return (reserved - self.slots_filled[self.peak_step]) / reserved if reserved else 0.0

    @property
    def naive_mean_waste(self) -> float:
        reserved = sum(s * self._per_seq_slots for s in self.running_seqs)
        return (reserved - sum(self.slots_filled)) / reserved if reserved else 0.0

    @property
    def naive_max_seqs(self) -> int:
        """Sequences the same pool holds if each reserves max_model_len contiguous slots."""
        return self.num_blocks * self.block_size // self._per_seq_slots

    @property
    def blocks_saved_by_sharing(self) -> int:
        """Peak over steps of logical blocks (table entries) minus physical blocks in use."""
        return max((lo - ph for lo, ph in zip(self.logical_blocks, self.blocks_used, strict=True)), default=0)

    def group_peaks(self) -> list[int]:
        """Each layer group's most blocks in use at one step."""
        return [max(col, default=0) for col in zip(*self.group_blocks_used, strict=True)] or [0] * len(
            self.layer_groups
        )

    @property
    def blocks_without_windows_at_peak(self) -> int | None:
        """At the peak step, the blocks the pool would hold if no layer had a window: every group as
        many as a global group holds (the same sequences, every block kept). None without a global
        group beside windowed ones (nothing to count it by)."""
        windows = [w for w, _ in self.layer_groups]
        if not self.steps or 0 not in windows or not any(windows):
            return None
        return len(windows) * self.group_blocks_used[self.peak_step][windows.index(0)]

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def prompt_tokens_saved_by_sharing(self) -> int:
        """Prompt tokens the n completions (or beams) of a request did not compute again."""
        return self.prompt_tokens_requested - self.prompt_tokens

    @property
    def mask_share(self) -> float:
        """The grammar masks' share of the run: filling them (overlapping the forward pass) and applying them."""
        s = self.structured
        return (s.mask_s + s.apply_s) / self.wall_time_s if self.wall_time_s else 0.0

    def to_dict(self) -> dict:
        """The report's figures under stable keys (documented in docs/report.md)."""
        mb = self.mean_blocks_used
        return {
            "pool": {
                "num_blocks": self.num_blocks,
                "block_size": self.block_size,
                "bytes_per_token": self.bytes_per_token,
                "bytes_per_block": self.bytes_per_block,
                "kv_bytes_total": self.kv_bytes_total,
                "source": str(self.pool_size),
                "max_model_len": self.max_model_len,
                "kv_cache_dtype": self.kv_cache_dtype,
            },
            "model": {
                "dtype": self.dtype,
                "dtype_reason": self.dtype_reason,
                "dtype_emulated": self.dtype_emulated,
                "matmul_numerics": self.matmul_numerics,
                "weight_bytes": self.weight_bytes,
                "linear_bits_per_weight": round(self.linear_bits_per_weight, 3),
            },
            "cuda_graphs": {
                "mode": self.cuda_graphs,
                "capture_s": round(self.graph_capture_s, 4),
                "graph_steps": self.graph_steps,
            },
            "usage": {
                "steps": self.steps,
                "peak_blocks_used": self.peak_blocks_used,
                "peak_kv_bytes": self.peak_blocks_used * self.bytes_per_block,
                "mean_blocks_used": round(mb, 3),
                "blocks_used_per_step": self.blocks_used,
            },
            "fragmentation": {
                "empty_slots_at_peak": self.empty_slots_at_peak,
                "empty_fraction_at_peak": round(self.fragmentation_at_peak, 6),
                "empty_fraction_mean": round(self.mean_fragmentation, 6),
                "naive_reserved_slots_at_peak": self.naive_slots_at_peak,
                "naive_reserved_bytes_at_peak": self.naive_slots_at_peak * self.bytes_per_token,
                "naive_waste_fraction_at_peak": round(self.naive_waste_at_peak, 6),
                "naive_waste_fraction_mean": round(self.naive_mean_waste, 6),
            },
            "sharing": {
                "peak_logical_blocks": max(self.logical_blocks, default=0),
                "blocks_saved_by_sharing": self.blocks_saved_by_sharing,
                "cow_copies": self.cow_copies,
                "prompt_tokens": self.prompt_tokens,
                "prompt_tokens_requested": self.prompt_tokens_requested,
                "prompt_tokens_computed": self.prompt_tokens_computed,
                "prompt_tokens_saved_by_sharing": self.prompt_tokens_saved_by_sharing,
                "prompt_tokens_saved_by_prefix_cache": self.prefix_cache_hits,
                "prompt_tokens_readmitted": self.prompt_tokens_readmitted,
                "output_tokens_recomputed": self.output_tokens_recomputed,
                "output_tokens_restored": self.output_tokens_restored,
            },
            "layer_groups": {
                "groups": [
                    {
                        "window": w,
                        "layers": list(layers),
                        "peak_blocks_used": peak,
                        "peak_kv_bytes": peak * self.bytes_per_block,
                    }
                    for (w, layers), peak in zip(self.layer_groups, self.group_peaks(), strict=True)
                ],
                "window_releases": self.kv.window_releases,
                "blocks_without_windows_at_peak": self.blocks_without_windows_at_peak,
                "blocks_used_per_step": [list(g) for g in self.group_blocks_used],
            },
            "prefix_cache": {
                "enabled": self.prefix_caching,
                "queries": self.prefix_cache_queries,
                "hits": self.prefix_cache_hits,
                "hit_rate": round(self.prefix_cache_hit_rate, 6),
                "blocks_reused": self.prefix_cache_blocks_reused,
                "evictions": self.prefix_cache_evictions,
                "peak_cached_blocks": max(self.cached_blocks, default=0),
                "cached_blocks_per_step": self.cached_blocks,
            },
            "scheduling": {
                "policy": self.schedule_policy,
                "requests": self.requests,
                "failed_requests": self.failed_requests,
                "completions": self.completions,
                "preemptions": self.preemptions,
                "peak_running_seqs": self.peak_running_seqs,
                "naive_max_seqs": self.naive_max_seqs,
            },
            "structured_outputs": {
                "grammars_compiled": self.structured.compiles,
                "grammar_cache_hits": self.structured.cache_hits,
                "compile_s": round(self.structured.compile_s, 4),
                "masks": self.structured.masks,
                "mask_s": round(self.structured.mask_s, 4),
                "mask_wait_s": round(self.structured.mask_wait_s, 4),
                "mask_apply_s": round(self.structured.apply_s, 4),
                "mask_share_of_wall": round(self.mask_share, 6),
            },
            "lora": self._lora_dict(),
            "speculation": self._speculation_dict(),
            "reproducibility": {
                "covered": self.reproducibility.covered,
                "why": self.reproducibility.why,
                "system_fingerprint": self.system_fingerprint,
            },
            "throughput": {
                "wall_time_s": round(self.wall_time_s, 4),
                "kernel_compile_s": round(self.kernel_compile_s, 3),
                "prompt_tokens_per_s": round(self.prompt_tokens_computed / self.wall_time_s, 3)
                if self.wall_time_s
                else 0.0,
                "generated_tokens": self.generated_tokens,
                "completion_tokens": self.completion_tokens,
                "generated_tokens_per_s": round(self.generated_tokens / self.wall_time_s, 3)
                if self.wall_time_s
                else 0.0,
            },
        }

    @property
    def tokens_per_seq_step(self) -> float:
        """Tokens a decoding sequence took per step it ran in (1 without speculation)."""
        s = self.speculation
        return s.tokens / s.seq_steps if s is not None and s.seq_steps else 0.0

    def _speculation_dict(self) -> dict:
        s = self.speculation
        out: dict = {"mode": self.speculation_mode}
        if s is None:
            return out
        out["num_speculative_tokens"] = s.num_speculative_tokens
        # None: rows taken as free (set so, or no free block to time them on)
        out["fixed_over_row_cost"] = round(s.fixed_over_row, 3) if math.isfinite(s.fixed_over_row) else None
        out["sources"] = {
            name: {
                "drafted": c.drafted,
                "accepted": c.accepted,
                "acceptance_rate": round(c.accepted / c.drafted, 6) if c.drafted else 0.0,
                "seq_steps": c.steps,
            }
            for name, c in s.sources.items()
        }
        out["gated_seq_steps"] = s.gated
        out["seq_steps"] = s.seq_steps
        out["tokens_per_seq_step"] = round(self.tokens_per_seq_step, 6)
        out["tokens_per_step"] = round(self.generated_tokens / self.steps, 6) if self.steps else 0.0
        if s.draft_pool is not None:
            out["draft_pool"] = vars(s.draft_pool)
        return out

    def _lora_dict(self) -> dict:
        base = self.lora_usage.get(None, AdapterUse())
        return {
            "enabled": self.lora_enabled,
            "adapters": [
                {
                    "name": a.name,
                    "path": a.path,
                    "rank": a.rank,
                    "modules": a.modules,
                    **vars(self.lora_usage.get(a.name, AdapterUse())),
                }
                for a in self.lora_adapters.values()
            ],
            "base_requests": base.requests,
            "base_prompt_tokens": base.prompt_tokens,
            "base_completion_tokens": base.completion_tokens,
            "adapter_reads": self.adapter_counters.reads,
            "slot_loads": self.adapter_counters.slot_loads,
        }
