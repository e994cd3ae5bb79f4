"""Gemma 3 (its text model, gemma3_text): Llama's linears with a per-head q/k RMSNorm and norms both
before and after each branch, every norm multiplying by 1 + weight (in float32: the offset added to
the weights once, at load); a GeGLU MLP (gelu-tanh); the embeddings scaled by sqrt(hidden_size); the
attention scaled by query_pre_attn_scalar; sliding-window and global layers (the config's
layer_types), each rotating by its type's RoPE (rope_local_base_freq or rope_theta and its scaling);
a softcap on the logits where the config sets one (transformers' Gemma 3 passes no softcap to its
attention: its config's attn_logit_softcapping is left unused here too).

Its llama.cpp files (architecture "gemma3") hold each norm's multiplier, 1 + weight, as the converter
wrote it: our layers multiply by those stored values (no offset added: `spec.Family.norm_weight_offset`).
transformers' GGUF reader maps only the plain sizes of such a file; `gguf_config` gives the rest as
llama.cpp reads it (its src/models/gemma3.cpp): the windows' pattern, the local RoPE base, the global
layers' RoPE scaling, the query scale and the logit softcap."""

from __future__ import annotations

from pagedinfer.model.families.llama import LAYER, LINEARS
from pagedinfer.model.families.spec import GGUF_FLOAT_KEYS, GGUF_SIZE_KEYS, Family, Module

PATTERN = "attention.sliding_window_pattern"
DEFAULT_PATTERN = 6  # llama.cpp's for gemma3 files without the key: five windowed layers, then a global one
LOCAL_BASE = 10_000.0  # llama.cpp's windowed layers' RoPE base where rope.freq_base_swa is absent
LAYERS_27B = 62  # llama.cpp scales the queries of this size by hidden_size / heads, the others by head_dim
BOOL = 7  # GGUF's bool value type (an array's items)


def gguf_config(metadata: dict[str, object], arch: str) -> dict[str, object]:
    """The config fields a Gemma 3 GGUF sets as llama.cpp reads it, where transformers' GGUF reader
    leaves them at its class's defaults or reads them otherwise: head_dim (key_length; else hidden /
    heads), the window (attention.sliding_window: none where absent or 0, every layer then global),
    layer_types (attention.sliding_window_pattern: layer i windowed where i % n < n - 1, every layer
    for n = 0; or one boolean per layer; default 6), rope_parameters (rope.freq_base_swa for the
    windowed layers, default 10,000; rope.freq_base and a linear rope.scaling for the global ones),
    query_pre_attn_scalar (head_dim; hidden / heads for the 62-layer size) and final_logit_softcapping.
    ValueError names a key whose value llama.cpp would read otherwise, or not at all."""

    def key(name: str, default: object = None) -> object:
        return metadata.get(f"{arch}.{name}", default)

    for name in ("block_count", "embedding_length", "attention.head_count"):
        if key(name) is None:
            raise ValueError(f"metadata {arch}.{name} is missing")
    layers, hidden, heads = key("block_count"), key("embedding_length"), key("attention.head_count")
    head_dim = key("attention.key_length", hidden // heads)
    if key("attention.value_length", head_dim) != head_dim:
        raise ValueError(
            f"metadata {arch}.attention.value_length is {key('attention.value_length')}, not key_length's "
            f"{head_dim}: pagedinfer's layers have one head size"
        )
    window = key("attention.sliding_window", 0)
    if not _is_int(window) or window < 0:
        raise ValueError(
            f"metadata {arch}.attention.sliding_window is {window!r}; it must be an integer >= 0"
        )
    windowed = _windowed(key(PATTERN, DEFAULT_PATTERN), layers, arch) if window else [False] * layers
    scaling = key("rope.scaling.type", "none")
    full = {"rope_type": "default", "rope_theta": float(key("rope.freq_base", 10_000.0))}
    if scaling == "linear":
        full = {**full, "rope_type": "linear", "factor": float(key("rope.scaling.factor", 1.0))}
    elif scaling != "none":
        raise ValueError(
            f"metadata {arch}.rope.scaling.type is {scaling!r}; pagedinfer reads Gemma 3 files with none "
            "or linear"
        )
    return {
        "head_dim": head_dim,
        "sliding_window": window or None,
        "layer_types": ["sliding_attention" if w else "full_attention" for w in windowed],
        "rope_parameters": {
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": float(key("rope.freq_base_swa", LOCAL_BASE)),
            },
            "full_attention": full,
        },
        "query_pre_attn_scalar": hidden // heads if layers == LAYERS_27B else head_dim,
        "final_logit_softcapping": key("final_logit_softcapping"),
    }


def _windowed(pattern: object, layers: int, arch: str) -> list[bool]:
    """Which layers are windowed, by llama.cpp's reading of the pattern key (see `gguf_config`)."""
    items = getattr(pattern, "items", None)  # an array (`gguf_header.ArrayValue`)
    if items is not None:
        if getattr(pattern, "item_type", None) != BOOL or len(items) != layers:
            raise ValueError(
                f"metadata {arch}.{PATTERN} is an array of {len(items):,} items; it must be one boolean "
                f"per layer ({layers:,})"
            )
        return [bool(w) for w in items]
    if not _is_int(pattern) or pattern < 0:
        raise ValueError(
            f"metadata {arch}.{PATTERN} is {pattern!r}; it must be an integer >= 0 or one boolean per layer"
        )
    return [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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
    gguf_size_keys=(*GGUF_SIZE_KEYS, "attention.key_length", "attention.value_length"),
    gguf_float_keys=(
        *GGUF_FLOAT_KEYS,
        "rope.freq_base_swa",
        "rope.scaling.factor",
        "final_logit_softcapping",
    ),
    gguf_config=gguf_config,
)
