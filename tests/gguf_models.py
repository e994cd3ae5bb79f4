"""Tiny GGUF files written with the ``gguf`` package from the random-weight test models (tests/models.py).

llama.cpp's converter is not needed for a family whose tensors transformers maps back unchanged (Qwen2:
no Q/K permutation): each tensor is stored in float32 under its GGUF name, with the config's hyper-parameters
as GGUF metadata. Token-id prompts only (no tokenizer in the file).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import transformers as tf


def save_qwen2_gguf(model_dir: Path, out: Path) -> Path:
    """The saved Qwen2 model at ``model_dir`` as a float32 GGUF file at ``out``."""
    import gguf

    model = tf.AutoModelForCausalLM.from_pretrained(model_dir)
    cfg = model.config
    arch = "qwen2"
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, cfg.num_hidden_layers)
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name("tiny-qwen2")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    for name, tensor in model.state_dict().items():
        stem, _, kind = name.rpartition(".")
        writer.add_tensor(f"{names.get_name(stem)}.{kind}", tensor.float().numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
