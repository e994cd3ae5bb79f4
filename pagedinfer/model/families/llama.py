"""Llama: the dense layer the other families here vary (its modules are theirs, with their changes)."""

from pagedinfer.model.families.spec import Family, Module, Need

OPTIONAL = Need.OPTIONAL  # a Llama's biases: present when its config's attention_bias / mlp_bias say so
QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
LAYER = (
    Module("self_attn.q_proj", "attn_q", ("q", "hidden"), bias=OPTIONAL),
    Module("self_attn.k_proj", "attn_k", ("kv", "hidden"), bias=OPTIONAL),
    Module("self_attn.v_proj", "attn_v", ("kv", "hidden"), bias=OPTIONAL),
    Module("self_attn.o_proj", "attn_output", ("hidden", "q"), bias=OPTIONAL),
    Module("mlp.gate_proj", "ffn_gate", ("inter", "hidden"), bias=OPTIONAL),
    Module("mlp.up_proj", "ffn_up", ("inter", "hidden"), bias=OPTIONAL),
    Module("mlp.down_proj", "ffn_down", ("hidden", "inter"), bias=OPTIONAL),
    Module("input_layernorm", "attn_norm", ("hidden",)),
    Module("post_attention_layernorm", "ffn_norm", ("hidden",)),
)
LINEARS = {
    "qkv": QKV,
    "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}
NORMS = {"input_norm": "input_layernorm", "post_norm": "post_attention_layernorm"}

LLAMA = Family(
    model_types=("llama",),
    gguf_arch="llama",
    layer=LAYER,
    linears=LINEARS,
    norms=NORMS,
    gguf_permuted={"self_attn.q_proj": "heads", "self_attn.k_proj": "kv_heads"},
)
