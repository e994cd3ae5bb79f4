"""Granite: Llama's layer with its four multipliers (`spec.Multipliers`): the embeddings scaled, the
attention's scale from the config, each branch scaled before its residual add, the logits divided.
transformers' GGUF reader maps no granite config (nor these scalars): its files are refused."""

from dataclasses import replace

from pagedinfer.model.families.llama import LLAMA
from pagedinfer.model.families.spec import Multipliers

GRANITE = replace(
    LLAMA,
    model_types=("granite",),
    gguf_arch="granite",
    multipliers=Multipliers(),
    gguf_refused="transformers' GGUF reader maps no granite config",
    config_defaults={},  # transformers' GraniteConfig reads its files (not Llama's defaults)
    keeps_declared_tokenizer=False,
)
