"""Qwen3: Llama's layer with a per-head RMSNorm of q and k before RoPE."""

from pagedinfer.model.families.llama import LAYER, LINEARS, NORMS
from pagedinfer.model.families.qwen2 import CONFIG_DEFAULTS as QWEN2_DEFAULTS
from pagedinfer.model.families.spec import Family, Module

QWEN3 = Family(
    model_types=("qwen3",),
    gguf_arch="qwen3",
    layer=(
        *LAYER[:4],
        Module("self_attn.q_norm", "attn_q_norm", ("head_dim",)),
        Module("self_attn.k_norm", "attn_k_norm", ("head_dim",)),
        *LAYER[4:],
    ),
    linears=LINEARS,
    norms={**NORMS, "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"},
    config_defaults=dict(QWEN2_DEFAULTS, head_dim=128, attention_bias=False),  # Qwen3Config's
)
