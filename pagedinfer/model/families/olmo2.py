"""OLMo-2: Llama's linears with its norms after each branch (the attention's output and the MLP's, each
normed before its residual add; no norm on a branch's input) and an RMSNorm over all of q's rows and
all of k's (OLMoE's) before RoPE.

Its llama.cpp files (architecture "olmo2") hold llama's keys and Q and K rows as the checkpoint has
them (its converter permutes none: llama.cpp rotates them NEOX-style); transformers' GGUF reader maps
no olmo2 config, so the file is read through llama's keys (`spec.Family.gguf_read_as`). The same
architecture holds OLMo 3's files, with windowed layers and YaRN: `gguf_config` refuses those."""

from pagedinfer.model.families.llama import LAYER, LINEARS
from pagedinfer.model.families.spec import Family, Module


def gguf_config(metadata: dict[str, object], arch: str) -> dict[str, object]:
    """No field beyond llama's keys; ValueError names a key of OLMo 3's (windows, RoPE scaling) that
    llama.cpp reads and our OLMo-2 layers would leave out."""
    for key in ("attention.sliding_window", "rope.scaling.type"):
        value = metadata.get(f"{arch}.{key}")
        if value is not None and value != "none":
            raise ValueError(
                f"metadata {arch}.{key} is {value!r}; pagedinfer reads olmo2 files without windows or "
                "RoPE scaling (OLMo 3's)"
            )
    return {}


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
    gguf_read_as="llama",
    gguf_config=gguf_config,
)
