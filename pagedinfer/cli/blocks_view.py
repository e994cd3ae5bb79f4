"""``pagedinfer blocks``: draw the KV pool and every block table, step by step.

Input is a trace: the engine's per-step snapshots (``LLM.enable_trace()``), either recorded by
``pagedinfer run --trace FILE`` or made here for a tiny built-in example (block size 4, a 6-token
prompt, 2 completions) on a random-weight Llama built in a temporary directory, so it runs offline.
Every line fits the terminal (`terminal.say`): the rows wrap between cells under their column.
"""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.rule import Rule
from rich.text import Text

from pagedinfer.terminal import KEEP, keep, say

TRACE_FORMAT = "pagedinfer-trace"
MAX_POOL_CELLS = 24  # larger pools show only the blocks in use
COLUMN = 13  # where a step's rows start after their label ("  scheduled  "): their continuations too


class TraceError(Exception):
    """A trace file that cannot be read; the message is one line."""


# -- trace files --------------------------------------------------------------------------------------
def trace_document(llm) -> dict:
    """The trace an `LLM` recorded (`LLM.trace`), as a trace file holds it."""
    return {"format": TRACE_FORMAT, "version": 1, **llm.trace()}


def save_trace(path: Path, llm) -> None:
    path.write_text(json.dumps(trace_document(llm)) + "\n", encoding="utf-8")


def load_trace(path: Path) -> dict:
    if not path.is_file():
        raise TraceError(
            f"trace file {path} does not exist" if not path.exists() else f"{path} is not a file"
        )
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TraceError(f"{path} is not a trace file: {e}") from None
    if (
        not isinstance(doc, dict)
        or doc.get("format") != TRACE_FORMAT
        or not isinstance(doc.get("steps"), list)
    ):
        raise TraceError(f"{path} is not a pagedinfer trace (record one with `pagedinfer run --trace FILE`)")
    return doc


# -- the built-in example -----------------------------------------------------------------------------
def builtin_trace(
    model: str | None = None,
    block_size: int = 4,
    prompt_tokens: int = 6,
    n: int = 2,
    max_tokens: int = 5,
    num_blocks: int = 8,
    seed: int = 0,
) -> dict:
    """Run the small example with tracing on; the embedded demo model unless ``model`` is given (its
    layers are pagedinfer's own, so no transformers modelling code is imported and nothing is built)."""
    from pagedinfer.llm import LLM
    from pagedinfer.sampling_params import SamplingParams

    llm = LLM(model, block_size=block_size, num_blocks=num_blocks, device="cpu", seed=seed)
    vocab = llm.vocab_size
    prompt = {"prompt_token_ids": [(7 * i + 3) % vocab for i in range(prompt_tokens)]}
    params = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True, seed=seed)
    llm.enable_trace()
    for _, result in llm.generate_iter([prompt], [params], request_ids=["r"]):
        if result.error:
            raise ValueError(result.error)
    return trace_document(llm)


# -- drawing ------------------------------------------------------------------------------------------
def render(doc: dict, console: Console, max_steps: int | None = None) -> None:
    bs = int(doc["block_size"])
    num_blocks = int(doc["num_blocks"])
    steps = doc["steps"]
    say(
        console,
        Text.assemble(  # each symbol kept with its first word
            ("KV pool: ", "bold"),
            f"{num_blocks} physical blocks of {bs} slots.  ",
            ("█", "green"),
            f"{KEEP}filled slot  ",
            ("░", "green dim"),
            f"{KEEP}allocated, empty  ",
            ("×k", "yellow"),
            f"{KEEP}reference count  ",
            (f"▒{KEEP}⟲", "blue"),
            f"{KEEP}cached, unreferenced (prefix cache)  ",
            ("L0→P3", "cyan"),
            f"{KEEP}{keep('logical block 0')} of a sequence lives in {keep('physical block 3')}",
        ),
    )
    shown = steps if max_steps is None else steps[:max_steps]
    tables: dict[str, list[int]] = {}
    for step in shown:
        _render_step(step, bs, num_blocks, tables, console)
        tables = step.get("tables", {})
    if len(shown) < len(steps):
        say(console, Text(f"… {len(steps) - len(shown)} more steps (raise --max-steps)", style="dim"))
    elif steps:
        used = len(_ints(steps[-1].get("ref_counts", {})))
        if used == 0:
            say(console, Text(f"All {num_blocks} blocks are back in the pool.", style="bold green"))
        else:
            say(console, Text(f"{used} blocks still in use at the end of the trace.", style="bold yellow"))


def _ints(mapping: dict) -> dict[int, int]:
    return {int(k): int(v) for k, v in mapping.items()}


