"""OLMoE: Llama's attention with an RMSNorm over all of q's rows and all of k's (not per head), then
RoPE (a clip of q, k and v where the config sets clip_qkv), and a mixture of experts in every layer
(qwen3_moe's modules, each expert intermediate_size wide): softmax router, top-k, renormalised where norm_topk_prob says so."""

from dataclasses import replace

from pagedinfer.model.families.llama import LAYER, LINEARS, NORMS
from pagedinfer.model.families.qwen3_moe import EXPERT_MLP, MLP_EXPERTS, MOE_SIZE_KEYS
from pagedinfer.model.families.spec import Family, Module

OLMOE = Family(
    model_types=("olmoe",),
    gguf_arch="olmoe",
    layer=(
        *LAYER[:4],
        Module("self_attn.q_norm", "attn_q_norm", ("q",)),
        Module("self_attn.k_norm", "attn_k_norm", ("kv",)),
        *LAYER[7:],
        EXPERT_MLP[0],
        *(
            replace(m, shape=tuple("inter" if d == "expert_inter" else d for d in m.shape))
            for m in EXPERT_MLP[1:]
        ),
    ),
    linears={"qkv": LINEARS["qkv"], "o": LINEARS["o"]},
    norms={**NORMS, "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"},
    experts=MLP_EXPERTS,
    qk_norm_over="all",
    gguf_size_keys=MOE_SIZE_KEYS,
    gguf_read_as="llama",
)
