"""The documentation is true where a test can tell: every relative link and #anchor of README.md and
docs/**/*.md resolves (anchors as GitHub renders headings), the README's Python example runs, and the
README's first record is what `pagedinfer run prompts/example.jsonl` writes."""

from __future__ import annotations

import ast
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pagedinfer.cli.app import app

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)\)")  # [text](target), not images


def prose(text: str) -> str:
    """``text`` without its fenced code blocks and inline code (links there are examples, not links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(path: Path) -> set[str]:
    """The #anchors GitHub gives the headings of ``path``: lowercased, punctuation dropped (hyphens and
    underscores kept), spaces to hyphens, a repeated one suffixed -1, -2, ..."""
    seen: dict[str, int] = {}
    found = set()
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.S | re.M)
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, flags=re.M):
        plain = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
        slug = re.sub(r"[^\w\- ]", "", plain.lower()).replace(" ", "-")
        found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return found


def links() -> list[tuple[Path, str]]:
    return [
        (page, target)
        for page in PAGES
        for target in LINK.findall(prose(page.read_text(encoding="utf-8")))
        if not re.match(r"[a-z]+:", target)  # http(s), mailto: not checked offline
    ]


def test_the_anchor_rules_are_githubs(tmp_path):
    page = tmp_path / "p.md"
    page.write_text(
        "# The command line\n## `pagedinfer run PROMPTS.jsonl`\n### Ctrl-C, SIGTERM, crashes and `--resume`\n"
        "## Results\n```\n# not a heading\n```\n## Results\n## [Link](x.md) in a heading\n",
        encoding="utf-8",
    )
    assert anchors(page) == {
        "the-command-line",
        "pagedinfer-run-promptsjsonl",
        "ctrl-c-sigterm-crashes-and---resume",
        "results",
        "results-1",
        "link-in-a-heading",
    }


@pytest.mark.parametrize(("page", "target"), links(), ids=lambda x: x.name if isinstance(x, Path) else x)
def test_every_relative_link_and_anchor_resolves(page, target):
    path, _, anchor = target.partition("#")
    resolved = (page.parent / path).resolve() if path else page
    assert resolved.exists(), f"{page.relative_to(ROOT)}: {target} -> {resolved} does not exist"
    if anchor:
        assert resolved.suffix == ".md", target
        assert anchor in anchors(resolved), (
            f"{page.relative_to(ROOT)}: no heading #{anchor} in {resolved.name}"
        )


def _block(language: str, after: str = "", page: str = "README.md") -> str:
    """The first ```language block of ``page`` after the line ``after``."""
    text = (ROOT / page).read_text(encoding="utf-8")
    start = text.index(after) if after else 0
    return re.search(rf"^```{language}\n(.*?)^```", text[start:], flags=re.S | re.M).group(1)


def test_the_readme_python_example_runs(tmp_path):
    run = subprocess.run(
        [sys.executable, "-c", _block("python")], capture_output=True, text=True, cwd=tmp_path, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    romeo, juliet, beams, sharing = run.stdout.splitlines()
    assert len(ast.literal_eval(romeo)) == len(ast.literal_eval(juliet)) == 4  # n=4 completions each
    assert len(ast.literal_eval(beams)) == 4  # beam_width=4, best first
    assert set(ast.literal_eval(sharing)) == {
        "peak_logical_blocks",
        "blocks_saved_by_sharing",
        "cow_copies",
        "prompt_tokens",
        "prompt_tokens_requested",
        "prompt_tokens_computed",
        "prompt_tokens_saved_by_sharing",
        "prompt_tokens_saved_by_prefix_cache",
        "prompt_tokens_readmitted",
        "output_tokens_recomputed",
        "output_tokens_restored",
    }


def test_the_api_pages_first_example_runs_outside_the_checkout(tmp_path):
    code = _block("python", page="docs/api.md")
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "blocks_saved_by_sharing" in run.stdout.splitlines()[-1]


def example_run(tmp_path: Path, *args: str, command: str = "run") -> str:
    """``pagedinfer COMMAND prompts/example.jsonl ARGS`` as the docs ran it (in a folder holding
    prompts/, on an 80-column terminal, `blocks` on a 100-column one): its stdout."""
    (tmp_path / "prompts").mkdir(exist_ok=True)
    shutil.copy(ROOT / "prompts" / "example.jsonl", tmp_path / "prompts")
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        argv = [command, "prompts/example.jsonl", *args] if command == "run" else [command, *args]
        width = "80" if command == "run" else "100"
        # a terminal to Rich (TTY_COMPATIBLE), colourless (TERM=dumb: its size is then COLUMNS x LINES)
        terminal = {"COLUMNS": width, "LINES": "25", "TTY_COMPATIBLE": "1", "TERM": "dumb"}
        result = CliRunner(env=terminal).invoke(app, argv)
    finally:
        os.chdir(cwd)
    assert result.exit_code == 0, result.output
    return result.stdout


def timeless(report: str) -> str:
    """A report without what depends on the machine: the Throughput row, the summary's seconds, the folder
    (and so where the summary wraps: it is joined into one line)."""
    box, end, summary = report.rpartition("╯\n")
    report = box + end + " ".join(summary.split()) + "\n"
    text = re.sub(r"│ Throughput .*?(?=│ \S)", "│ Throughput …\n", report, flags=re.S)
    text = re.sub(r"generated in [\d.]+ s", "generated in … s", text)
    return re.sub(r"→ /\S*/prompts/", "→ …/prompts/", text)  # the summary names the output's full path


def _console(page: Path, after: str) -> str:
    """The ```console block of ``page`` that holds the command line ``after`` (what it printed), or that
    follows the line ``after``."""
    text = page.read_text(encoding="utf-8")
    at = text.index(after)
    start = text.rindex("```console\n", 0, at) if after.startswith("$ ") else text.index("```console\n", at)
    body = re.match(r"```console\n(.*?)^```", text[start:], flags=re.S | re.M).group(1)
    return body.split(after + "\n", 1)[1] if after.startswith("$ ") else body


def test_the_readme_record_and_report_are_those_of_the_example_run(tmp_path):
    shown = example_run(tmp_path)
    first = json.loads(
        (tmp_path / "prompts" / "example.out.jsonl").read_text(encoding="utf-8").splitlines()[0]
    )
    assert json.loads(_block("json", after="## One run")) == first
    assert timeless(_console(ROOT / "README.md", "and prints the memory-usage report:")) == timeless(shown)


def test_the_report_page_samples_are_real_runs(tmp_path):
    page = ROOT / "docs" / "report.md"
    command = "$ pagedinfer run prompts/example.jsonl -n 4 --max-tokens 48 --num-blocks 128 --seed 1"
    shown = example_run(tmp_path, *command.split()[4:])
    assert timeless(_console(page, command)) == timeless(shown)
    assert _console(page, "$ pagedinfer blocks") == example_run(tmp_path, command="blocks")


def test_the_api_page_gives_llms_signature():
    from pagedinfer.llm import LLM

    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    documented = re.search(r"^`LLM\((.*?)\)`:", text, flags=re.S | re.M).group(1)
    pairs = [p.strip() for p in " ".join(documented.split()).split(",") if p.strip() != "*"]
    params = list(inspect.signature(LLM.__init__).parameters.values())[1:]

    def shown(p: inspect.Parameter) -> str:
        value = p.default
        return (
            p.name
            if value is inspect.Parameter.empty
            else f"{p.name}={json.dumps(value) if isinstance(value, str) else value}"
        )

    assert pairs == [shown(p) for p in params]
    table = {m for m in re.findall(r"^\| `(\w+)`", text, flags=re.M)}
    assert {p.name for p in params} - {"kv_cache_memory"} <= table  # each explained (with num_blocks)


@pytest.mark.parametrize("command, page", [("run", "cli.md"), ("bench", "bench.md")])
def test_every_option_has_a_row_in_its_pages_option_table(command, page):
    """Each flag a command's declarations give it (`cli.options.offering`) starts a row of the page's
    option tables (``| `--flag` ...`` or ``| `--name`, `-n` ...``): an option added to a declaration
    without its documentation fails here."""
    from pagedinfer.cli import app as cli

    text = (ROOT / "docs" / page).read_text(encoding="utf-8")
    rows = [line.split("|")[1] for line in text.splitlines() if line.startswith("| `-")]
    documented = {name for row in rows for name in re.findall(r"`(-[-\w]+)", row)}
    flags = {name for s in getattr(cli, command).settings for flag in s.flags for name in flag.split("/")}
    assert flags and flags - documented == set()
