"""`pagedinfer blocks`: the step-by-step drawing of the pool and the block tables."""

from __future__ import annotations

import json

from cli_helpers import tiny_model, write_jsonl
from typer.testing import CliRunner

from pagedinfer.cli.app import app


def invoke(*args):
    result = CliRunner(env={"COLUMNS": "160"}).invoke(app, [str(a) for a in args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def _steps(text: str) -> list[str]:
    return text.split("step ")[1:]


def test_builtin_example_shows_fork_copy_on_write_and_release():
    result = invoke("blocks")
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert "built-in example: one 6-token prompt, n=2 completions" in text
    steps = _steps(text.split("KV pool:", 1)[1])
    prefill, cow, *_, last = steps
    # after the prompt: 2 physical blocks, both shared by the 2 completions (reference count 2)
    assert "P0 ████ ×2" in prefill and "P1 ██░░ ×2" in prefill and "(2/8 in use)" in prefill
    assert "L0→P0 L1→P1" in prefill and "fork" in prefill
    # the first completion's write copies the partly filled shared block; the second writes in place
    assert "copy-on-write" in cow and "P1 was copied to P2" in cow
    assert "into its copy P2" in cow and "into P1 in place" in cow and "(3/8 in use)" in cow
    assert "r/0        L0→P0 L1→P2" in cow and "r/1        L0→P0 L1→P1" in cow
    # at the end every block is back in the pool
    assert "returned to the pool" in last and "(0/8 in use, 3 cached)" in last  # full blocks stay cached
    assert "All 8 blocks are back in the pool." in text


def test_run_trace_file_is_drawn_by_blocks(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt_token_ids": [3, 4, 5, 6, 7], "n": 3, "max_tokens": 3}])
    trace = tmp_path / "trace.json"
    args = [
        "run",
        path,
        "--model",
        tiny_model(),
        "--block-size",
        "2",
        "--num-blocks",
        "16",
        "--quiet",
        "--trace",
        trace,
    ]
    assert invoke(*args).exit_code == 0
    doc = json.loads(trace.read_text())
    assert doc["format"] == "pagedinfer-trace" and doc["block_size"] == 2 and doc["num_blocks"] == 16
    assert doc["steps"][0]["tables"] == {"1/0": [0, 1, 2], "1/1": [0, 1, 2], "1/2": [0, 1, 2]}
    result = invoke("blocks", trace)
    assert result.exit_code == 0
    assert "P2 █░ ×3" in result.stdout and "copy-on-write" in result.stdout
    assert "All 16 blocks are back in the pool." in result.stdout


def test_blocks_rejects_a_file_that_is_not_a_trace(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text('{"steps": 1}')
    result = invoke("blocks", bad)
    assert result.exit_code == 2 and "is not a pagedinfer trace" in result.stderr
    result = invoke("blocks", tmp_path / "missing.json")
    assert result.exit_code == 2 and "does not exist" in result.stderr


def test_prefix_cache_hits_and_cached_blocks_are_drawn(tmp_path):
    """The second request shares the first's 2 full prompt blocks: kept cached, then hit."""
    lines = [
        {"prompt_token_ids": [3, 4, 5, 6, 7], "max_tokens": 1},
        {"prompt_token_ids": [3, 4, 5, 6, 9], "max_tokens": 1},
    ]
    path = write_jsonl(tmp_path / "p.jsonl", lines)
    trace = tmp_path / "trace.json"
    args = ["run", path, "--model", tiny_model(), "--block-size", "2", "--num-blocks", "8", "--quiet"]
    assert invoke(*args, "--max-num-seqs", "1", "--trace", trace).exit_code == 0
    text = invoke("blocks", trace).stdout
    first, second, *_ = _steps(text.split("KV pool:", 1)[1])
    assert "kept cached (no reference left, evictable): P1, P0" in first and "2 cached)" in first
    assert "P0 ▒▒ ⟲" in first and "P1 ▒▒ ⟲" in first
    assert "prefix cache hit  reused, not computed: P0, P1" in second


def test_blocks_fit_60_and_80_columns_breaking_rows_between_cells():
    import io
    import re

    from rich.cells import cell_len
    from rich.console import Console

    from pagedinfer.cli import blocks_view

    doc = blocks_view.builtin_trace()

    def drawn(width: int) -> str:
        out = io.StringIO()
        terminal = Console(file=out, width=width, force_terminal=True, color_system=None, soft_wrap=True)
        blocks_view.render(doc, terminal)
        return out.getvalue()

    def words(text: str) -> list[str]:
        return [w for w in text.split() if set(w) != {"─"}]  # a step's rule is as wide as the terminal

    def cells(text: str) -> list[str]:
        return re.findall(r"P\d+ (?:[█░]{4} ×\d+|·{4}|▒{4} ⟲)", text)  # block size 4

    whole = drawn(1000)
    assert len(cells(whole)) == 5 * 8  # every block of the pool, at every step
    for width in (60, 80):
        text = drawn(width)
        assert max(cell_len(line) for line in text.splitlines()) <= width
        assert words(text) == words(whole)  # only line breaks and indents were added
        assert cells(text) == cells(whole)  # no cell broken
        pool = [ln for ln in text.splitlines() if ln.startswith("  pool ")]
        assert all(ln.startswith("  pool       P0 ") for ln in pool) and len(pool) == 5
        rows = text.split("  pool       P0 ")[1].split("  tables")[0].splitlines()[1:]
        assert rows and all(ln.startswith(" " * 13 + "P") or ln.startswith(" " * 13 + "(") for ln in rows)
