"""Tiny GGUF files written with the ``gguf`` package from the random-weight test models (tests/models.py).

llama.cpp's converter is not needed: each tensor is stored under its GGUF name (Q and K rows permuted
for llama and granite, as llama.cpp's converter does and transformers' GGUF loader undoes), with the config's
hyper-parameters as GGUF metadata, in float32 or quantized: gguf-py quantizes Q8_0, Q4_0, Q4_1, Q5_0
and Q5_1; it has no quantizer for the K-quants, so `quantize_k` below writes valid Q4_K, Q5_K and
Q6_K blocks (plain min/max scales, not llama.cpp's search: the tests need their layout, not their
quality). Token-id prompts only (no tokenizer in the file).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import transformers as tf

# model_type -> llama.cpp's architecture for it (its converter writes mistral checkpoints as llama)
ARCHS = {
    "llama": "LLAMA",
    "mistral": "LLAMA",
    "qwen2": "QWEN2",
    "qwen3": "QWEN3",
    "qwen3_moe": "QWEN3MOE",
    "qwen2_moe": "QWEN2MOE",
    "mixtral": "LLAMA",  # llama.cpp's Mixtral files are llama's with an expert count
    "olmoe": "OLMOE",
    "phi3": "PHI3",
    "olmo2": "OLMO2",
    "granite": "GRANITE",  # llama's converter: Q and K permuted, the multipliers as llama.cpp's keys
    "gemma3_text": "GEMMA3",  # each norm's weight stored as 1 + weight, as llama.cpp's converter does
    "gpt_oss": "GPT_OSS",  # each expert's gate, up and down apart, as llama.cpp's converter splits them
}
PERMUTED = ("LLAMA", "GRANITE")  # the architectures whose Q and K rows llama.cpp's converter permutes
# Granite's multipliers: llama.cpp's key (after "granite.") -> the config field
GRANITE_KEYS = {
    "attention.scale": "attention_multiplier",
    "embedding_scale": "embedding_multiplier",
    "residual_scale": "residual_multiplier",
    "logit_scale": "logits_scaling",
}
EXPERTS = re.compile(r"(model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts)\.(\d+)\.(\w+)\.weight")


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row order (convert_hf_to_gguf.py's permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(*x.shape, 2)


def _scales_k4(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and minimums per block -> llama.cpp's 12 bytes (gguf-py's get_scale_min, inverted)."""
    lo = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    mlo = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    hi = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return np.concatenate([lo, mlo, hi], axis=1).astype(np.uint8)


