"""The benchmark's tables (markdown) and the ratios of pagedinfer to each peer."""

from __future__ import annotations

from pagedinfer.bench.job import RunResult

REFERENCE = "pagedinfer"


def agreement(ref: list, other: list) -> dict:
    """Share of sequences identical to the reference's (same prompt, same completion or beam rank), and
    of tokens before the first difference."""
    same = total = prefix = tokens = 0
    for completions_a, completions_b in zip(ref, other, strict=True):
        for a, b in zip(completions_a, completions_b, strict=True):
            total += 1
            same += a == b
            k = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            prefix += k
            tokens += len(a)
    return {
        "identical_sequences": same / total if total else 0.0,
        "prefix_token_share": prefix / tokens if tokens else 0.0,
    }


def _score_difference(ref: RunResult, other: RunResult) -> float | None:
    """Largest |score difference| over beams whose tokens are identical (beam search only)."""
    if ref.scores is None or other.scores is None:
        return None
    diffs = [
        abs(sa - sb)
        for ta, tb, ra, rb in zip(ref.outputs, other.outputs, ref.scores, other.scores, strict=True)
        for a, b, sa, sb in zip(ta, tb, ra, rb, strict=True)
        if a == b
    ]
    return max(diffs) if diffs else None


def ratios(figures: dict[str, dict], outputs: dict[str, RunResult] | None) -> dict[str, dict]:
    """pagedinfer / each peer (throughput > 1: faster; memory < 1: smaller); with ``outputs`` (greedy
    and beam workloads) the peer's tokens compared with pagedinfer's."""
    ours = figures.get(REFERENCE)
    if ours is None:
        return {}
    out = {}
    for peer, res in figures.items():
        if peer == REFERENCE:
            continue
        r = {
            "output_tokens_per_s": ours["output_tokens_per_s"] / res["output_tokens_per_s"],
            "wall_s": ours["wall_s"] / res["wall_s"],
            "peak_rss": ours["peak_rss_bytes"] / res["peak_rss_bytes"],
            "peak_kv": ours["peak_kv_bytes"] / res["peak_kv_bytes"] if res["peak_kv_bytes"] else None,
        }
        if outputs is not None:
            r["greedy_agreement"] = agreement(outputs[REFERENCE].outputs, outputs[peer].outputs)
            r["max_score_difference"] = _score_difference(outputs[REFERENCE], outputs[peer])
        out[peer] = r
    return out


def _mib(b: float) -> str:
    return f"{b / 2**20:,.1f}"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def format_gpu(machine: dict) -> str:
    g = machine["gpu"]
    return (
        f"{g['name']} ({g['memory_bytes'] / 2**30:.0f} GiB), torch {machine['torch']}, transformers "
        f"{machine['transformers']}; measured: bfloat16 matmul {g['matmul_size']}^3 "
        f"{g['bf16_flops'] / 1e12:,.0f} TFLOP/s, device copy of {g['copy_bytes'] / 2**30:.0f} GiB "
        f"{g['copy_bytes_per_s'] / 1e12:.2f} TB/s read + written (the peaks the tables' fractions are of)"
    )


def format_machine(machine: dict) -> str:
    if "gpu" in machine:
        return format_gpu(machine)
    rates = "; ".join(
        f"{d} GEMM {g['size']}^3: {g['flops'] / 1e9:.1f} GFLOP/s ({g['flops_per_cpu_s'] / 1e9:.1f} per CPU-second)"
        for d, g in machine["gemm"].items()
    )
    flags = ", ".join(machine["cpu_flags"]) or "none of avx2/avx512f/avx512_bf16/amx_bf16"
    return (
        f"{machine['cpu']} ({flags}), {machine['cores']} cores, torch threads {machine['threads']}; {rates}"
    )


def _pagedinfer_note(system: str, r: dict) -> str:
    st = r.get("stats", {})
    line = (
        f"{system}: {st.get('steps')} steps, peak {st.get('peak_blocks_used')} blocks, "
        f"{st.get('preemptions')} preemptions, prompt tokens computed {st.get('prompt_tokens_computed')} "
        f"of {st.get('prompt_tokens_requested')} requested"
    )
    requested = st.get("prompt_tokens_requested")
    if requested:
        line += f" ({st.get('prompt_tokens_computed', 0) / requested:.3f}x)"
    if st.get("prefix_cache_queries") is not None:
        line += f", prefix cache hits {st.get('prefix_cache_hits')} of {st['prefix_cache_queries']} tokens queried"
    return line


def _split(profile: dict | None) -> str:
    if not profile or "share" not in profile:
        return "n/a"
    sh = profile["share"]
    return f"{100 * sh['attention']:.0f} / {100 * sh['gemm']:.0f} / {100 * sh['other']:.0f}%"


