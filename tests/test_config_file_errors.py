"""A hostile config.json of a family our layers serve is refused by `pagedinfer run` in one line naming
the file, the field and what it must be (never transformers' words, a division by zero, a traceback or
an allocation the size of the value), the output left empty; sizes too large for the weights are
refused against the weights' shapes (our layers) or their files' bytes (transformers' layers), before
anything of that size is built."""

from __future__ import annotations

import json
import math
import shutil

import pytest
from cli_helpers import invoke, one_line_error, read_jsonl, write_jsonl

HUGE = 10**12
INTEGER = "a positive integer"
NULLABLE = "a positive integer or null"
SIZES = [  # (field, what it must be): the sizes of every family's file
    ("hidden_size", INTEGER),
    ("intermediate_size", INTEGER),
    ("num_hidden_layers", INTEGER),
    ("num_attention_heads", INTEGER),
    ("vocab_size", INTEGER),
    ("max_position_embeddings", INTEGER),
    ("num_key_value_heads", NULLABLE),
    ("head_dim", NULLABLE),
    ("sliding_window", NULLABLE),
]
EXPERT_SIZES = ["num_local_experts", "num_experts_per_tok", "moe_intermediate_size"]
NOT_POSITIVE_INTEGERS = {
    "0": 0,
    "negative": -1,
    "string": "8",
    "float": 8.0,
    "nan": math.nan,
    "inf": math.inf,
}
SHOWN = {
    "0": "0",
    "negative": "-1",
    "string": '"8"',
    "float": "8.0",
    "nan": "NaN",
    "inf": "Infinity",
    "null": "null",
}

CASES = [  # (id, family, config.json changes, the message after "<folder>/config.json: ")
    *(
        (f"{key}-{kind}", "llama", {key: value}, f"{key} is {SHOWN[kind]}; it must be {expected}")
        for key, expected in SIZES
        for kind, value in NOT_POSITIVE_INTEGERS.items()
    ),
    *(
        (f"{key}-null", "llama", {key: None}, f"{key} is null; it must be {INTEGER}")
        for key, expected in SIZES
        if expected == INTEGER
    ),
    *(
        (f"{key}-{kind}", "qwen3_moe", {key: value}, f"{key} is {SHOWN[kind]}; it must be {INTEGER}")
        for key in EXPERT_SIZES
        for kind, value in [*NOT_POSITIVE_INTEGERS.items(), ("null", None)]
    ),
    *(  # which layers are sparse divides by decoder_sparse_step (transformers' class takes a 0)
        (f"{key}-{kind}", family, {key: value}, f"{key} is {SHOWN[kind]}; it must be {INTEGER}")
        for key, family in (
            ("decoder_sparse_step", "qwen3_moe"),
            ("shared_expert_intermediate_size", "qwen2_moe"),
        )
        for kind, value in (("0", 0), ("negative", -1), ("null", None))
    ),
    *(
        (
            f"rms_norm_eps-{kind}",
            "llama",
            {"rms_norm_eps": value},
            f"rms_norm_eps is {shown}; it must be a finite number >= 0",
        )
        for kind, value, shown in [
            ("negative", -1e-6, "-1e-06"),
            ("string", "1e-6", '"1e-6"'),
            ("null", None, "null"),
            ("nan", math.nan, "NaN"),
            ("inf", math.inf, "Infinity"),
        ]
    ),
    *(
        (
            f"rope_theta-{kind}",
            "llama",
            {"rope_parameters": None, "rope_theta": value},
            f"rope_theta is {shown}; it must be a finite positive number",
        )
        for kind, value, shown in [
            ("0", 0, "0"),
            ("string", "1e4", '"1e4"'),
            ("null", None, "null"),
            ("inf", math.inf, "Infinity"),
        ]
    ),
    *(  # gpt-oss's clamped SwiGLU's constants
        (f"{key}-{kind}", "gpt_oss", {key: value}, f"{key} is {shown}; it must be a finite positive number")
        for key in ("swiglu_limit", "swiglu_alpha")
        for kind, value, shown in [
            ("0", 0, "0"),
            ("string", "7", '"7"'),
            ("null", None, "null"),
            ("nan", math.nan, "NaN"),
        ]
    ),
    (
        "rope_parameters-theta-nan",
        "llama",
        {"rope_parameters": {"rope_type": "default", "rope_theta": math.nan}},
        "rope_parameters.rope_theta is NaN; it must be a finite positive number",
    ),
    (
        "rope_parameters-string",
        "llama",
        {"rope_parameters": "default"},
        'rope_parameters is "default"; it must be an object (rope_type, rope_theta, ...) or null',
    ),
    *(
        (
            f"tie_word_embeddings-{kind}",
            "llama",
            {"tie_word_embeddings": value},
            f"tie_word_embeddings is {shown}; it must be true or false",
        )
        for kind, value, shown in [("0", 0, "0"), ("string", "true", '"true"'), ("null", None, "null")]
    ),
    (
        "kv-heads-do-not-divide-heads",
        "llama",
        {"num_key_value_heads": 3},
        "num_attention_heads (4) is not a multiple of num_key_value_heads (3)",
    ),
    (
        "heads-do-not-divide-hidden",
        "llama",
        {"num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": None},
        "hidden_size (64) is not a multiple of num_attention_heads (3), and no head_dim is set",
    ),
    (
        "more-experts-per-token-than-experts",
        "qwen3_moe",
        {"num_experts_per_tok": 9},
        "num_experts_per_tok (9) is more than num_local_experts (8)",
    ),
]
# sizes too large for the weights: refused by the first tensor they size, in the weights' file
TOO_LARGE = [  # (id, family, changes, the message after "<folder>/model.safetensors: ")
    (
        "hidden_size",
        "llama",
        {"hidden_size": HUGE, "head_dim": 16},
        "tensor 'model.embed_tokens.weight' has shape [256, 64]; the config expects [256, 1,000,000,000,000]",
    ),
    (
        "intermediate_size",
        "llama",
        {"intermediate_size": HUGE},
        "tensor 'model.layers.0.mlp.gate_proj.weight' has shape [128, 64]; the config expects "
        "[1,000,000,000,000, 64]",
    ),
    (
        "vocab_size",
        "llama",
        {"vocab_size": HUGE},
        "tensor 'model.embed_tokens.weight' has shape [256, 64]; the config expects [1,000,000,000,000, 64]",
    ),
    (
        "head_dim",
        "llama",
        {"head_dim": HUGE},
        "tensor 'model.layers.0.self_attn.q_proj.weight' has shape [64, 64]; the config expects "
        "[4,000,000,000,000, 64]",
    ),
    (
        "num_hidden_layers",
        "llama",
        {"num_hidden_layers": HUGE},
        "the weights have no tensor 'model.layers.2.self_attn.q_proj.weight', which the config implies",
    ),
    (
        "moe_intermediate_size",
        "qwen3_moe",
        {"moe_intermediate_size": HUGE},
        "tensor 'model.layers.0.mlp.experts.0.gate_proj.weight' has shape [32, 64]; the config expects "
        "[1,000,000,000,000, 64]",
    ),
]


