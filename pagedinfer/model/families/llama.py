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
# LlamaConfig's defaults of the fields our layers, the validation and the loader read
CONFIG_DEFAULTS = dict(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=None,
    head_dim=None,
    hidden_act="silu",
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    pad_token_id=None,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
    attention_bias=False,
    mlp_bias=False,
)

LLAMA = Family(
    model_types=("llama",),
    gguf_arch="llama",
    layer=LAYER,
    linears=LINEARS,
    norms=NORMS,
    gguf_permuted={"self_attn.q_proj": "heads", "self_attn.k_proj": "kv_heads"},
    config_defaults=CONFIG_DEFAULTS,
    keeps_declared_tokenizer=True,
)
