"""Random-weight models built from a config and saved with ``save_pretrained``.

One builder for every offline model of the project: the tests' tiny models, the benchmark's
model shapes and the example of ``pagedinfer blocks``. Saving and loading from disk (rather than
handing over the module) keeps the real loading code on the path.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # transformers' model registry is imported where a model is built, not on import
    from transformers import PretrainedConfig


def save_random_model(
    config: PretrainedConfig,
    path: Path,
    seed: int = 0,
    dtype: torch.dtype | None = None,
    norm_std: float = 0.0,
) -> int:
    """Build ``config``'s model with weights drawn from ``seed`` (in ``dtype``, default float32),
    save it (config, safetensors, generation config) under ``path``; return its parameter count.
    ``norm_std``: the norms' weights drawn too, from N(0, norm_std) (transformers initialises them to
    one value, Gemma's to 0: a layer misreading them would go unseen).

    The generation config takes the config's BOS/EOS ids, so a model built with ``eos_token_id=None``
    never stops early in transformers' ``generate`` either."""
    model = random_model(config, seed, dtype or torch.float32, torch.device("cpu"))
    if norm_std:
        with torch.no_grad():
            for name, weight in model.named_parameters():
                if name.endswith("norm.weight"):
                    weight.normal_(0.0, norm_std)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.bos_token_id = config.bos_token_id
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def random_model(
    config: PretrainedConfig, seed: int, dtype: torch.dtype, device: torch.device, **kwargs
) -> torch.nn.Module:
    """``config``'s model with its own initialisation drawn from ``seed``, built directly on ``device``
    (on a GPU in seconds, where saving and loading an 8B checkpoint takes minutes)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)
