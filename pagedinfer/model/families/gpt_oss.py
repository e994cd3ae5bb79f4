"""gpt-oss: Llama's attention with q, k, v and o biases (the config's attention_bias) and a learned
sink logit per query head (mass the softmax gives to no key), windowed and global layers by the
config's layer_types, YaRN RoPE; a mixture of experts in every layer: a biased router whose top-k
logits are softmaxed (the same weights as a softmax over every expert renormalised over the k), each
expert's gate and up rows interleaved in one stacked tensor with biases, its clamped SwiGLU, and a
biased down. Its llama.cpp files hold each expert's gate, up and down apart (llama.cpp's converter
splits the interleaved gate-up), their biases likewise, the experts in MXFP4 as published: read as
`GPT_OSS.gguf_layout` declares them, the blocks kept as stored."""

from dataclasses import replace

from pagedinfer.model.families.llama import LAYER, LINEARS, NORMS
from pagedinfer.model.families.qwen3_moe import MOE_SIZE_KEYS
from pagedinfer.model.families.spec import ClampedSwiGLU, Experts, Family, Module, Need


def gguf_config(metadata: dict[str, object], arch: str) -> dict[str, object]:
    """The RoPE of a gpt-oss file: its base, and YaRN's factor and original context from llama.cpp's
    keys where the file has them (transformers' GGUF reader misreads them: it takes a field's first
    part, the key's length, for its value), YaRN's other constants gpt-oss's own (beta 32 and 1, no
    truncation); else the plain RoPE of its base."""
    base = float(metadata.get(f"{arch}.rope.freq_base", 150_000.0))
    scaling = metadata.get(f"{arch}.rope.scaling.type")
    if scaling is None:
        return {"rope_parameters": {"rope_type": "default", "rope_theta": base}}
    if scaling != "yarn":
        raise ValueError(f"metadata {arch}.rope.scaling.type is {scaling!r}; gpt-oss's RoPE is YaRN")
    yarn = {
        "factor": "rope.scaling.factor",
        "original_max_position_embeddings": "rope.scaling.original_context_length",
    }
    missing = [key for key in yarn.values() if f"{arch}.{key}" not in metadata]
    if missing:
        raise ValueError(f"metadata {arch}.{missing[0]} is missing; a YaRN RoPE gives it")
    fields = {name: metadata[f"{arch}.{key}"] for name, key in yarn.items()}
    return {
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": base,
            "factor": float(fields["factor"]),
            "original_max_position_embeddings": int(fields["original_max_position_embeddings"]),
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        }
    }


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
    # what transformers' GGUF reader leaves out: the head size (not hidden / heads in gpt-oss-20b) and
    # the window (llama.cpp's key is under "attention."); the SwiGLU's constants are llama.cpp's own
    gguf_config_keys={"attention.key_length": "head_dim", "attention.sliding_window": "sliding_window"},
    gguf_config_fixed={"swiglu_alpha": 1.702, "swiglu_limit": 7.0},
    gguf_config=gguf_config,
    gguf_unread=("rope.scaling.",),
)


EXPERT = dict(experts=True, bias=Need.REQUIRED)  # "{}": the expert's index in the 3-D "*_exps" tensors
GPT_OSS = replace(
    GPT_OSS,
    gguf_layout=replace(
        GPT_OSS,
        layer=(
            *GPT_OSS.layer[:8],  # attention, sinks, norms, router: as named in its checkpoints
            Module("mlp.experts.{}.gate_proj", "ffn_gate_exps", ("inter", "hidden"), **EXPERT),
            Module("mlp.experts.{}.up_proj", "ffn_up_exps", ("inter", "hidden"), **EXPERT),
            Module("mlp.experts.{}.down_proj", "ffn_down_exps", ("hidden", "inter"), **EXPERT),
        ),
        experts=replace(
            GPT_OSS.experts,
            gate_up=("mlp.experts.{}.gate_proj", "mlp.experts.{}.up_proj"),
            down="mlp.experts.{}.down_proj",
            interleaved=False,
        ),
    ),
)
