"""The memory-usage report: where every KV byte went during a run, drawn with rich, and as JSON.

All figures come from `EngineStats` (pagedinfer/engine/stats.py); `derived` adds the few byte and
ratio figures the report shows on top of ``stats.to_dict()``. The JSON keys are documented in the
``docs/report.md`` (``--report-json FILE``) (tests/test_cli_run.py checks that each one is there).
"""

from __future__ import annotations

from rich import box
from rich.console import Console, Group
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from pagedinfer.config import PoolSize, flag_of
from pagedinfer.engine.stats import AdapterUse, EngineStats

BARS = " ▁▂▃▄▅▆▇█"
CHART_ROWS = 4


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError  # unreachable


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def derived(stats: EngineStats) -> dict:
    """Figures the report adds to ``stats.to_dict()`` (bytes, savings, the most-shared step)."""
    bpt = stats.bytes_per_token
    saving = [lo - ph for lo, ph in zip(stats.logical_blocks, stats.blocks_used, strict=True)]
    best = max(range(len(saving)), key=saving.__getitem__) if saving else None
    naive_waste_slots = stats.naive_slots_at_peak - stats.slots_filled[stats.peak_step] if stats.steps else 0
    return {
        "empty_bytes_at_peak": stats.empty_slots_at_peak * bpt,
        "naive_wasted_bytes_at_peak": naive_waste_slots * bpt,
        "peak_filled_slots": stats.slots_filled[stats.peak_step] if stats.steps else 0,
        "peak_step": stats.peak_step,
        "logical_blocks_at_max_sharing": stats.logical_blocks[best] if best is not None else 0,
        "physical_blocks_at_max_sharing": stats.blocks_used[best] if best is not None else 0,
        "bytes_saved_by_sharing": stats.blocks_saved_by_sharing * stats.bytes_per_block,
        "prompt_tokens_saved_by_sharing": stats.prompt_tokens_requested - stats.prompt_tokens,
        "pool_usage_fraction_at_peak": round(stats.peak_blocks_used / stats.num_blocks, 6),
    }


def report_dict(stats: EngineStats | None, run: dict) -> dict:
    """The ``--report-json`` document: ``stats.to_dict()``, ``derived`` and the run's summary."""
    from pagedinfer import __version__

    doc: dict = {"version": __version__}
    if stats is not None:
        doc.update(stats.to_dict())
        doc["derived"] = derived(stats)
    doc["run"] = run
    return doc


