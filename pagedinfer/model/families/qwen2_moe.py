"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q, k and v biased where the config's
qkv_bias says, as it does by default) and Qwen3-MoE's experts and dense layers (softmax router, top-k,
renormalised where norm_topk_prob says: by default not, nor in llama.cpp's qwen2moe), with a shared
expert beside the routed ones in every sparse layer: a gated MLP of shared_expert_intermediate_size
that every token runs, scaled by the sigmoid of its gate's one logit (llama.cpp stores that gate's one
row as a vector)."""

from dataclasses import replace

from pagedinfer.model.families.llama import LAYER, LINEARS, NORMS, QKV
from pagedinfer.model.families.qwen3_moe import DENSE_MLP, EXPERT_MLP, MLP_EXPERTS, QWEN3_MOE
from pagedinfer.model.families.spec import Family, Module, Need, SharedExpert

SHARED_MLP = (
    Module("mlp.shared_expert.gate_proj", "ffn_gate_shexp", ("shared_inter", "hidden")),
    Module("mlp.shared_expert.up_proj", "ffn_up_shexp", ("shared_inter", "hidden")),
    Module("mlp.shared_expert.down_proj", "ffn_down_shexp", ("hidden", "shared_inter")),
    Module("mlp.shared_expert_gate", "ffn_gate_inp_shexp", ("one", "hidden"), gguf_vector=True),
)

QWEN2_MOE = Family(
    model_types=("qwen2_moe",),
    gguf_arch="qwen2moe",
    layer=(
        *(replace(m, bias=Need.OPTIONAL if m.hf in QKV else Need.ABSENT) for m in LAYER[:4]),
        *LAYER[7:],
        *DENSE_MLP,
        *EXPERT_MLP,
        *SHARED_MLP,
    ),
    linears=LINEARS,
    norms=NORMS,
    experts=replace(
        MLP_EXPERTS,
        shared=SharedExpert(
            gate_up=("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),
            down="mlp.shared_expert.down_proj",
            gate="mlp.shared_expert_gate",
        ),
        dense_layers=True,
    ),
    gguf_size_keys=(*QWEN3_MOE.gguf_size_keys, "expert_shared_feed_forward_length"),
    gguf_config_keys={
        **QWEN3_MOE.gguf_config_keys,
        "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
    },
    gguf_config_fixed={"norm_topk_prob": False},
)
