"""Mistral: Llama's layer (a sliding window from its config); its GGUF files are llama's, Q/K permuted."""

from dataclasses import replace

from pagedinfer.model.families.llama import LLAMA

MISTRAL = replace(LLAMA, model_types=("mistral",))
