"""A PEFT LoRA adapter directory read into per-module ``A`` and ``B`` matrices and one scaling.

PEFT saves ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``, ``target_modules``...)
and ``adapter_model.safetensors`` with keys such as
``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` (``[r, in]``) and ``...lora_B.weight``
(``[out, r]``). Its forward adds ``lora_B(lora_A(x)) * scaling`` to the base linear's output, with
``scaling = lora_alpha / r`` (rsLoRA: ``lora_alpha / sqrt(r)``). What the base model must match (module
names, shapes) is checked when the adapter is installed (`registry`); here only the files and the
config's own features.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from pagedinfer.sampling_params import is_int, is_number

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
FLOAT32_MAX = 3.4028234663852886e38  # the scaling multiplies float32 activations
PREFIX = "base_model.model."  # PEFT's wrapper in front of the base model's own module names
# config features that change the forward beyond x A^T B^T * scaling: refused, named
UNSUPPORTED = {
    "use_dora": "DoRA (use_dora)",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "modules_to_save": "fully trained modules (modules_to_save)",
    "lora_bias": "LoRA biases (lora_bias)",
    "fan_in_fan_out": "fan_in_fan_out weights (Conv1D bases)",
}


class AdapterError(ValueError):
    """The adapter cannot be served; the message says why (a line's error, or a startup error)."""


@dataclass
class LoRAWeights:
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]


@dataclass
class Adapter:
    name: str
    path: str
    rank: int  # the config's r (every module's A has this many rows)
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    modules: dict[str, LoRAWeights]  # the base model's module name (model.layers.0.self_attn.q_proj) -> A, B


def read_adapter(name: str, path: str) -> Adapter:
    """Read a PEFT LoRA directory; raises `AdapterError` naming the problem."""
    folder = Path(path).expanduser()
    config_file = folder / CONFIG
    if not config_file.is_file():
        raise AdapterError(f"adapter {name!r}: no {CONFIG} in {path}")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise AdapterError(f"adapter {name!r}: {config_file} is not readable JSON ({e})") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        kind = config.get("peft_type") if isinstance(config, dict) else None
        raise AdapterError(f"adapter {name!r}: peft_type {kind!r}, not a LoRA adapter")
    for key, what in UNSUPPORTED.items():
        if config.get(key):
            raise AdapterError(f"adapter {name!r}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"adapter {name!r}: bias={config['bias']!r} is not supported (only 'none')")
    scaling, rank = _scaling(name, config)
    tensors = _tensors(name, folder)
    return Adapter(name, str(folder), rank, scaling, _modules(name, tensors, rank))


def _scaling(name: str, config: dict) -> tuple[float, int]:
    """The adapter's scaling and rank from its config: ``r`` a positive integer (not ``true``),
    ``lora_alpha`` a finite number (Python's JSON reads ``NaN`` and ``Infinity``), and their ratio
    within float32, the dtype the scaling multiplies in (``1e308 / 8`` would be infinite there)."""
    rank, alpha = config.get("r"), config.get("lora_alpha", 8)
    if not is_int(rank) or rank < 1:
        raise AdapterError(f"adapter {name!r}: r must be a positive integer, found {_found(rank)}")
    if not (is_int(alpha) or is_number(alpha)):  # an integer of any size; a float that is finite
        raise AdapterError(f"adapter {name!r}: lora_alpha must be a finite number, found {_found(alpha)}")
    words = "sqrt(r)" if config.get("use_rslora") else "r"
    try:
        divisor = math.sqrt(rank) if config.get("use_rslora") else float(rank)
        scaling = float(alpha) / divisor
    except OverflowError:  # an integer beyond a double
        scaling = math.inf
    if not abs(scaling) <= FLOAT32_MAX:
        raise AdapterError(
            f"adapter {name!r}: lora_alpha / {words} (lora_alpha={_found(alpha)}, r={_found(rank)}) is "
            f"beyond float32's range (±{FLOAT32_MAX:.4g})"
        )
    return scaling, rank


def _found(value: object) -> str:
    """A config value as its JSON reads (``true``, ``NaN``, ``"8"``), cut to a line's worth."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:40] + "…"


def _tensors(name: str, folder: Path) -> dict[str, torch.Tensor]:
    file = folder / WEIGHTS
    if not file.is_file():
        raise AdapterError(f"adapter {name!r}: no {WEIGHTS} in {folder}")
    try:
        return load_file(str(file))
    except Exception as e:  # noqa: BLE001 - a damaged file is this adapter's error
        raise AdapterError(f"adapter {name!r}: cannot read {file}: {e}") from None


def _modules(name: str, tensors: dict[str, torch.Tensor], rank: int) -> dict[str, LoRAWeights]:
    """``{module: (A, B)}`` from PEFT's keys; embeddings' LoRA (``lora_embedding_A``) is refused.

    Beside an lm_head LoRA PEFT saves the head's own weight (``lm_head.base_layer.weight``, for
    resized vocabularies): it is the base model's, and skipped (another vocabulary shows as lora_B's
    shape)."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        if ".base_layer." in key:
            continue
        if "lora_embedding_" in key:
            module = key.removeprefix(PREFIX).split(".lora_embedding_")[0]
            raise AdapterError(f"adapter {name!r}: LoRA on the embeddings ({module}) is not supported")
        for part in ("lora_A", "lora_B"):
            marker = f".{part}."
            if marker in key and key.endswith(".weight"):
                module = key.removeprefix(PREFIX).split(marker)[0]
                found.setdefault(module, {})[part] = t
                _check_finite(name, key, t)
                break
        else:
            raise AdapterError(f"adapter {name!r}: unexpected tensor {key!r} in its weights")
    if not found:
        raise AdapterError(f"adapter {name!r}: its weights hold no LoRA tensors")
    modules = {}
    for module, pair in sorted(found.items()):
        if set(pair) != {"lora_A", "lora_B"}:
            raise AdapterError(f"adapter {name!r}: {module} has lora_A or lora_B, not both")
        a, b = pair["lora_A"], pair["lora_B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise AdapterError(
                f"adapter {name!r}: {module} has lora_A {list(a.shape)} and lora_B {list(b.shape)}, "
                f"not [r, in] and [out, r] with r={rank}"
            )
        modules[module] = LoRAWeights(a, b)
    return modules


def _check_finite(name: str, key: str, t: torch.Tensor) -> None:
    """A NaN or infinite weight would make every logit of the adapter's requests NaN: refused at load."""
    if not t.is_floating_point() or bool(torch.isfinite(t).all()):
        return
    nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
    held = " and ".join(f"{n:,} {what}" for n, what in ((nan, "NaN"), (inf, "infinite")) if n)
    raise AdapterError(f"adapter {name!r}: tensor {key} holds {held} values of {t.numel():,}")