def _render_step(step: dict, bs: int, num_blocks: int, before: dict, console: Console) -> None:
    """One step; ``before`` holds the tables at the end of the previous step (for sequences that finish)."""
    refs = _ints(step.get("ref_counts", {}))
    filled = _ints(step.get("filled", {}))
    tables: dict[str, list[int]] = step.get("tables", {})
    events = step.get("events", [])
    cows = {e["block"]: e.get("src") for e in events if e["kind"] == "cow"}
    allocs = {e["block"] for e in events if e["kind"] == "alloc"}
    console.print(Rule(f"step {step.get('step', '?')}", style="dim", align="left"))

    line = Text("  scheduled  ", style="bold")
    for i, s in enumerate(step.get("scheduled", [])):
        if i:
            line.append(f"{KEEP}· ")  # a line never starts with the separator
        line.append_text(_describe_write(s, tables, before, bs, cows, allocs))
    if step.get("preempted"):
        line.append(f"  preempted: {', '.join(step['preempted'])}", style="bold red")
    say(console, line, COLUMN)

    line = Text("  pool       ", style="bold")
    cached = set(step.get("cached", []))
    blocks = range(num_blocks) if num_blocks <= MAX_POOL_CELLS else sorted(refs.keys() | cached)
    for b in blocks:
        if b in cached:  # unreferenced but kept: its K/V serves later prompts that start the same
            line.append(f"P{b}", style="blue")
            line.append(keep(" " + "▒" * min(bs, 8) + " ⟲ "), style="blue")
        else:
            _pool_cell(line, b, refs.get(b, 0), filled.get(b, 0), bs, b in cows)
        line.append(" ")
    if num_blocks > MAX_POOL_CELLS:
        line.append(f"… {num_blocks - len(refs) - len(cached)} free ", style="dim")
    line.append(keep(f"({len(refs)}/{num_blocks} in use"), style="bold")
    line.append(f", {len(cached)} cached)" if cached else ")", style="bold")
    say(console, line, COLUMN)

    for i, (name, table) in enumerate(sorted(tables.items())):
        line = Text("  tables     " if i == 0 else "             ", style="bold")
        line.append(f"{name:<10}", style="bold")
        for logical, block in enumerate(table):
            line.append(f" L{logical}→P{block}", style="bold red" if block in cows else "cyan")
        say(console, line, COLUMN + 10)
    if not tables:
        say(console, Text("  tables     (no live sequences)", style="dim"))

    for text in _describe_events(events, tables):
        say(console, text)


def _pool_cell(line: Text, block: int, ref: int, filled: int, bs: int, copied: bool) -> None:
    """One block's cell; its spaces are kept (a line breaks between cells, never inside one)."""
    line.append(f"P{block}", style="bold red" if copied else ("bold" if ref else "dim"))
    if not ref:
        line.append(keep(" " + "·" * min(bs, 8) + "   "), style="dim")
        return
    if bs <= 8:
        line.append(KEEP)
        line.append("█" * filled, style="green")
        line.append("░" * (bs - filled), style="green dim")
    else:
        line.append(keep(f" {filled:>3}/{bs}"), style="green")
    line.append(keep(f" ×{ref}"), style="yellow bold" if ref > 1 else "yellow")


def _describe_write(s: dict, tables: dict, before: dict, bs: int, cows: dict, allocs: set) -> Text:
    seq, start, count = s["seq"], int(s["start"]), int(s["tokens"])
    span = keep(f"position {start}" if count == 1 else f"positions {start}–{start + count - 1}")
    text = Text(f"{seq} {'prefills' if seq.endswith('/prompt') else 'writes'} {span}")
    table = tables.get(seq)
    logical = start // bs
    if table is None and count == 1 and logical < len(before.get(seq, [])):
        text.append(f" into P{before[seq][logical]}, then finishes", style="magenta")
        return text
    if table is None or count != 1 or logical >= len(table):
        return text
    block = table[logical]
    if block in cows:
        text.append(f" into its copy P{block}", style="bold red")
    elif block in allocs:
        text.append(f" into new block P{block}", style="green")
    else:
        text.append(f" into P{block} in place", style="cyan")
    return text


def _describe_events(events: list[dict], tables: dict) -> list[Text]:
    owners: dict[int, list[str]] = {}
    for name, table in tables.items():
        for block in table:
            owners.setdefault(block, []).append(name)
    out: list[Text] = []
    allocs = [e["block"] for e in events if e["kind"] == "alloc"]
    frees = [e["block"] for e in events if e["kind"] == "free"]
    forks = [e for e in events if e["kind"] == "fork"]
    for e in events:
        if e["kind"] == "cow":
            who = ", ".join(owners.get(e["block"], [])) or "a completion"
            out.append(
                Text.assemble(
                    ("  ! copy-on-write  ", "bold red"),
                    f"{who} had to write into P{e['src']}, a partly filled block it shares; "
                    f"P{e['src']} was copied to P{e['block']} (P{e['src']}'s reference count drops by one)",
                )
            )
    if allocs:
        out.append(Text(f"  + allocated  {', '.join(f'P{b}' for b in allocs)}", style="green"))
    by_table: dict[tuple[int, ...], int] = {}  # one prompt's forks share its table: one line per prompt
    for e in forks:
        key = tuple(e.get("table") or [])
        by_table[key] = by_table.get(key, 0) + 1
    for table, count in by_table.items():
        requests = sorted({name.split("/")[0] for name in owners.get(table[-1], [])}) if table else []
        whose = f"{', '.join(requests)}: " if requests else ""
        blocks = "[" + ", ".join(f"P{b}" for b in table) + "]"
        out.append(
            Text(
                f"  ⑂ fork       {whose}{count} completion{'s' if count > 1 else ''} took references to the "
                f"prompt's blocks {blocks} (no copy); the prompt sequence then dropped its own",
                style="yellow",
            )
        )
    if frees:
        out.append(Text(f"  - returned to the pool  {', '.join(f'P{b}' for b in frees)}", style="magenta"))
    out += _describe_cache_events(events)
    return out


def _describe_cache_events(events: list[dict]) -> list[Text]:
    """Prefix-cache events: hits (blocks a new prompt reused), blocks kept cached, evictions."""
    out = []
    for kind, label, style in (
        ("hit", "  ⟲ prefix cache hit  reused, not computed:", "bold blue"),
        ("cached", "  ⟲ kept cached (no reference left, evictable):", "blue"),
        ("evict", "  ✗ evicted (least recently used cached block, reused for new K/V):", "red"),
    ):
        blocks = [e["block"] for e in events if e["kind"] == kind]
        if blocks:
            out.append(Text(f"{label} {', '.join(f'P{b}' for b in blocks)}", style=style))
    return out
