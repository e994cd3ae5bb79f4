"""What the command line costs before it does anything: `--help`, a typo and a missing file load no
torch and no transformers (the seconds they take to import are what made `--help` slow), and every
`--help` reads whole at 80 columns."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import click
import pytest
import typer.main
from typer.testing import CliRunner

from pagedinfer.cli.app import app

HEAVY = ("torch", "transformers")


def imported_modules(args: list[str], cwd, **env: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run ``python -X importtime -m pagedinfer ARGS`` (``env`` added to the environment): the result
    and every module it imported."""
    run = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "pagedinfer", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, "COLUMNS": "80", **env},
    )
    modules = {
        line.rsplit("|", 1)[1].strip() for line in run.stderr.splitlines() if line.startswith("import time:")
    }
    return run, modules


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        (["--help"], 0, "Commands"),
        (["run", "--help"], 0, "--max-num-batched-tokens"),
        (["blocks", "--help"], 0, "--prompt-tokens"),
        (["bench", "--help"], 0, "--workloads"),
        (["--version"], 0, "pagedinfer 0."),
        (["run", "--max-tokns", "3", "p.jsonl"], 2, "No such option"),
        (["run", "missing.jsonl"], 2, "error: input file missing.jsonl does not exist"),
    ],
    ids=["help", "run-help", "blocks-help", "bench-help", "version", "typo", "missing-input"],
)
def test_nothing_heavy_is_imported_before_a_command_needs_it(tmp_path, args, code, says):
    run, modules = imported_modules(args, tmp_path)
    assert run.returncode == code, run.stderr[-2000:]
    shown = run.stdout + "\n".join(ln for ln in run.stderr.splitlines() if not ln.startswith("import time:"))
    assert says in shown
    assert "pagedinfer.cli.app" in modules  # the probe sees the CLI's own imports
    heavy = sorted(m for m in modules if m.split(".")[0] in HEAVY)
    assert heavy == [], heavy[:10]


def _visible_options(command) -> list[str]:
    options = [p for p in command.params if p.param_type_name == "option" and not p.hidden]
    return [name for p in options for name in [*p.opts, *p.secondary_opts]]


@pytest.mark.parametrize("name", ["run", "blocks", "bench"])
def test_help_is_whole_at_80_columns(name):
    command = typer.main.get_command(app).commands[name]
    text = CliRunner(env={"COLUMNS": "80"}).invoke(app, [name, "--help"]).stdout
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "…" not in text  # no option name or value cut
    cells = [re.sub(r"^[│ ]+|[│ ]+$", "", line) for line in lines]
    for option in _visible_options(command):  # each name whole, in the names column
        assert any(re.match(rf"(.*[ ,/] )?{re.escape(option)}(?![\w-])", c) for c in cells), option
    for p in command.params:  # each default and each choice list whole, on one line
        if p.hidden or p.param_type_name != "option" or p.is_flag or p.default in (None, []):
            continue
        if p.show_default is not False:
            value = getattr(p.default, "value", p.default)
            assert any(f"[default: {value}]" in c for c in cells), p.name
        if isinstance(p.type_descriptor.annotation, type) and hasattr(
            p.type_descriptor.annotation, "__members__"
        ):
            choices = ", ".join(m.value for m in p.type_descriptor.annotation)
            assert any(f"[choices: {choices}]" in c for c in cells), p.name


@pytest.mark.parametrize("name", [None, "run", "blocks", "bench"])
def test_flags_show_no_value_placeholder(name):
    """A flag takes no value, so its help shows none (Typer's group layout showed `--version <bool>`)."""
    group = typer.main.get_command(app)
    command = group if name is None else group.commands[name]
    text = CliRunner(env={"COLUMNS": "80"}).invoke(app, [*([name] if name else []), "--help"]).stdout
    assert "<bool>" not in text and "BOOLEAN" not in text
    assert max(len(line) for line in text.splitlines()) <= 80
    cells = [re.sub(r"^[│ ]+|[│ ]+$", "", line) for line in text.splitlines()]
    ctx = click.Context(group, **group.context_settings)  # -h and --help, as the app sets them
    ctx = ctx if name is None else click.Context(command, parent=ctx)
    params = command.get_params(ctx)  # with the help option
    flags = [p for p in params if p.param_type_name == "option" and p.is_flag and not p.hidden]
    assert "--help" in {name for p in flags for name in p.opts}
    for p in flags:  # the names cell ends at the names: no metavar after them
        names = re.escape(", ".join(p.opts))
        assert any(re.match(rf"{names}( /|\s{{2,}}|$)", c) for c in cells), p.opts


