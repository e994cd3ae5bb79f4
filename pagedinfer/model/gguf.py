"""GGUF checkpoints (the single-file format of llama.cpp, Ollama, LM Studio) through transformers.

transformers reads the GGUF's config, tokenizer (with its chat template) and tensors, dequantizing
every tensor to the run's dtype; it needs the ``gguf`` and ``accelerate`` packages (the ``gguf``
extra). Dequantizing takes a while (about 30 s for a 135M-parameter Q4 file on two loaded cores), so
`convert` writes a plain model directory once for repeated runs.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
from pathlib import Path

import torch

EXTRA = "gguf"
PACKAGES = ("gguf", "accelerate")


def is_gguf(name: str) -> bool:
    return name.lower().endswith(".gguf")


def missing_extra() -> str | None:
    """One line naming the install command when a package the GGUF loader needs is missing."""
    missing = [p for p in PACKAGES if importlib.util.find_spec(p) is None]
    if not missing:
        return None
    return f"loading a GGUF file needs {' and '.join(missing)}: pip install 'pagedinfer[{EXTRA}]'"


def source(path: Path) -> tuple[str, dict]:
    """``from_pretrained`` arguments for a GGUF file: its folder, and the file name as ``gguf_file``."""
    return str(path.parent), {"gguf_file": path.name}


def convert(
    gguf_path: str | os.PathLike, out_dir: str | os.PathLike, dtype: torch.dtype = torch.float32
) -> Path:
    """Dequantize ``gguf_path`` into a model directory (config, safetensors, tokenizer, generation
    config) that loads in seconds. ``save_pretrained`` refuses a GGUF-loaded model ("quantized with
    gguf and is not serializable"), so the model is re-created from its config and given the state
    dict. The GGUF's tokenizer and chat template are saved beside it (when the file has one). Written to a temporary folder and renamed: a half-written directory is never left behind."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, kwargs = source(Path(gguf_path))
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs)
    config = loaded.config
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    plain = AutoModelForCausalLM.from_config(config, dtype=dtype)
    plain.load_state_dict(loaded.state_dict())
    plain.generation_config = loaded.generation_config
    out = Path(out_dir)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(tmp)
    with contextlib.suppress(ValueError):  # a GGUF without tokenizer metadata: token-id prompts only
        AutoTokenizer.from_pretrained(folder, **kwargs).save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out