def format_gpu_workload(name: str, res: dict) -> str:
    """A GPU workload's table: throughput, peak GPU memory, KV, the fractions of the GPU's peaks
    reached, and the GPU time split of each system's profiled steps."""
    s = res["settings"]
    shrink = f" (reduced: {res['shrink']})" if res["shrink"] else ""
    lines = [
        f"\n### {name} {res['spec']['title']}, {res['dtype']}: {res['description']}{shrink}",
        f"model {res['model']} ({res['parameters'] / 1e9:.2f}B params, random weights drawn on the GPU); "
        f"block {s['block_size']}, {s['num_blocks']} KV blocks, {s['max_num_batched_tokens']} tokens/step, "
        f"{s['max_num_seqs']} seqs/step (pagedinfer and hf_generate_batch)",
        "",
        "| system | prompts | wall s | output tok/s | total tok/s | peak GPU MiB | peak KV MiB "
        "| matmul peak | HBM | GPU time attention / GEMM / other |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for system, r in res["systems"].items():
        lines.append(
            f"| {system} | {r['prompts']} | {r['wall_s']:.2f} | {r['output_tokens_per_s']:,.0f} "
            f"| {r['total_tokens_per_s']:,.0f} | {_mib(r.get('peak_gpu_bytes', 0))} | {_mib(r['peak_kv_bytes'])} "
            f"| {_pct(r['matmul_peak_fraction'])} | {_pct(r['hbm_fraction'])} | {_split(r.get('profile'))} |"
        )
    for system, message in res["failed"].items():
        lines.append(f"| {system} | failed: {message} | | | | | | | | |")
    for peer, r in res["ratios"].items():
        lines.append(f"- pagedinfer / {peer}: output tok/s {r['output_tokens_per_s']:.2f}x")
    for system, r in res["systems"].items():
        if "cuda_graphs" in r:
            st = r.get("stats", {})
            lines.append(
                f"- {system}: CUDA graphs {r['cuda_graphs']}; {st.get('graph_steps')} of {st.get('steps')} "
                f"steps replayed a graph"
            )
        p = r.get("profile") or {}
        if "top" in p:
            top = ", ".join(f"{k['name'][:60]} ({k['class']}) {k['us'] / 1e3:.2f} ms" for k in p["top"][:4])
            lines.append(
                f"- {system} profile: {p['window_steps']} steps after {p['after_steps']}, "
                f"{p['total_us'] / 1e3:.1f} ms of GPU time; top kernels: {top}"
            )
        elif "error" in p:
            lines.append(f"- {system} profile: {p['error']}")
        if "batching" in r:
            lines.append(f"- {system}: {r['batching']}")
    lines.append(
        "- matmul peak = (prompt + output tokens) x 2 x parameters / wall, over the bfloat16 matmul rate "
        "this device reached at the start of the run; HBM = (forward passes x weight bytes + every generated "
        "token's K/V context bytes) / wall, over the copy bandwidth it reached (n/a: the system does not "
        "report its forward passes)"
    )
    return "\n".join(lines)


def format_workload(name: str, res: dict, machine: dict) -> str:
    if res.get("device") == "cuda":
        return format_gpu_workload(name, res)
    w = res["spec"]
    s = res["settings"]
    shrink = f" (reduced: {res['shrink']})" if res["shrink"] else ""
    lines = [
        f"\n### {name} {w['title']}, {res['dtype']}: {res['description']}{shrink}",
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
    for system, message in res["failed"].items():
        lines.append(f"| {system} | failed: {message} | | | | | | | |")
    for peer, r in res["ratios"].items():
        kv = f"{r['peak_kv']:.3f}x" if r["peak_kv"] is not None else "n/a"
        line = (
            f"- pagedinfer / {peer}: output tok/s {r['output_tokens_per_s']:.2f}x, wall {r['wall_s']:.2f}x, "
            f"peak RSS {r['peak_rss']:.2f}x, peak KV {kv}"
        )
        if "greedy_agreement" in r:
            g = r["greedy_agreement"]
            what = "beams" if w["beam_search"] else "greedy outputs"
            line += (
                f"; {what} identical {100 * g['identical_sequences']:.0f}%"
                f" (tokens before first difference {100 * g['prefix_token_share']:.0f}%)"
            )
        if r.get("max_score_difference") is not None:
            line += f", largest score difference of identical beams {r['max_score_difference']:.2e}"
        lines.append(line)
    notes = []
    if "hf_generate" in res["systems"]:
        notes.append(f"hf_generate: {res['systems']['hf_generate']['batching']}")
    if "hf_generate_batch" in res["systems"]:
        cb = res["systems"]["hf_generate_batch"]
        notes.append(f"hf_generate_batch: {cb['api']}, {cb['config']}")
    notes += [_pagedinfer_note(system, r) for system, r in res["systems"].items() if "stats" in r]
    if res["not_applicable"]:
        notes.append(f"not run (the workload does not name them): {', '.join(res['not_applicable'])}")
    if "loadavg_before" in res:
        before, after = res["loadavg_before"][0], res["loadavg_after"][0]
        notes.append(f"1-min load average {before:.1f} before the timed runs, {after:.1f} after")
    lines += [f"- {n}" for n in notes]
    return "\n".join(lines)


def format_dtype_ratios(name: str, per_dtype: dict[str, dict]) -> str:
    """One workload run in several dtypes: each system's output tok/s in each dtype over the first's,
    per wall second and per CPU second (the steadier figure on a shared machine)."""
    (first, base), *rest = per_dtype.items()
    lines = []
    for dtype, res in rest:
        parts = []
        for system, r in res["systems"].items():
            if system in base["systems"]:
                b = base["systems"][system]
                parts.append(
                    f"{system} {r['wall_s'] / b['wall_s']:.2f}x (CPU {r['cpu_s'] / b['cpu_s']:.2f}x)"
                )
        lines.append(
            f"- {name} output tok/s, {first} / {dtype}: {', '.join(parts) or 'no system ran in both'}"
        )
    return "\n".join(lines)