def test_run_help_hides_the_old_names_and_keeps_the_ray_hint():
    text = CliRunner(env={"COLUMNS": "80"}).invoke(app, ["run", "--help"]).stdout
    assert "pip install 'pagedinfer[ray]'" in text  # not eaten as rich markup
    for old in ("--kv-memory", "--max-batched-tokens"):
        assert not re.search(rf"{old}(?![\w-])", text), old
    assert "--prefix-caching /" in text and "--no-prefix-caching" in text  # the pair, on two lines


# what the own layers' path never needs: transformers' model registry and config classes (which bring
# its weight-loading machinery, accelerate, and torch.distributed's tensor package with sympy)
NOT_ON_THE_OWN_PATH = (
    "transformers.models",
    "transformers.modeling_utils",
    "torch.distributed.tensor",
    "accelerate",
)


def test_the_own_layers_run_without_transformers_model_code(tmp_path, tiny_model):
    """The demo model's run, `blocks`, and a GGUF file's (once its cache folder is filled) import none of
    `NOT_ON_THE_OWN_PATH` (the GGUF's run not gguf-py either), and still answer: the run's tokens are
    the demo model's. Once each tokenizer's snapshot is saved (by the first load of its files), those
    runs import no transformers at all."""
    from gguf_models import save_gguf

    text = tmp_path / "text.jsonl"
    text.write_text('{"id": "a", "prompt": "ROMEO:", "max_tokens": 3}\n')
    ids = tmp_path / "ids.jsonl"
    ids.write_text('{"id": "b", "prompt_token_ids": [5, 6], "max_tokens": 3}\n')
    gguf_file = save_gguf(tiny_model("llama"), tmp_path / "tiny-llama.gguf")
    gguf_run = ["run", str(ids), "-o", str(tmp_path / "gguf.jsonl"), "--model", str(gguf_file), "--quiet"]
    demo_run = ["run", str(text), "-o", str(tmp_path / "demo.jsonl"), "--quiet"]
    runs = {
        "gguf-first": gguf_run,  # fills the GGUF's cache folder (transformers reads its metadata once)
        "demo-first": demo_run,  # saves the demo tokenizer's snapshot (transformers loads it once)
        "demo": demo_run,
        "blocks": ["blocks"],
        "gguf": gguf_run,
    }
    caches = {"PAGEDINFER_GGUF_CACHE": str(tmp_path / "gguf-cache")}
    caches["PAGEDINFER_TOKENIZER_CACHE"] = str(tmp_path / "tokenizer-cache")
    for name, args in runs.items():
        run, modules = imported_modules(args, tmp_path, **caches)
        assert run.returncode == 0, (name, run.stderr[-2000:])
        if name != "gguf-first":
            assert "pagedinfer.model.llama" in modules, name  # the own layers ran
            assert sorted(m for m in modules if m.startswith(NOT_ON_THE_OWN_PATH)) == [], name
        if not name.endswith("-first"):  # the tokenizer's snapshot, the rest read without transformers
            assert sorted(m for m in modules if m.split(".")[0] == "transformers") == [], name
        if name == "gguf":  # float tensors and kept blocks are read without gguf-py
            assert sorted(m for m in modules if m.split(".")[0] == "gguf") == []
    demo = json.loads((tmp_path / "demo.jsonl").read_text())
    assert demo["outputs"][0]["token_ids"] == [204, 3749, 380]  # as before the own config reader
    gguf = json.loads((tmp_path / "gguf.jsonl").read_text())
    assert gguf["error"] is None and len(gguf["outputs"][0]["token_ids"]) == 3
