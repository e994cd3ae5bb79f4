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
}


@dataclass(frozen=True)
class BuiltModel:
    path: Path
    parameters: int
    vocab_size: int


def build_model(name: str, root: Path) -> BuiltModel:
    """Save (or reuse, under ``root``) the random-weight model ``name``."""
    fields, stored = MODELS[name]
    path = root / name
    params_file = path / "bench_params.json"
    if not params_file.exists():
        import torch
        from transformers import LlamaConfig

        from pagedinfer.model.random_models import save_random_model

        config = LlamaConfig(**fields, **LLAMA_COMMON)
        params = save_random_model(config, path, seed=0, dtype=getattr(torch, stored))
        params_file.write_text(json.dumps({"parameters": params}))
    return BuiltModel(path, json.loads(params_file.read_text())["parameters"], fields["vocab_size"])
