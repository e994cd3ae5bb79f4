"""`own_config` gives transformers' values for the configs it takes, and leaves the others to transformers:
each field of every family's tiny config, its variants (windows, an old rope_theta, bare files with the
class defaults) and the demo model read both ways; the generation config derived from each; the same
tokenizer loaded; and the files it must not take (another family, an unknown key, a wrong type, RoPE
scaling, sizes transformers refuses) give None."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import fields
from pathlib import Path

import pytest
from models import CONFIGS
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from pagedinfer.model import own_config
from pagedinfer.model.families import FAMILIES
from pagedinfer.model.loader import DEMO_MODEL

COMPARED = [f.name for f in fields(own_config.OwnConfig) if f.name not in ("raw", "dtype")]
BARE = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 3, "vocab_size": 100}
VARIANTS = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "mistral": {},
    "qwen2-window": {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
    "qwen3-window": {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
    "mistral-no-head-dim": {"head_dim": None},
}


def saved(tmp_path: Path, name: str, doc: dict) -> Path:
    (tmp_path / name).mkdir()
    (tmp_path / name / "config.json").write_text(json.dumps(doc))
    return tmp_path / name


def same_as_transformers(folder: Path) -> None:
    ours, theirs = own_config.read(folder), AutoConfig.from_pretrained(folder)
    assert ours is not None
    for name in COMPARED:
        mine, hf = getattr(ours, name), getattr(theirs, name, None)
        assert (mine, type(mine)) == (hf, type(hf)), name
    assert str(ours.dtype) == str(theirs.dtype).removeprefix("torch.") if ours.dtype else theirs.dtype is None
    derived = GenerationConfig.from_model_config(ours).to_dict()
    assert derived == GenerationConfig.from_model_config(theirs).to_dict()


@pytest.mark.parametrize("variant", VARIANTS)
def test_family_configs_read_as_transformers_reads_them(tmp_path, variant):
    config = CONFIGS[variant.split("-")[0]]()
    for key, value in VARIANTS[variant].items():
        setattr(config, key, value)
    config.save_pretrained(tmp_path)
    same_as_transformers(tmp_path)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_each_familys_declared_defaults_are_its_transformers_class_defaults(family):
    """The registry's `config_defaults` are the class's own declared defaults, field for field; a family
    declaring none (the mixtures of experts) is not read here."""
    declared = {f.name: f.default for f in dataclasses.fields(type(AutoConfig.for_model(family.name)))}
    assert {k: declared.get(k, "not a field") for k in family.config_defaults} == family.config_defaults
    assert (family.name in own_config.DEFAULTS) == bool(family.config_defaults)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_bare_files_take_the_class_defaults(tmp_path, family):
    extra = {"rope_theta": 5e5, "torch_dtype": "bfloat16", "eos_token_id": [3, 4]}
    same_as_transformers(saved(tmp_path, family, {"model_type": family, **BARE, **extra}))


def test_the_demo_model_and_its_tokenizer(tmp_path):
    same_as_transformers(DEMO_MODEL)
    ours = own_config.tokenizer_loader(DEMO_MODEL, own_config.read(DEMO_MODEL))(DEMO_MODEL)
    theirs = AutoTokenizer.from_pretrained(DEMO_MODEL)
    assert type(ours) is type(theirs)
    chat = [{"role": "user", "content": "Good morrow"}]
    assert ours.apply_chat_template(chat, tokenize=False) == theirs.apply_chat_template(chat, tokenize=False)
    ids = theirs.encode("ROMEO: O Juliet!")
    assert ours.encode("ROMEO: O Juliet!") == ids
    assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.special_tokens_map == theirs.special_tokens_map


@pytest.mark.parametrize(
    "doc",
    [
        {"model_type": "gemma2", **BARE},
        {"model_type": "qwen3_moe", **BARE},
        {"model_type": "llama", **BARE, "some_new_switch": 1},
        {"model_type": "llama", **BARE, "hidden_size": 64.0},
        {"model_type": "llama", **BARE, "num_hidden_layers": True},
        {"model_type": "llama", **BARE, "rms_norm_eps": "1e-6"},
        {"model_type": "llama", **BARE, "hidden_size": 66},
        {"model_type": "llama", **BARE, "num_attention_heads": 0},
        {"model_type": "llama", **BARE, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        {"model_type": "llama", **BARE, "rope_parameters": {"rope_type": "llama3", "factor": 8.0}},
        {"model_type": "llama", **BARE, "sliding_window": 8},
        {"model_type": "qwen2", **BARE, "layer_types": ["full_attention"]},
        {"model_type": "llama", **BARE, "dtype": "float32", "torch_dtype": "float32"},
        [1, 2],
    ],
    ids=[
        "family",
        "family-without-defaults",
        "unknown-key",
        "float-size",
        "bool-size",
        "string-eps",
        "heads-do-not-divide",
        "no-heads",
        "rope-scaling",
        "llama3-rope",
        "field-of-another-family",
        "layer-types-length",
        "two-dtypes",
        "not-an-object",
    ],
)
def test_what_it_does_not_take_is_left_to_transformers(tmp_path, doc):
    (tmp_path / "config.json").write_text(json.dumps(doc))
    assert own_config.read(tmp_path) is None


def test_no_file_or_broken_json_is_left_to_transformers(tmp_path):
    assert own_config.read(tmp_path) is None
    (tmp_path / "config.json").write_text('{"model_type": "llama",')
    assert own_config.read(tmp_path) is None


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3"])
def test_each_family_gets_the_tokenizer_class_transformers_chooses(tmp_path, family):
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (tmp_path / name).write_bytes((DEMO_MODEL / name).read_bytes())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": family, **BARE}))
    ours = own_config.tokenizer_loader(tmp_path, own_config.read(tmp_path))(tmp_path)
    theirs = AutoTokenizer.from_pretrained(tmp_path)
    assert type(ours) is type(theirs)  # Qwen2Tokenizer for qwen2: transformers overrides its files' class
    assert ours.encode("ROMEO: O Juliet!") == theirs.encode("ROMEO: O Juliet!")
