"""Qwen3-MoE: Qwen3's attention (per-head q/k norms) and a mixture of experts in the layers its
config makes sparse (every layer unless mlp_only_layers or decoder_sparse_step say otherwise; the
others a dense Llama MLP of intermediate_size): softmax router, top-k, the top-k scores renormalised
where the config's norm_topk_prob says so (llama.cpp's qwen3moe always does: its GGUF files' configs
say so)."""

from dataclasses import replace

from pagedinfer.model.families.llama import LAYER, LINEARS, NORMS
from pagedinfer.model.families.qwen3 import QWEN3
from pagedinfer.model.families.spec import GGUF_SIZE_KEYS, Experts, Family, Module, Need

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
# the MLP of the layers mlp_only_layers / decoder_sparse_step make dense: Llama's, unbiased (the
# family's gate_up and down linears, `LINEARS`)
DENSE_MLP = tuple(replace(m, bias=Need.ABSENT) for m in LAYER[4:7])

QWEN3_MOE = Family(
    model_types=("qwen3_moe",),
    gguf_arch="qwen3moe",
    layer=(*QWEN3.layer[:6], *LAYER[7:], *DENSE_MLP, *EXPERT_MLP),
    linears=LINEARS,
    norms={**NORMS, "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"},
    experts=replace(MLP_EXPERTS, dense_layers=True),
    gguf_size_keys=(*MOE_SIZE_KEYS, "expert_feed_forward_length"),
    gguf_config_keys={"expert_feed_forward_length": "moe_intermediate_size"},
    gguf_config_fixed={"norm_topk_prob": True},
)
