"""Gemma 3 (its text model, gemma3_text): Llama's linears with a per-head q/k RMSNorm and norms both
before and after each branch, every norm multiplying by 1 + weight (in float32: the offset added to
the weights once, at load); a GeGLU MLP (gelu-tanh); the embeddings scaled by sqrt(hidden_size); the
attention scaled by query_pre_attn_scalar; sliding-window and global layers (the config's
layer_types), each rotating by its type's RoPE (rope_local_base_freq or rope_theta and its scaling);
a softcap on the logits where the config sets one (transformers' Gemma 3 passes no softcap to its
attention: its config's attn_logit_softcapping is left unused here too). Its llama.cpp files are refused."""

from pagedinfer.model.families.llama import LAYER, LINEARS
from pagedinfer.model.families.spec import Family, Module

GEMMA3 = Family(
    model_types=("gemma3_text",),
    gguf_arch="gemma3",
    layer=(
        *LAYER[:7],
        Module("self_attn.q_norm", "attn_q_norm", ("head_dim",)),
        Module("self_attn.k_norm", "attn_k_norm", ("head_dim",)),
        Module("input_layernorm", "attn_norm", ("hidden",)),
        Module("post_attention_layernorm", "post_attention_norm", ("hidden",)),
        Module("pre_feedforward_layernorm", "ffn_norm", ("hidden",)),
        Module("post_feedforward_layernorm", "post_ffw_norm", ("hidden",)),
    ),
    linears=LINEARS,
    norms={
        "input_norm": "input_layernorm",
        "attn_out_norm": "post_attention_layernorm",
        "post_norm": "pre_feedforward_layernorm",
        "mlp_out_norm": "post_feedforward_layernorm",
        "q_norm": "self_attn.q_norm",
        "k_norm": "self_attn.k_norm",
    },
    norm_placement="both",
    activation=("hidden_activation", "gelu_pytorch_tanh"),
    norm_weight_offset=1.0,
    embedding_scaled=True,
    query_scale="query_pre_attn_scalar",
    logits_softcap="final_logit_softcapping",
    rope_by_layer_type=True,
    gguf_refused="llama.cpp's files hold each norm's weight with 1 added and the windows' pattern, "
    "which its reader does not take back",
)