def quantize_k(w: np.ndarray, kind: str) -> np.ndarray:
    """``[..., rows, in]`` float32 (in a multiple of 256) -> GGUF ``kind`` blocks ``[..., rows, in / 256 * size]``."""
    rows = w.shape[:-1]
    x = w.reshape(-1, 256).astype(np.float32)  # [blocks, 256]
    if kind == "Q6_K":
        sub = x.reshape(-1, 16, 16)
        step = np.abs(sub).max(axis=2) / 31  # [blocks, 16]
        d = (step.max(axis=1) / 127).astype(np.float16).astype(np.float32)  # [blocks]
        sc = np.clip(np.round(step / np.where(d > 0, d, 1)[:, None]), -128, 127).astype(np.int8)
        unit = d[:, None] * sc  # [blocks, 16]
        q = np.clip(np.round(sub / np.where(unit > 0, unit, 1)[:, :, None]), -32, 31) + 32  # 0..63
        q = q.reshape(-1, 256).astype(np.uint8)
        ql = np.zeros((len(x), 128), np.uint8)
        qh = np.zeros((len(x), 64), np.uint8)
        for h in range(2):
            for s in range(2):
                ql[:, h * 64 : h * 64 + 64] |= (q[:, h * 128 + s * 64 : h * 128 + s * 64 + 64] & 15) << (
                    4 * s
                )
            for j in range(4):
                qh[:, h * 32 : h * 32 + 32] |= (q[:, h * 128 + j * 32 : h * 128 + j * 32 + 32] >> 4) << (
                    2 * j
                )
        blocks = np.concatenate([ql, qh, sc.view(np.uint8), _f16(d)], axis=1)
        return blocks.reshape(*rows, -1)
    top = 15 if kind == "Q4_K" else 31
    sub = x.reshape(-1, 8, 32)
    lo, hi = np.minimum(sub.min(axis=2), 0), np.maximum(sub.max(axis=2), 0)  # [blocks, 8]
    step, low = (hi - lo) / top, -lo
    d = (step.max(axis=1) / 63).astype(np.float16).astype(np.float32)
    dmin = (low.max(axis=1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(step / np.where(d > 0, d, 1)[:, None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(low / np.where(dmin > 0, dmin, 1)[:, None]), 0, 63).astype(np.uint8)
    unit, off = d[:, None] * sc, dmin[:, None] * mn  # [blocks, 8]
    q = np.round((sub + off[:, :, None]) / np.where(unit > 0, unit, 1)[:, :, None])
    q = np.clip(q, 0, top).reshape(-1, 256).astype(np.uint8)
    qs = np.zeros((len(x), 128), np.uint8)
    for c in range(4):
        qs[:, c * 32 : c * 32 + 32] = (q[:, c * 64 : c * 64 + 32] & 15) | (
            (q[:, c * 64 + 32 : c * 64 + 64] & 15) << 4
        )
    parts = [_f16(d), _f16(dmin), _scales_k4(sc, mn)]
    if kind == "Q5_K":
        qh = np.zeros((len(x), 32), np.uint8)
        for i in range(8):
            qh |= (q[:, i * 32 : i * 32 + 32] >> 4) << i
        parts.append(qh)
    return np.concatenate([*parts, qs], axis=1).reshape(*rows, -1)


def config_writer(
    cfg,
    out: Path,
    name: str,
    pattern_array: bool = False,
    keys: dict[str, str | int | float | list[bool] | None] | None = None,
):
    """A ``gguf.GGUFWriter`` for ``out`` holding ``cfg``'s hyper-parameters as llama.cpp's metadata for
    its architecture (`ARCHS`), the mixture of experts', Granite's multipliers and Gemma 3's included
    (`_gemma3_keys`; ``pattern_array``: its windowed layers as one boolean per layer, else as the
    pattern's integer); ``keys``: metadata written in place of the writer's (by name after "<arch>.": a
    string, an integer, a float32, booleans; None: left out); no tensor and no tokenizer yet."""
    import gguf

    arch = getattr(gguf.MODEL_ARCH, ARCHS[cfg.model_type])
    writer = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(name)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)  # Gemma 3's: per layer type
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        if hasattr(cfg, "moe_intermediate_size"):
            writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if hasattr(cfg, "shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if cfg.model_type == "gemma3_text":
        _gemma3_keys(writer, cfg, pattern_array)
    if cfg.model_type == "gpt_oss":  # llama.cpp's converter's keys (its YaRN's type, factor, context)
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
        writer.add_sliding_window(cfg.sliding_window)
        writer.add_expert_feed_forward_length(cfg.intermediate_size)
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope["rope_type"]))
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if cfg.model_type == "granite":  # float32, as llama.cpp's converter writes them
        for key, name in GRANITE_KEYS.items():
            writer.add_float32(f"{writer.arch}.{key}", getattr(cfg, name))
    for key, value in (keys or {}).items():  # the given values stand: the writer's own dropped
        key = f"{writer.arch}.{key}"
        writer.kv_data[0].pop(key, None)
        if value is None:  # left out
            continue
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_array(key, value)
    return writer


def save_gguf(
    model_dir: Path,
    out: Path,
    kind_of: Callable[[str], str] = lambda name: "F32",
    extra: dict[str, np.ndarray] | None = None,
    pattern_array: bool = False,
    keys: dict[str, str | int | float | list[bool] | None] | None = None,
) -> Path:
    """The saved model of a family in `ARCHS`
        at ``model_dir`` as a GGUF file at ``out``: each matrix in the type ``kind_of(gguf name)`` gives (F32,
        F16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, MXFP4), 1-D tensors and biases in float32; a mixture of experts'
        per-expert weights stacked into llama.cpp's 3-D ``ffn_*_exps`` tensors [experts, rows, in];
        ``extra``: GGUF tensors added as they are (float32). A gemma3_text model is written as llama.cpp's
        converter writes it (each norm's weight plus 1, in float32), a gpt_oss one with its experts split
    (`_gpt_oss_as_llama_cpp`); ``pattern_array`` and ``keys``: as
        `config_writer`'s."""
    import gguf
    from safetensors.torch import load_file

    cfg = tf.AutoConfig.from_pretrained(model_dir)
    arch = getattr(gguf.MODEL_ARCH, ARCHS[cfg.model_type])
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    writer = config_writer(cfg, out, f"tiny-{cfg.model_type}", pattern_array, keys)
    state = {
        k: v.float().numpy()
        for f in sorted(Path(model_dir).glob("*.safetensors"))
        for k, v in load_file(f).items()
    }
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    stacked: dict[str, dict[int, np.ndarray]] = {}  # an experts' module (no index) -> each expert's
    for name in [n for n in state if EXPERTS.fullmatch(n)]:
        prefix, index, module = EXPERTS.fullmatch(name).groups()
        stacked.setdefault(f"{prefix}.{module}.weight", {})[int(index)] = state.pop(name)
    state |= {name: np.stack([ws[e] for e in sorted(ws)]) for name, ws in stacked.items()}
    if cfg.model_type == "gpt_oss":
        state = _gpt_oss_as_llama_cpp(state)
    for name, w in state.items():
        stem, _, suffix = name.rpartition(".")
        gname = f"{names.get_name(stem)}.{suffix}"
        if ARCHS[cfg.model_type] in PERMUTED and stem.endswith(("q_proj", "k_proj")):
            w = _permute(w, cfg.num_attention_heads if "q_proj" in stem else cfg.num_key_value_heads)
        if cfg.model_type == "gemma3_text" and stem.endswith("norm"):
            w = w + np.float32(1.0)
        if stem.endswith("shared_expert_gate"):  # [1, H]: llama.cpp's converter writes its row, [H]
            w = w[0]
        kind = kind_of(gname) if w.ndim >= 2 and suffix == "weight" else "F32"
        qtype = getattr(gguf.GGMLQuantizationType, kind)
        if kind == "F32":
            writer.add_tensor(gname, w)
        elif kind == "F16":
            writer.add_tensor(gname, w.astype(np.float16))
        elif kind in ("Q4_K", "Q5_K", "Q6_K"):
            writer.add_tensor(gname, quantize_k(w, kind), raw_dtype=qtype)
        else:  # a 3-D tensor expert by expert (gguf-py's MXFP4 quantizer holds 2 KiB per block)
            blocks = np.stack([gguf.quants.quantize(e, qtype) for e in w]) if w.ndim == 3 else None
            writer.add_tensor(
                gname, gguf.quants.quantize(w, qtype) if blocks is None else blocks, raw_dtype=qtype
            )
    for gname, w in (extra or {}).items():
        writer.add_tensor(gname, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _gpt_oss_as_llama_cpp(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """gpt-oss's tensors as llama.cpp's converter stores them: the stacked experts ``[E, in, rows]``
    transposed to ``[E, rows, in]``, the interleaved gate-up (columns gate, up, gate, ...) and its bias
    split into gate and up, the sinks named as a weight."""
    out = {}
    for name, w in state.items():
        stem, _, leaf = name.rpartition(".")
        if leaf == "gate_up_proj":  # [E, H, 2 I]
            out[f"{stem}.gate_proj.weight"] = np.ascontiguousarray(w[..., 0::2].transpose(0, 2, 1))
            out[f"{stem}.up_proj.weight"] = np.ascontiguousarray(w[..., 1::2].transpose(0, 2, 1))
        elif leaf == "gate_up_proj_bias":  # [E, 2 I]
            out[f"{stem}.gate_proj.bias"], out[f"{stem}.up_proj.bias"] = w[:, 0::2], w[:, 1::2]
        elif leaf == "down_proj":  # [E, I, H]
            out[f"{stem}.down_proj.weight"] = np.ascontiguousarray(w.transpose(0, 2, 1))
        elif leaf == "down_proj_bias":
            out[f"{stem}.down_proj.bias"] = w
        elif leaf == "sinks":
            out[f"{name}.weight"] = w
        else:
            out[name] = w
    return out


def _gemma3_keys(writer, cfg, pattern_array: bool) -> None:
    """Gemma 3's keys as llama.cpp's converter writes them (head size, window, softcap, the global
    layers' linear RoPE scaling), and its windowed layers: an integer n (layer i windowed where
    i % n < n - 1) where one gives the config's layer_types, else one boolean per layer."""
    import gguf

    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_sliding_window(cfg.sliding_window)
    if cfg.final_logit_softcapping:
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    full, local = cfg.rope_parameters["full_attention"], cfg.rope_parameters["sliding_attention"]
    if full.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])
    if local["rope_theta"] != 10_000.0:
        writer.add_rope_freq_base_swa(local["rope_theta"])
    windowed = [t == "sliding_attention" for t in cfg.layer_types]
    layers = len(windowed)
    n = next((n for n in range(1, layers + 1) if windowed == [i % n < n - 1 for i in range(layers)]), None)
    writer.add_sliding_window_pattern(windowed if pattern_array or n is None else n)


def save_qwen2_gguf(model_dir: Path, out: Path) -> Path:
    """The saved Qwen2 model at ``model_dir`` as a float32 GGUF file at ``out``."""
    return save_gguf(model_dir, out)
