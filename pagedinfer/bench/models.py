"""The benchmark's random-weight Llama shapes, saved once to disk and loaded from there by every system."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

LLAMA_COMMON = dict(bos_token_id=None, eos_token_id=None, pad_token_id=0, tie_word_embeddings=True)

# name -> (LlamaConfig fields, the dtype the checkpoint is stored in)
MODELS: dict[str, tuple[dict, str]] = {
    # SmolLM-135M's shape
    "smollm135m": (
        dict(
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            vocab_size=49152,
            max_position_embeddings=2048,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
        ),
        "float32",
    ),
    # tiny: every step is overhead (Python, metadata, kernel launches), not FLOPs
    "tiny2l": (
        dict(
            hidden_size=64,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=1024,
            max_position_embeddings=2048,
        ),
        "float32",
    ),
    # Llama-3.2-1B's shape (1.24B parameters), stored in bfloat16 as the real checkpoint is, so that
    # the float32 run computes with the same (exactly widened) weights; no llama3 RoPE scaling, which
    # changes no cost at these lengths
    "llama1b": (
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            vocab_size=128256,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
        ),
        "bfloat16",
    ),
    # Llama-3.1-8B's shape (8.03B parameters, untied output head), for the GPU workloads only: built
    # with random weights on the device (load_format "dummy"), never saved
    "llama8b": (
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=128256,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            tie_word_embeddings=False,
        ),
        "bfloat16",
    ),
}


@dataclass(frozen=True)
class BuiltModel:
    path: Path
    parameters: int
    vocab_size: int
    kv_elements_per_token: int  # K and V elements one token keeps across all layers


def _head_dim(fields: dict) -> int:
    return fields.get("head_dim") or fields["hidden_size"] // fields["num_attention_heads"]


def kv_elements_per_token(fields: dict) -> int:
    return fields["num_hidden_layers"] * 2 * fields["num_key_value_heads"] * _head_dim(fields)


def llama_parameters(fields: dict) -> int:
    """A Llama's parameter count from its config fields (embedding, layers, final norm, untied head)."""
    h, d, inter = fields["hidden_size"], _head_dim(fields), fields["intermediate_size"]
    q, kv = fields["num_attention_heads"] * d, fields["num_key_value_heads"] * d
    layer = h * (2 * q + 2 * kv) + 3 * h * inter + 2 * h  # q, o, k, v; gate, up, down; two norms
    tied = {**LLAMA_COMMON, **fields}["tie_word_embeddings"]
    return fields["vocab_size"] * h * (1 if tied else 2) + fields["num_hidden_layers"] * layer + h


def build_model(name: str, root: Path, weights: bool = True) -> BuiltModel:
    """Save (or reuse, under ``root``) the random-weight model ``name``; with ``weights=False`` only
    its config (systems then draw random weights on the device: load_format "dummy")."""
    fields, stored = MODELS[name]
    path = root / (name if weights else f"{name}-config")
    params_file = path / "bench_params.json"
    if not params_file.exists():
        import torch
        from transformers import LlamaConfig

        from pagedinfer.model.random_models import save_random_model

        config = LlamaConfig(**{**LLAMA_COMMON, **fields})
        if weights:
            params = save_random_model(config, path, seed=0, dtype=getattr(torch, stored))
        else:
            config.save_pretrained(path)
            params = llama_parameters(fields)
        params_file.write_text(json.dumps({"parameters": params}))
    params = json.loads(params_file.read_text())["parameters"]
    return BuiltModel(path, params, fields["vocab_size"], kv_elements_per_token(fields))
