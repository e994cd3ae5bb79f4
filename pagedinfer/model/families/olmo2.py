"""OLMo-2: Llama's linears with its norms after each branch (the attention's output and the MLP's, each
normed before its residual add; no norm on a branch's input) and an RMSNorm over all of q's rows and
all of k's (OLMoE's) before RoPE. transformers' GGUF reader maps no olmo2 config: its files are refused."""

from pagedinfer.model.families.llama import LAYER, LINEARS
from pagedinfer.model.families.spec import Family, Module

OLMO2 = Family(
    model_types=("olmo2",),
    gguf_arch="olmo2",
    layer=(
        *LAYER[:4],
        Module("self_attn.q_norm", "attn_q_norm", ("q",)),
        Module("self_attn.k_norm", "attn_k_norm", ("kv",)),
        *LAYER[4:7],
        Module("post_attention_layernorm", "post_attention_norm", ("hidden",)),
        Module("post_feedforward_layernorm", "post_ffw_norm", ("hidden",)),
    ),
    linears=LINEARS,
    norms={
        "attn_out_norm": "post_attention_layernorm",
        "mlp_out_norm": "post_feedforward_layernorm",
        "q_norm": "self_attn.q_norm",
        "k_norm": "self_attn.k_norm",
    },
    qk_norm_over="all",
    norm_placement="post",
    gguf_refused="transformers' GGUF reader maps no olmo2 config",
)
