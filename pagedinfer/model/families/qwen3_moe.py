"""Qwen3-MoE: Qwen3's attention (per-head q/k norms) and a mixture of experts in every layer: softmax
router, top-k, the top-k scores renormalised where the config's norm_topk_prob says so (llama.cpp's
qwen3moe always does: its GGUF files' configs say so)."""

from pagedinfer.model.families.llama import LAYER, LINEARS, NORMS
from pagedinfer.model.families.qwen3 import QWEN3
from pagedinfer.model.families.spec import GGUF_SIZE_KEYS, Experts, Family, Module

EXPERT_MLP = (  # the router, then each expert's gated MLP
    Module("mlp.gate", "ffn_gate_inp", ("experts", "hidden")),
    Module("mlp.experts.{}.gate_proj", "ffn_gate_exps", ("expert_inter", "hidden"), experts=True),
    Module("mlp.experts.{}.up_proj", "ffn_up_exps", ("expert_inter", "hidden"), experts=True),
    Module("mlp.experts.{}.down_proj", "ffn_down_exps", ("hidden", "expert_inter"), experts=True),
)
MLP_EXPERTS = Experts(
    router="mlp.gate",
    gate_up=("mlp.experts.{}.gate_proj", "mlp.experts.{}.up_proj"),
    down="mlp.experts.{}.down_proj",
    count="num_experts",
    renormalise=("norm_topk_prob", False),
)
MOE_SIZE_KEYS = (*GGUF_SIZE_KEYS, "expert_count", "expert_used_count")

QWEN3_MOE = Family(
    model_types=("qwen3_moe",),
    gguf_arch="qwen3moe",
    layer=(*QWEN3.layer[:6], *LAYER[7:], *EXPERT_MLP),
    linears={"qkv": LINEARS["qkv"], "o": LINEARS["o"]},
    norms={**NORMS, "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"},
    experts=MLP_EXPERTS,
    gguf_size_keys=(*MOE_SIZE_KEYS, "expert_feed_forward_length"),
    gguf_config_keys={"expert_feed_forward_length": "moe_intermediate_size"},
    gguf_config_fixed={"norm_topk_prob": True},
)
