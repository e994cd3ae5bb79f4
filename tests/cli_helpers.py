"""Tiny random-weight models with a trained byte-level BPE tokenizer, for the CLI tests.

Built once per test session (memoized here, so every tests/test_cli*.py module shares one copy).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

BOS, EOS, PAD, USER, ASSISTANT = "<|bos|>", "<|eos|>", "<|pad|>", "<|user|>", "<|assistant|>"
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\n' -}}{%- endif -%}"
)
CORPUS = [
    "To be, or not to be, that is the question.",
    "Whether 'tis nobler in the mind to suffer the slings and arrows of outrageous fortune,",
    "or to take arms against a sea of troubles, and by opposing end them.",
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.",
    "Paged attention stores keys and values in fixed-size blocks.",
] * 4
MAX_POSITIONS = 128


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=[BOS, EOS, PAD, USER, ASSISTANT, "<|system|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
            ),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )


def _llama(vocab: int, bos: int = 0, eos: int = 1):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=bos,
        eos_token_id=eos,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config)


@cache
def _root() -> Path:
    root = Path(tempfile.mkdtemp(prefix="pagedinfer-cli-tests-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


@cache
def tiny_model() -> Path:
    """A 2-layer random Llama (context 128) with a byte-level BPE tokenizer and a chat template."""
    out = _root() / "tiny-llama"
    tok = _tokenizer()
    model = _llama(len(tok), tok.bos_token_id, tok.eos_token_id)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@cache
def tiny_model_no_tokenizer() -> Path:
    """The same kind of model without tokenizer files: token-id prompts only."""
    out = _root() / "tiny-llama-ids"
    _llama(64).save_pretrained(out)
    return out


def write_jsonl(path: Path, lines: list) -> Path:
    """Each item is a dict (dumped as JSON) or a str (written as is)."""
    text = "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines)
    path.write_text(text, encoding="utf-8")
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def invoke(*args, env: dict | None = None):
    """``pagedinfer ARGS`` in this process (Typer's CliRunner); an exception other than an exit is raised."""
    from typer.testing import CliRunner

    from pagedinfer.cli.app import app

    result = CliRunner(env=env).invoke(app, [str(a) for a in args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def one_line_error(result, message: str) -> None:
    """Exit 2 with one line on stderr, ``error: ...`` holding ``message``, and no traceback."""
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert message in " ".join(result.stderr.split()), result.stderr


def sigterm(proc, out: Path) -> tuple[list[dict], str, str]:
    """SIGTERM a running ``pagedinfer run`` writing ``out``: it ends with 143 and a summary counting the
    records it kept. Returns (the kept records, the summary on one line, stderr)."""
    import signal

    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 143, stderr
    kept = read_jsonl(out)
    summary = " ".join(stdout.split())
    assert f"interrupted by SIGTERM: {len(kept)} lines on disk in {out}" in summary, summary
    assert "Traceback" not in stderr
    return kept, summary, stderr


def with_weights(base: Path, out: Path, change) -> Path:
    """A copy of the saved model ``base`` whose state dict ``change`` edits in place."""
    from safetensors.torch import load_file, save_file

    if not out.exists():
        shutil.copytree(base, out)
        file = out / "model.safetensors"
        tensors = load_file(file)
        change(tensors)
        save_file(tensors, file, metadata={"format": "pt"})
    return out


def run_script(name: str, args: str, **env: str) -> str:
    """``scripts/<name> <args>`` run from the checkout in its own interpreter (its imports, its
    argument parsing and its exit code, as a user runs it), with ``env`` added; its stdout, once it
    has exited 0."""
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, f"scripts/{name}", *args.split()],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root), **env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def speculation_on_and_off(tmp_path: Path, model: str, spec: dict, text: str) -> tuple[list[str], dict]:
    """One line (``text``, n=2, seeded) through ``pagedinfer run`` with ``--speculative-config spec``
    and without: the records must be identical. Returns the run's common arguments (for more runs) and
    its report's ``speculation``."""
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": text, "max_tokens": 12, "n": 2, "seed": 1}])
    common = ["run", prompts, "--model", model, "--quiet", "--num-blocks", "32"]
    off = invoke(*common, "-o", tmp_path / "off.jsonl")
    on_args = ["-o", tmp_path / "on.jsonl", "--speculative-config", json.dumps(spec)]
    on = invoke(*common, *on_args, "--report-json", tmp_path / "r.json")
    assert off.exit_code == on.exit_code == 0, on.output
    assert read_jsonl(tmp_path / "on.jsonl") == read_jsonl(tmp_path / "off.jsonl")
    return common, json.loads((tmp_path / "r.json").read_text())["speculation"]
