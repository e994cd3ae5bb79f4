"""Mistral: Llama's layer (a sliding window from its config); its GGUF files are llama's, Q/K permuted."""

from dataclasses import replace

from pagedinfer.model.families.llama import CONFIG_DEFAULTS, LLAMA

MISTRAL = replace(
    LLAMA,
    model_types=("mistral",),
    config_defaults=dict(  # MistralConfig's: no bias switches
        {k: v for k, v in CONFIG_DEFAULTS.items() if k not in ("attention_bias", "mlp_bias")},
        intermediate_size=14336,
        num_key_value_heads=8,
        max_position_embeddings=4096 * 32,
        sliding_window=4096,
    ),
)
