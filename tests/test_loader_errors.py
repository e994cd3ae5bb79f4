"""A model directory whose files are broken is refused at load in one line naming the file: a garbage
tokenizer (instead of loading without one and failing every text line), a checkpoint missing a
tensor its config names (instead of a bare key, or transformers' random fill)."""

from __future__ import annotations

import shutil

import pytest
from cli_helpers import invoke, tiny_model, write_jsonl
from safetensors.torch import load_file, save_file

from pagedinfer.llm import LLM
from pagedinfer.model.loader import ModelLoadError

MISSING = "model.layers.1.mlp.down_proj.weight"


def copy_of_tiny_model(tmp_path):
    path = tmp_path / "model"
    shutil.copytree(tiny_model(), path)
    return path


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("garbage{", "not valid JSON (Expecting value: line 1 column 1 (char 0))"),
        ('{"version": "1.0", "model": {"type": "BPE"}}', "missing key 'added_tokens'"),
    ],
    ids=["not-json", "not-a-tokenizer"],
)
def test_a_broken_tokenizer_is_refused_at_load_naming_the_file(tmp_path, text, reason):
    path = copy_of_tiny_model(tmp_path)
    (path / "tokenizer.json").write_text(text, encoding="utf-8")
    message = f"cannot load the tokenizer of {str(path)!r}: {path / 'tokenizer.json'}: {reason}"
    with pytest.raises(ModelLoadError) as raised:
        LLM(str(path), device="cpu")
    assert str(raised.value) == message
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "To be"}])
    result = invoke("run", prompts, "--model", path, "--quiet")
    assert result.exit_code == 2 and result.stderr.splitlines() == [f"error: {message}"]


@pytest.mark.parametrize("impl", ["pagedinfer", "transformers"])
def test_a_checkpoint_missing_a_tensor_is_refused_naming_it_and_the_file(tmp_path, impl):
    path = copy_of_tiny_model(tmp_path)
    weights = path / "model.safetensors"
    tensors = load_file(str(weights))
    del tensors[MISSING]
    save_file(tensors, str(weights), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError) as raised:
        LLM(str(path), device="cpu", model_impl=impl)
    assert str(raised.value) == f"{weights}: the weights have no tensor {MISSING!r}, which the config implies"


def test_a_complete_tied_checkpoint_loads_through_both_implementations():
    """The check counts only tensors that are truly absent: a tied lm_head (no tensor of its own) loads."""
    for impl in ("pagedinfer", "transformers"):
        assert LLM(str(tiny_model()), device="cpu", model_impl=impl).engine.loaded.impl == impl
