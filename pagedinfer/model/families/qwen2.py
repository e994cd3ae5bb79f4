"""Qwen2: Llama's layer with q, k and v biases always."""

from dataclasses import replace

from pagedinfer.model.families.llama import CONFIG_DEFAULTS as LLAMA_DEFAULTS
from pagedinfer.model.families.llama import LAYER, LINEARS, NORMS, QKV
from pagedinfer.model.families.spec import Family, Need

# Qwen2Config's defaults: no head_dim field (hidden // heads) and no bias switches (q, k, v always
# biased); a window only where use_sliding_window asks, on the layers from max_window_layers on
CONFIG_DEFAULTS = dict(
    {k: v for k, v in LLAMA_DEFAULTS.items() if k not in ("head_dim", "attention_bias", "mlp_bias")},
    vocab_size=151936,
    intermediate_size=22016,
    num_key_value_heads=32,
    max_position_embeddings=32768,
    bos_token_id=None,
    eos_token_id=None,
    use_sliding_window=False,
    sliding_window=4096,
    max_window_layers=28,
    layer_types=None,
)

QWEN2 = Family(
    model_types=("qwen2",),
    gguf_arch="qwen2",
    layer=tuple(replace(m, bias=Need.REQUIRED) if m.hf in QKV else m for m in LAYER),
    linears=LINEARS,
    norms=NORMS,
    config_defaults=CONFIG_DEFAULTS,
)
