"""Phi-3 (Phi-3, Phi-3.5, Phi-4-mini): Llama's layer with q, k and v fused in one checkpoint module
(rows q, k, v) and gate and up in another (rows gate, up): each fills our fused linear as it is. Its
RoPE (LongRoPE's short and long factors included) comes from the config like every family's; a
partial rotary factor is a kind our layers lack (`llama.unsupported_reason`). A GGUF file with
LongRoPE factors (llama.cpp's rope_factors_long / _short tensors) is refused: the config transformers'
GGUF reader makes of it has no LongRoPE."""

from pagedinfer.model.families.llama import NORMS
from pagedinfer.model.families.spec import Family, Module

PHI3 = Family(
    model_types=("phi3",),
    gguf_arch="phi3",
    layer=(
        Module("self_attn.qkv_proj", "attn_qkv", ("qkv", "hidden")),
        Module("self_attn.o_proj", "attn_output", ("hidden", "q")),
        Module("mlp.gate_up_proj", "ffn_up", ("gate_up", "hidden")),  # llama.cpp's name for the fused pair
        Module("mlp.down_proj", "ffn_down", ("hidden", "inter")),
        Module("input_layernorm", "attn_norm", ("hidden",)),
        Module("post_attention_layernorm", "ffn_norm", ("hidden",)),
    ),
    linears={
        "qkv": ("self_attn.qkv_proj",),
        "o": ("self_attn.o_proj",),
        "gate_up": ("mlp.gate_up_proj",),
        "down": ("mlp.down_proj",),
    },
    norms=NORMS,
    gguf_refused_with={
        "rope_factors_long.weight": "its LongRoPE factors, which transformers' GGUF reader leaves out of "
        "the config, so the angles would be the unscaled ones",
    },
)
