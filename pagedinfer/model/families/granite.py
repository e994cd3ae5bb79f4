"""Granite: Llama's layer with its four multipliers (`spec.Multipliers`): the embeddings scaled, the
attention's scale from the config, each branch scaled before its residual add, the logits divided.

Its llama.cpp files (architecture "granite") are llama's, Q and K rows permuted as llama's (its
converter is llama's), with the multipliers under llama.cpp's names, each required as llama.cpp
requires it: attention.scale, embedding_scale, residual_scale, logit_scale. transformers' GGUF reader
maps no granite config, so the file is read through llama's keys (`spec.Family.gguf_read_as`) and
the multipliers added."""

from dataclasses import replace

from pagedinfer.model.families.llama import LLAMA
from pagedinfer.model.families.spec import GGUF_FLOAT_KEYS, Multipliers

MULTIPLIERS = Multipliers()
GGUF_MULTIPLIERS = {  # llama.cpp's key (after "granite.") -> the config field
    "attention.scale": MULTIPLIERS.attention,
    "embedding_scale": MULTIPLIERS.embedding,
    "residual_scale": MULTIPLIERS.residual,
    "logit_scale": MULTIPLIERS.logits,
}

GRANITE = replace(
    LLAMA,
    model_types=("granite",),
    gguf_arch="granite",
    multipliers=MULTIPLIERS,
    gguf_read_as="llama",
    gguf_config_keys=GGUF_MULTIPLIERS,
    gguf_float_keys=(*GGUF_FLOAT_KEYS, *GGUF_MULTIPLIERS),
    config_defaults={},  # transformers' GraniteConfig reads its files (not Llama's defaults)
    keeps_declared_tokenizer=False,
)
