"""gpt-oss: Llama's attention with q, k, v and o biases (the config's attention_bias) and a learned
sink logit per query head (mass the softmax gives to no key), windowed and global layers by the
config's layer_types, YaRN RoPE; a mixture of experts in every layer: a biased router whose top-k
logits are softmaxed (the same weights as a softmax over every expert renormalised over the k), each
expert's gate and up rows interleaved in one stacked tensor with biases, its clamped SwiGLU, and a
biased down. Its llama.cpp files (MXFP4 experts) are read by transformers' layers only."""

from pagedinfer.model.families.llama import LAYER, LINEARS, NORMS
from pagedinfer.model.families.qwen3_moe import MOE_SIZE_KEYS
from pagedinfer.model.families.spec import ClampedSwiGLU, Experts, Family, Module, Need

STACKED = dict(stacked=True, bias=Need.REQUIRED, suffixes=("", "_bias"))

GPT_OSS = Family(
    model_types=("gpt_oss",),
    gguf_arch="gpt-oss",
    layer=(
        *LAYER[:4],
        Module("self_attn.sinks", "attn_sinks", ("heads",), suffixes=("", "")),
        LAYER[7],
        Module("post_attention_layernorm", "post_attention_norm", ("hidden",)),
        Module("mlp.router", "ffn_gate_inp", ("experts", "hidden"), bias=Need.REQUIRED),
        Module("mlp.experts.gate_up_proj", "ffn_gate_up_exps", ("gate_up", "hidden"), **STACKED),
        Module("mlp.experts.down_proj", "ffn_down_exps", ("hidden", "inter"), **STACKED),
    ),
    linears={"qkv": LINEARS["qkv"], "o": LINEARS["o"]},
    norms=NORMS,
    experts=Experts(
        router="mlp.router",
        gate_up=("mlp.experts.gate_up_proj",),
        down="mlp.experts.down_proj",
        count="num_local_experts",
        interleaved=True,
        glu=ClampedSwiGLU(alpha="swiglu_alpha", limit="swiglu_limit"),
    ),
    sinks="self_attn.sinks",
    gguf_size_keys=MOE_SIZE_KEYS,
    gguf_transformers_only="llama.cpp's gpt-oss files hold the experts in MXFP4 and gate and up apart, "
    "which pagedinfer's implementation does not read (transformers' layers do, dequantized)",
)