def resample(values: list[int], width: int) -> list[int]:
    """``width`` columns: each the max of its steps (peaks stay visible), or steps repeated to fill."""
    if not values or width <= 0:
        return []
    if len(values) <= width:
        return [values[j * len(values) // width] for j in range(width)]
    out = []
    for j in range(width):
        lo = j * len(values) // width
        hi = max(lo + 1, (j + 1) * len(values) // width)
        out.append(max(values[lo:hi]))
    return out


def bar_chart(values: list[int], width: int, top: int, rows: int = CHART_ROWS) -> list[str]:
    """A ``rows``-high unicode bar chart of ``values`` resampled to ``width`` columns, 0..top."""
    cols = resample(values, width)
    levels = rows * 8
    heights = [round(v / top * levels) if top else 0 for v in cols]
    heights = [max(h, 1) if v else 0 for h, v in zip(heights, cols, strict=True)]
    lines = []
    for row in range(rows - 1, -1, -1):
        base = row * 8
        lines.append("".join(BARS[min(8, max(0, h - base))] for h in heights))
    return lines


def describe_source(size: PoolSize) -> str:
    """What decided the pool's size, in the CLI's words."""
    if size.origin == "num_blocks":
        groups = f" × {size.layer_groups} layer groups" if size.layer_groups > 1 else ""
        return f"{flag_of(size.origin)} {size.num_blocks // size.layer_groups}{groups}"
    if size.origin == "kv_cache_memory":
        return f"{flag_of(size.origin)} ({human_bytes(size.kv_cache_memory)})"
    if size.origin == "gpu_memory_utilization":
        return f"{flag_of(size.origin)} {size.gpu_memory_utilization} (of free GPU memory)"
    return f"the default ({str(size)[len('default: ') :].replace(' x ', ' × ')})"


LABEL_WIDTH = 13  # "Fragmentation"
MAX_WIDTH = 100  # the panel's width on a wider terminal


def flow(parts: list[str], width: int, sep: str = " · ") -> Text:
    """``parts`` (rich markup) joined by ``sep``, each line broken only between two parts, so that a
    figure and its unit ("6.1 MiB", "wall 0.52 s") are never split. Parts are kept shorter than the
    80-column value width; a longer one (prose) wraps between its words."""
    text, used = Text(), 0
    for part in parts:
        piece = Text.from_markup(part)
        if used and used + len(sep) + piece.cell_len > width:
            text.append("\n")
            used = 0
        elif used:
            text.append(sep)
            used += len(sep)
        text.append_text(piece)
        used += piece.cell_len
    return text


class _Rows:
    """The report's label | value grid; each value a `flow` of parts at the console's width."""

    def __init__(self, console: Console) -> None:
        self.width = min(console.width, MAX_WIDTH) - 4 - LABEL_WIDTH - 2  # borders, padding, the gap
        self.grid = Table.grid(padding=(0, 2))
        self.grid.add_column(style="bold cyan", no_wrap=True, min_width=LABEL_WIDTH)
        self.grid.add_column(overflow="fold")

    def add(self, label: str, parts: list[str], sep: str = " · ") -> None:
        self.grid.add_row(label, flow(parts, self.width, sep))


def _words(text: str, keep: str) -> list[str]:
    """``text``'s words as `flow` parts, ``keep`` (a name with its value) one part."""
    before, _, after = text.partition(keep)
    return [*before.split(), keep, *after.split()]


def _plural(n: int, word: str, plural: str | None = None) -> str:
    return f"{n:,} {word if n == 1 else plural or word + 's'}"


def _shared_by(stats: EngineStats) -> str:
    """What the blocks saved by sharing were shared by: a prompt's completions (n > 1 or beams), requests
    through the prefix cache, both, or nothing. The engine counts the saving once (logical - physical blocks)."""
    forked = stats.completions > stats.requests - stats.failed_requests
    cache = stats.prefix_cache_blocks_reused > 0
    if forked and cache:
        return "among completions and through the prefix cache"
    if not (forked or cache):
        return "nothing to share: n = 1 and no prefix-cache hit"
    return "through the prefix cache" if cache else "among a prompt's completions"


def render(stats: EngineStats, console: Console) -> None:
    """Print the report panel for one run."""
    d = derived(stats)
    rows = _Rows(console)
    rows.add(
        "Pool",
        [
            f"[bold]{stats.num_blocks:,}[/] blocks × {stats.block_size} tokens = "
            f"{stats.num_blocks * stats.block_size:,} slots",
            f"{human_bytes(stats.bytes_per_token)}/token",
            f"{human_bytes(stats.bytes_per_block)}/block",
            f"[bold]{human_bytes(stats.kv_bytes_total)}[/] of KV cache",
        ],
    )
    rows.add(
        "",
        [
            f"[dim]sized by[/] {describe_source(stats.pool_size)}",
            f"[dim]max_model_len[/] {stats.max_model_len:,}",
        ],
    )
    # dtype line: the run's dtype (yellow when it runs emulated) and why --dtype auto chose it
    shown = f"[bold yellow]{stats.dtype}[/]" if stats.dtype_emulated else f"[bold]{stats.dtype}[/]"
    rows.add("dtype", [shown, f"[dim]{escape(stats.dtype_reason)}[/]"])
    if stats.matmul_numerics != "exact":  # the quantized weights' products are not the float32 ones
        rows.add("Numerics", [f"[bold]{stats.matmul_numerics}[/] [dim](--matmul-numerics)[/]"])
    if stats.kv_cache_dtype != stats.dtype:
        rows.add("K/V dtype", [f"[bold]{stats.kv_cache_dtype}[/] [dim](--kv-cache-dtype)[/]"])
    if stats.weight_bytes:
        rows.add(
            "Weights",
            [
                f"[bold]{human_bytes(stats.weight_bytes)}[/]",
                f"{stats.linear_bits_per_weight:.2f} bits per linear weight",
                f"[dim](beside {human_bytes(stats.kv_bytes_total)} of KV cache)[/]",
            ],
        )
    # docs/reproducibility.md: whether the records can be expected to come out the same elsewhere
    rows.add("Reproducible", escape(stats.reproducibility.words()).split(), sep=" ")
    if stats.cuda_graphs and stats.cuda_graphs != "not applicable on the CPU":
        rows.add(
            "CUDA graphs",
            [escape(stats.cuda_graphs), f"{_plural(stats.graph_steps, 'step')} replayed a graph"],
        )
    if not stats.steps:
        rows.add("Usage", ["[dim]no engine steps ran[/]"])
        console.print(
            Panel(rows.grid, title="[bold]KV cache memory report[/]", border_style="cyan", expand=False)
        )
        return
    rows.add(
        "Usage",
        [
            f"peak [bold]{stats.peak_blocks_used:,}[/] blocks ({_pct(d['pool_usage_fraction_at_peak'])} of the "
            f"pool, {human_bytes(stats.peak_blocks_used * stats.bytes_per_block)}) at step {stats.peak_step}",
            f"mean {stats.mean_blocks_used:,.1f} blocks over {_plural(stats.steps, 'step')}",
        ],
    )
    if any(w for w, _ in stats.layer_groups):
        _layer_group_rows(stats, rows)
    parts: list = [rows.grid, _chart(stats, console)]

    rows = _Rows(console)
    rows.add(
        "Fragmentation",
        [
            f"paged (this run): [bold green]{_pct(stats.fragmentation_at_peak)}[/] empty at peak",
            _plural(stats.empty_slots_at_peak, "slot"),
            human_bytes(d["empty_bytes_at_peak"]),
            f"mean [green]{_pct(stats.mean_fragmentation)}[/]",
        ],
    )
    rows.add(
        "",
        [
            f"contiguous †: [bold red]{_pct(stats.naive_waste_at_peak)}[/] empty at peak",
            f"{human_bytes(d['naive_wasted_bytes_at_peak'])} of "
            f"{human_bytes(stats.naive_slots_at_peak * stats.bytes_per_token)}",
            f"mean [red]{_pct(stats.naive_mean_waste)}[/]",
        ],
    )
    rows.add(
        "",
        [
            f"[dim]{word}[/]"
            for word in _words(
                "† empty slots among those allocated; a non-paged cache reserves max_model_len "
                f"({stats.max_model_len:,}) contiguous slots per running sequence",
                keep=f"max_model_len ({stats.max_model_len:,})",
            )
        ],
        sep=" ",
    )
    saved_prompt = d["prompt_tokens_saved_by_sharing"]
    rows.add(
        "Sharing",
        [
            f"{d['logical_blocks_at_max_sharing']:,} logical blocks → "
            f"{d['physical_blocks_at_max_sharing']:,} physical",
            f"[bold]{_plural(stats.blocks_saved_by_sharing, 'block')}[/] "
            f"({human_bytes(d['bytes_saved_by_sharing'])}) saved by sharing",
            _shared_by(stats),
            f"[bold]{stats.cow_copies:,}[/] copy-on-write {'copy' if stats.cow_copies == 1 else 'copies'}",
        ],
    )
    rows.add(
        "",
        [
            f"prompt tokens {stats.prompt_tokens_requested:,} requested (× n)",
            f"{stats.prompt_tokens_computed:,} computed",
        ]
        + ([f"{saved_prompt:,} never computed thanks to sharing"] if saved_prompt else []),
    )
    preempted = [f"[bold]{_plural(stats.preemptions, 'preemption')}[/]"]
    if stats.preemptions:
        preempted += [
            f"{stats.output_tokens_recomputed:,} generated tokens recomputed",
            f"{stats.output_tokens_restored:,} found in the prefix cache",
        ]
    rows.add(
        "Scheduling",
        [
            f"{_plural(stats.completions, 'completion')} of {_plural(stats.requests - stats.failed_requests, 'request')}"
        ]
        + preempted,
    )
    rows.add(
        "",
        [
            f"peak [bold]{stats.peak_running_seqs:,}[/] concurrent sequences",
            f"reserving {stats.max_model_len:,} contiguous slots each, this pool holds "
            f"[bold]{stats.naive_max_seqs:,}[/]",
        ],
    )
    t = stats.to_dict()["throughput"]
    tokens = f"{_plural(stats.generated_tokens, 'token')}"
    if stats.completion_tokens != stats.generated_tokens:  # beam search: shared histories, pruned beams
        tokens += f", {stats.completion_tokens:,} returned"
    rows.add(
        "Throughput",
        [
            f"prompt {t['prompt_tokens_per_s']:,.1f} tok/s",
            f"generated [bold]{t['generated_tokens_per_s']:,.1f}[/] tok/s ({tokens})",
            f"wall {stats.wall_time_s:.2f} s",
        ]
        + (
            [f"CPU kernels compiled before it in {stats.kernel_compile_s:.1f} s (once)"]
            if stats.kernel_compile_s
            else []
        ),
    )
    s = stats.structured
    if s.compiles or s.cache_hits:  # structured outputs ran
        rows.add(
            "Grammars",
            [
                f"[bold]{s.compiles:,}[/] compiled in {s.compile_s:.2f} s",
                _plural(s.cache_hits, "cache hit"),
                f"{_plural(s.masks, 'token mask')}: {s.mask_s:.2f} s filling (beside the forward pass)",
                f"{s.mask_wait_s:.2f} s waited",
                f"{s.apply_s:.2f} s applying",
                f"[bold]{_pct(stats.mask_share)}[/] of the wall time",
            ],
        )
    if stats.lora_enabled:
        rows.add("Adapters", _adapter_parts(stats))
    if stats.speculation_mode != "off":
        rows.add("Speculation", _speculation_parts(stats))
    _prefix_cache_rows(stats, rows)
    parts.append(rows.grid)
    console.print(
        Panel(Group(*parts), title="[bold]KV cache memory report[/]", border_style="cyan", expand=False)
    )


def _adapter_parts(stats: EngineStats) -> list[str]:
    """Each adapter's lines and tokens in this run, then the base model's, then the slot loads and reads
    (more than one per adapter: adapters were swapped in and out of the ``max_loras`` slots)."""

    def use(name: str | None) -> str:
        u = stats.lora_usage.get(name, AdapterUse())
        return f"{_plural(u.requests, 'line')}, {u.prompt_tokens:,} prompt + {u.completion_tokens:,} generated tokens"

    named = [
        f"[bold]{escape(a.name)}[/] (rank {a.rank}): {use(a.name)}" for a in stats.lora_adapters.values()
    ]
    c = stats.adapter_counters
    swaps = f"{_plural(c.slot_loads, 'adapter installed', 'adapters installed')} in a slot"
    return [*named, f"base model: {use(None)}", f"{swaps}, {_plural(c.reads, 'read')} from disk"]


def _speculation_parts(stats: EngineStats) -> list[str]:
    """Speculative decoding's row: what ran, each source's drafted and accepted tokens, tokens per step."""
    s = stats.speculation
    if s is None:  # asked for, refused (the run is off the reproducible path)
        return [escape(stats.speculation_mode)]
    parts = [escape(stats.speculation_mode)]
    for name, c in s.sources.items():
        if c.drafted:
            parts.append(
                f"{name}: {c.accepted:,} of {c.drafted:,} drafted accepted ({_pct(c.accepted / c.drafted)})"
            )
    parts.append(f"[bold]{stats.tokens_per_seq_step:.2f}[/] tokens per sequence-step")
    parts.append(_plural(s.gated, "draft") + " gated off")
    if (d := s.draft_pool) is not None:
        parts.append(
            f"draft model's K/V {human_bytes(d.bytes_per_block)}/block "
            f"({human_bytes(d.kv_bytes)} of the pool's {human_bytes(stats.kv_bytes_total)}), "
            f"{d.computed_positions:,} positions computed"
        )
    return parts


def _layer_group_rows(stats: EngineStats, rows: _Rows) -> None:
    """Each layer group's peak, and the blocks its windows gave back (docs/report.md)."""
    for i, ((window, layers), peak) in enumerate(zip(stats.layer_groups, stats.group_peaks(), strict=True)):
        rows.add(
            "Layer groups" if i == 0 else "",
            [
                f"window {window:,}" if window else "global",
                f"layers {', '.join(map(str, layers))}",
                f"peak [bold]{peak:,}[/] blocks ({human_bytes(peak * stats.bytes_per_block)})",
            ],
        )
    saved = [f"windows released {_plural(stats.kv.window_releases, 'table entry', 'table entries')}"]
    if (without := stats.blocks_without_windows_at_peak) is not None:
        kept = stats.blocks_used[stats.peak_step]
        saved.append(
            f"at peak [bold green]{without - kept:,}[/] blocks "
            f"({human_bytes((without - kept) * stats.bytes_per_block)}) fewer than keeping every block ({without:,})"
        )
    rows.add("", saved)


def _prefix_cache_rows(stats: EngineStats, rows: _Rows) -> None:
    """Prefix caching across requests: hit rate, reuse, evictions, and where the prompt tokens went."""
    if not stats.prefix_caching:
        rows.add("Prefix cache", ["[dim]off (--no-prefix-caching)[/]"])
        return
    rows.add(
        "Prefix cache",
        [
            f"hit rate [bold]{_pct(stats.prefix_cache_hit_rate)}[/] ({stats.prefix_cache_hits:,} of "
            f"{stats.prefix_cache_queries:,} prompt tokens looked up)",
            f"[bold]{_plural(stats.prefix_cache_blocks_reused, 'block')}[/] reused",
            f"{stats.prefix_cache_evictions:,} evicted",
            f"up to {_plural(max(stats.cached_blocks, default=0), 'unreferenced block')} kept cached",
            f"admission {stats.schedule_policy}",
        ],
    )
    readmitted = (
        [f"+ {stats.prompt_tokens_readmitted:,} readmitted after preemption"]
        if stats.prompt_tokens_readmitted
        else []
    )
    rows.add(
        "",
        [f"prompt tokens {stats.prompt_tokens_requested:,} requested", *readmitted]
        + [
            f"= [bold]{stats.prompt_tokens_computed:,}[/] computed",
            f"+ {stats.prompt_tokens_saved_by_sharing:,} saved by sharing among completions",
            f"+ [bold]{stats.prefix_cache_hits:,}[/] saved by the prefix cache",
        ],
        sep=" ",
    )


def _chart(stats: EngineStats, console: Console) -> Text:
    """Blocks in use per step, resampled to the terminal width, 0..peak."""
    label_width = 8
    width = max(10, min(console.width, MAX_WIDTH) - 4 - label_width)
    lines = bar_chart(stats.blocks_used, width, max(stats.peak_blocks_used, 1))
    chart = Text(no_wrap=True, overflow="crop")
    for i, line in enumerate(lines):
        if i == 0:
            label = f"{stats.peak_blocks_used:>6} ┤"
        elif i == len(lines) - 1:
            label = f"{0:>6} ┤"
        else:
            label = " " * 6 + " │"
        chart.append(label, style="dim")
        chart.append(line + "\n", style="green")
    chart.append(" " * 7 + "└" + "─" * width + "\n", style="dim")
    chart.append(f"{'':8}blocks in use per step, step 0 → {stats.steps - 1}", style="dim")
    if stats.steps > width:
        chart.append(f" ({stats.steps:,} steps, max per column)", style="dim")
    return chart


def render_replicas(rows: list[dict], console: Console) -> None:
    """The per-replica table printed under the (merged) memory report."""
    table = Table(title="replicas", box=box.SIMPLE_HEAD, title_justify="left", padding=(0, 1))
    for name in (
        "#",
        "host:pid",
        "device",
        "requests",
        "steps",
        "peak blocks",
        "tokens",
        "tok/s",
        "busy s",
        "restarts",
    ):
        table.add_column(name, justify="left" if name in ("host:pid", "device") else "right", no_wrap=True)
    for r in rows:
        table.add_row(
            str(r["replica"]),
            f"{r['host']}:{r['pid']}",
            r["device"],
            f"{r['requests']:,}",
            f"{r['steps']:,}",
            f"{r['peak_blocks_used']:,} ({human_bytes(r['peak_kv_bytes'])})",
            f"{r['generated_tokens']:,}",
            f"{r['generated_tokens_per_s']:,.1f}",
            f"{r['busy_s']:.2f}",
            str(r["restarts"]),
        )
    console.print(table)
