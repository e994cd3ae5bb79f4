"""Mixtral: Mistral's attention and a mixture of experts in every layer (w1 gate, w3 up, w2 down):
softmax router, top-k, the top-k scores always renormalised. Its GGUF files are llama's (Q/K permuted)
with an expert count: a "llama" file that has one is a Mixtral."""

from pagedinfer.model.families.llama import LAYER, LINEARS, NORMS
from pagedinfer.model.families.qwen3_moe import MOE_SIZE_KEYS
from pagedinfer.model.families.spec import Experts, Family, Module

MIXTRAL = Family(
    model_types=("mixtral",),
    gguf_arch="llama",
    layer=(
        *LAYER[:4],
        *LAYER[7:],
        Module("block_sparse_moe.gate", "ffn_gate_inp", ("experts", "hidden")),
        Module("block_sparse_moe.experts.{}.w1", "ffn_gate_exps", ("inter", "hidden"), experts=True),
        Module("block_sparse_moe.experts.{}.w3", "ffn_up_exps", ("inter", "hidden"), experts=True),
        Module("block_sparse_moe.experts.{}.w2", "ffn_down_exps", ("hidden", "inter"), experts=True),
    ),
    linears={"qkv": LINEARS["qkv"], "o": LINEARS["o"]},
    norms=NORMS,
    gguf_permuted={"self_attn.q_proj": "heads", "self_attn.k_proj": "kv_heads"},
    experts=Experts(
        router="block_sparse_moe.gate",
        gate_up=("block_sparse_moe.experts.{}.w1", "block_sparse_moe.experts.{}.w3"),
        down="block_sparse_moe.experts.{}.w2",
        count="num_local_experts",
    ),
    gguf_size_keys=MOE_SIZE_KEYS,
)