def refused(tiny_model, tmp_path, family: str, changes: dict, file: str, message: str, *args: str) -> None:
    """A copy of the tiny ``family`` model with ``changes`` in its config.json: its run (``args`` added)
    exits 2 with one line, ``<copy>/<file>: message``, and writes no record."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_model(family), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt_token_ids": [3, 4], "max_tokens": 2}])
    out = tmp_path / "out.jsonl"
    result = invoke("run", prompts, "-o", out, "-q", "--device", "cpu", "--model", folder, *args)
    one_line_error(result, f"error: {folder / file}: {message}")
    assert "Traceback" not in result.output
    assert not out.exists() or read_jsonl(out) == []  # nothing marked done


@pytest.mark.parametrize(("family", "changes", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_hostile_config_value_is_one_line_naming_the_file_and_field(
    tiny_model, tmp_path, family, changes, message
):
    refused(tiny_model, tmp_path, family, changes, "config.json", message)


@pytest.mark.parametrize(
    ("family", "changes", "message"), [c[1:] for c in TOO_LARGE], ids=[c[0] for c in TOO_LARGE]
)
def test_a_size_too_large_for_the_weights_is_refused_against_them(
    tiny_model, tmp_path, family, changes, message
):
    refused(tiny_model, tmp_path, family, changes, "model.safetensors", message)


@pytest.mark.parametrize(("family", "changes"), [c[1:3] for c in TOO_LARGE], ids=[c[0] for c in TOO_LARGE])
def test_transformers_layers_are_not_built_from_sizes_the_weights_cannot_hold(
    tiny_model, tmp_path, family, changes
):
    """transformers allocates every tensor its config sizes before reading a weight: the sizes are
    weighed against the weight files' bytes first, the largest named."""
    key = next(k for k, v in changes.items() if v == HUGE)
    message = f"the config's {key} ({HUGE:,}) with its other sizes needs at least"
    refused(
        tiny_model, tmp_path, family, changes, "model.safetensors", message, "--model-impl", "transformers"
    )


@pytest.mark.parametrize(
    "changes",
    [
        {"max_position_embeddings": HUGE},
        {"rope_parameters": None, "rope_theta": 1e12},
        {"sliding_window": HUGE},
    ],
    ids=["positions", "rope-theta", "window"],
)
def test_large_but_valid_settings_run(tiny_model, tmp_path, changes):
    """Values of the right type and range that size nothing the weights hold run as given."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_model("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt_token_ids": [3, 4], "max_tokens": 2}])
    out = tmp_path / "out.jsonl"
    result = invoke("run", prompts, "-o", out, "-q", "--device", "cpu", "--model", folder)
    assert result.exit_code == 0, result.output
    [record] = read_jsonl(out)
    assert record["error"] is None and len(record["outputs"][0]["token_ids"]) == 2
