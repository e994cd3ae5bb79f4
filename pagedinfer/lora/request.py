"""`LoRARequest`: which adapter a prompt runs with (vLLM's name and fields)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``), named.

    ``lora_int_id`` is the caller's id (vLLM's, kept for its API's shape); adapters are told apart
    by ``lora_name``: one name, one directory, for the engine's lifetime.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str
