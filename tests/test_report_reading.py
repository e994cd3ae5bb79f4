"""Reading the output: the memory report whole at 80 columns, and the report, `blocks` and the summary
agreeing with each other and with the records (what shared the blocks, every prompt that forked, the
tokens of beam search, "1 token")."""

from __future__ import annotations

import io
import json
import re

import pytest
from cli_helpers import invoke, read_jsonl, tiny_model, write_jsonl
from rich.console import Console
from typer.testing import CliRunner

from pagedinfer import LLM, SamplingParams
from pagedinfer.cli import report
from pagedinfer.cli.app import app


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_model())


def rendered(stats, width: int) -> list[str]:
    """The report's lines at ``width`` columns, without the panel's borders and the label column."""
    console = Console(file=io.StringIO(), width=width, color_system=None)
    report.render(stats, console)
    lines = console.file.getvalue().splitlines()
    assert max(len(line) for line in lines) <= width
    return [line[2:-2][15:].rstrip() for line in lines[1:-1]]  # "│ " label (13) gap (2) value " │"


def test_the_report_never_splits_a_value_at_80_columns(model):
    llm = LLM(model, device="cpu", block_size=4, num_blocks=40)  # a small pool: preemptions too
    prefix = list(range(3, 15))
    prompts = [{"prompt_token_ids": prefix + [20 + i, 40 + i]} for i in range(6)]
    llm.generate(prompts, SamplingParams(n=3, max_tokens=24, ignore_eos=True, seed=2), use_tqdm=False)
    stats = llm.stats
    assert stats.preemptions and stats.prefix_cache_hits and stats.cow_copies  # every optional part shows
    wide, narrow = rendered(stats, 200), rendered(stats, 80)
    prose = [line for line in wide if line.startswith("†") or "max_model_len (" in line]  # the footnote
    parts = [part for line in wide if line not in prose for part in re.split(r" · | (?=[=+] )", line)]
    values = [part for part in parts if re.search(r"\d", part)] + [f"max_model_len ({stats.max_model_len})"]
    assert len(values) > 25
    for value in values:  # each figure with its words and unit, on one line of the 80-column report
        assert any(value.strip() in line for line in narrow), value


def _sharing_row(stats) -> str:
    lines = rendered(stats, 200)
    start = next(i for i, line in enumerate(lines) if "logical blocks" in line)
    return " · ".join(lines[start : start + 2])  # a row's lines break only where " · " was


def test_the_sharing_row_says_what_shared_the_blocks(model):
    llm = LLM(model, device="cpu", block_size=4, num_blocks=64)
    prefix = list(range(3, 15))  # 3 full blocks both prompts start with
    prompts = [{"prompt_token_ids": prefix + [30]}, {"prompt_token_ids": prefix + [31]}]
    llm.generate(prompts, SamplingParams(n=1, max_tokens=8, ignore_eos=True), use_tqdm=False)
    stats = llm.stats
    assert stats.blocks_saved_by_sharing == 3 and stats.prefix_cache_blocks_reused == 3
    assert stats.prompt_tokens_saved_by_sharing == 0  # n = 1: nothing shared among completions
    row = _sharing_row(stats)
    saved = report.human_bytes(3 * stats.bytes_per_block)
    assert (
        f"3 blocks ({saved}) saved by sharing · through the prefix cache" in row and "completions" not in row
    )

    llm = LLM(model, device="cpu", block_size=4, num_blocks=64, enable_prefix_caching=False)
    llm.generate(prompts, SamplingParams(n=1, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert (
        "0 blocks (0 B) saved by sharing · nothing to share: n = 1 and no prefix-cache hit"
        in _sharing_row(llm.stats)
    )

    llm.generate(prompts[:1], SamplingParams(n=2, max_tokens=8, ignore_eos=True, seed=1), use_tqdm=False)
    assert llm.stats.blocks_saved_by_sharing == 3
    assert "saved by sharing · among a prompt's completions" in _sharing_row(llm.stats)

    llm = LLM(model, device="cpu", block_size=4, num_blocks=64)
    llm.generate(prompts, SamplingParams(n=2, max_tokens=8, ignore_eos=True, seed=1), use_tqdm=False)
    assert "saved by sharing · among completions and through the prefix cache" in _sharing_row(llm.stats)


def test_blocks_names_every_prompt_that_forked_in_a_step(model, tmp_path):
    lines = [{"id": "a", "prompt_token_ids": list(range(5, 11)), "n": 2, "max_tokens": 3}]
    lines += [{"id": "b", "prompt_token_ids": list(range(11, 17)), "n": 3, "max_tokens": 3}]
    prompts = write_jsonl(tmp_path / "p.jsonl", lines)
    trace = tmp_path / "trace.json"
    args = ["--model", model, "--device", "cpu", "--block-size", "4", "--trace", trace, "-q"]
    assert invoke("run", prompts, *args).exit_code == 0
    drawn = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["blocks", str(trace)]).stdout
    forks = [line.strip() for line in drawn.splitlines() if "⑂ fork" in line]
    tables = json.loads(trace.read_text())["steps"][0]["tables"]
    a, b = (tables[f"{r}/0"] for r in "ab")
    assert forks == [
        f"⑂ fork       a: 2 completions took references to the prompt's blocks [P{a[0]}, P{a[1]}] (no copy); "
        "the prompt sequence then dropped its own",
        f"⑂ fork       b: 3 completions took references to the prompt's blocks [P{b[0]}, P{b[1]}] (no copy); "
        "the prompt sequence then dropped its own",
    ]


def test_the_summary_counts_the_tokens_the_records_hold(model, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "To be, or not"}, {"prompt": "Whether 'tis"}])
    out, doc = tmp_path / "o.jsonl", tmp_path / "r.json"
    result = invoke("run", prompts, "--model", model, "--beam-width", "3", "--max-tokens", "6", "-o", out,
                    "--report-json", doc, "--no-report", "-q")  # fmt: skip
    assert result.exit_code == 0, result.output
    in_records = sum(r["usage"]["completion_tokens"] for r in read_jsonl(out))
    throughput = json.loads(doc.read_text())["throughput"]
    assert throughput["completion_tokens"] == in_records != throughput["generated_tokens"]
    assert f"· {in_records} tokens generated in " in result.stdout

    one = write_jsonl(tmp_path / "one.jsonl", [{"prompt": "To be", "max_tokens": 1}])
    result = invoke("run", one, "--model", model, "-o", tmp_path / "one.out.jsonl", "-q")
    assert "· 1 token generated in " in result.stdout
