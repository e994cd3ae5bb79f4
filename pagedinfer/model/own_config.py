"""config.json of the families our own layers serve, read without transformers' config classes.

Importing a transformers config class (``LlamaConfig``...) loads its validators, activations, kernel
hub and weight-loading machinery and with them ``torch.distributed.tensor``: most of a second of every
start-up, for a file of a few plain numbers. This reader takes the configs whose every key it knows and
whose every value has the type transformers' class declares, and gives the same values the class would
(its defaults, its derived fields, its RoPE standardization); anything else (another family, a key it
does not know, a value of another type, RoPE scaling) is left to transformers (`read` gives None), so
what transformers refuses is still refused in its words.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from pagedinfer.model.families import FAMILIES  # the declarations only: no torch, no transformers

# each family's fields with its class's defaults, by model_type (`spec.Family.config_defaults`); a key
# of another family's is refused: transformers keeps it as an attribute
DEFAULTS = {t: f.config_defaults for f in FAMILIES if f.config_defaults for t in f.model_types}
# model_types whose declared tokenizer class AutoTokenizer keeps (`spec.Family.keeps_declared_tokenizer`)
KEEPS_DECLARED_TOKENIZER = {t for f in FAMILIES if f.keeps_declared_tokenizer for t in f.model_types}
_INT, _FLOAT, _BOOL, _STR = "int", "float", "bool", "str"
# every key a config may hold and still be read here: its type as transformers' classes declare it
# ("?" after a type: null allowed); keys a family's class does not have are refused per family below
KEYS = {
    "vocab_size": _INT,
    "hidden_size": _INT,
    "intermediate_size": _INT,
    "num_hidden_layers": _INT,
    "num_attention_heads": _INT,
    "num_key_value_heads": _INT + "?",
    "head_dim": _INT + "?",
    "hidden_act": _STR,
    "max_position_embeddings": _INT,
    "rms_norm_eps": _FLOAT,
    "pad_token_id": _INT + "?",
    "bos_token_id": _INT + "?",
    "eos_token_id": "ids?",
    "tie_word_embeddings": _BOOL,
    "attention_bias": _BOOL,
    "mlp_bias": _BOOL,
    "use_sliding_window": _BOOL,
    "sliding_window": _INT + "?",
    "max_window_layers": _INT,
    "layer_types": "layer_types?",
    "rope_parameters": "rope?",
    "rope_theta": _FLOAT,
    # read by nothing here; their types still checked, as transformers' classes would
    "model_type": _STR,
    "architectures": "strs?",
    "initializer_range": "unit",
    "use_cache": _BOOL,
    "pretraining_tp": _INT + "?",
    "attention_dropout": _FLOAT + "?",
    "dtype": "dtype?",
    "torch_dtype": "dtype?",
    "transformers_version": _STR,
    "unk_token_id": _INT + "?",
    "_model_name_or_path": _STR,
}
MODEL_FIELDS = {k for defaults in DEFAULTS.values() for k in defaults}
# what every transformers config holds that a generation config takes from it
BASE = {"output_hidden_states": False, "output_attentions": False, "use_cache": True}
LAYER_TYPES = ("full_attention", "sliding_attention")
DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class OwnConfig:
    """A model config as transformers' class of its family would make it, for the fields pagedinfer's
    own layers, the validation, the dtype choice and the tokenizer's loading read."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    hidden_act: str
    max_position_embeddings: int
    rms_norm_eps: float
    rope_parameters: dict
    tie_word_embeddings: bool
    pad_token_id: int | None
    bos_token_id: int | None
    eos_token_id: int | list[int] | None
    head_dim: int | None = None  # None for Qwen2, whose class has no such field (hidden // heads then)
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    dtype: str | None = None
    _name_or_path: str = ""  # the folder it was read from (the tokenizer's loading matches hub ids on it)
    raw: dict = field(default_factory=dict, repr=False)  # the file's own keys
    is_encoder_decoder = False
    tokenizer_class = None  # a config.json naming one is left to transformers

    def get_text_config(self, decoder: bool = False) -> OwnConfig:
        return self

    def to_dict(self) -> dict:
        """The file's keys with this config's values over them (what ``GenerationConfig`` reads)."""
        values = {k: v for k, v in asdict(self).items() if k not in ("raw", "_name_or_path")}
        return {**BASE, **self.raw, **values}


FIELDS = {f.name for f in fields(OwnConfig)}


def read(folder: str | Path) -> OwnConfig | None:
    """``folder``/config.json as an `OwnConfig`, or None when this reader does not take it (no such
    file, not JSON, a family or key it does not know, a value of another type than transformers'
    class declares, RoPE other than the default): transformers then reads it, and refuses it in its
    words where it refuses it."""
    try:
        raw = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict):
        return None
    defaults = DEFAULTS.get(raw.get("model_type"))
    if defaults is None or "dtype" in raw and "torch_dtype" in raw:
        return None
    if any(k not in KEYS or not _typed(v, KEYS[k]) for k, v in raw.items()):
        return None
    if any(k in MODEL_FIELDS and k not in defaults for k in raw):  # a field its class does not have
        return None
    v = {**defaults, **{k: raw[k] for k in raw if k in defaults}}
    heads = v["num_attention_heads"]
    if heads <= 0 or v["hidden_size"] % heads:  # transformers' validate_architecture refuses (or fails on) it
        return None
    if v.get("head_dim") is None and "head_dim" in defaults:
        v["head_dim"] = v["hidden_size"] // v["num_attention_heads"]
    if v["num_key_value_heads"] is None:
        v["num_key_value_heads"] = v["num_attention_heads"]
    if "use_sliding_window" in v:  # Qwen2 and Qwen3: a window only where asked, on the later layers
        window = v["sliding_window"] if v.pop("use_sliding_window") else None
        v["sliding_window"] = window
        first = v.pop("max_window_layers")
        if v["layer_types"] is None:
            v["layer_types"] = [
                LAYER_TYPES[window is not None and i >= first] for i in range(v["num_hidden_layers"])
            ]
        if len(v["layer_types"]) != v["num_hidden_layers"]:
            return None
    rope = _rope(raw)
    if rope is None:
        return None
    return OwnConfig(
        model_type=raw["model_type"],
        **{k: v[k] for k in FIELDS if k in v},
        rope_parameters=rope,
        dtype=raw.get("dtype", raw.get("torch_dtype")),
        _name_or_path=str(folder),
        raw=raw,
    )


def tokenizer_loader(folder: str | Path, config: OwnConfig) -> Callable[..., object] | None:
    """What loads the tokenizer in ``folder`` as ``AutoTokenizer.from_pretrained`` would, given
    ``config``, without transformers reading config.json again through its config classes; None
    (``AutoTokenizer`` as it is) where the files do not name their class or name remote code.

    A tokenizer_config.json naming ``TokenizersBackend`` (what transformers 5 saves) is that class for
    the families that keep it (Llama, Mistral: ``AutoTokenizer`` keeps a declared class their families
    register no other for);
    its ``from_pretrained`` is called directly, sparing the import of every model family's module
    list. Other classes, and Qwen2/Qwen3 (whose declared class transformers replaces by its own), go
    through ``AutoTokenizer`` with ``config`` handed to it."""
    try:
        doc = json.loads((Path(folder) / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    declared = doc.get("tokenizer_class") if isinstance(doc, dict) else None
    if not isinstance(declared, str) or "auto_map" in doc:
        return None
    if declared == "TokenizersBackend" and config.model_type in KEEPS_DECLARED_TOKENIZER:
        return _tokenizers_backend
    return functools.partial(auto_tokenizer, config=config)


def _tokenizers_backend(folder: str | Path, **kwargs: object) -> object:
    """``TokenizersBackend.from_pretrained`` as ``AutoTokenizer`` calls it (transformers imported now)."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    return TokenizersBackend.from_pretrained(folder, _from_auto=True, **kwargs)


def auto_tokenizer(folder: str | Path, **kwargs: object) -> object:
    """``AutoTokenizer.from_pretrained`` (transformers imported now)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, **kwargs)


def _rope(raw: dict) -> dict | None:
    """transformers' standardized ``rope_parameters`` of a default (unscaled) RoPE; None otherwise."""
    rope = dict(raw.get("rope_parameters") or {})
    if set(rope) - {"rope_type", "rope_theta"} or rope.get("rope_type", "default") != "default":
        return None
    theta = rope.get("rope_theta", raw.get("rope_theta", 10_000.0))
    if not _typed(theta, _FLOAT):
        return None
    return {"rope_theta": theta, "rope_type": "default"}  # the order transformers saves them in


def _typed(value: object, kind: str) -> bool:
    """Whether ``value`` has the type ``kind`` names (see `KEYS`)."""
    if kind.endswith("?"):
        return value is None or _typed(value, kind[:-1])
    if kind == _INT:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == _FLOAT:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if kind == "unit":
        return _typed(value, _FLOAT) and 0.0 <= value <= 1.0
    if kind == _BOOL:
        return isinstance(value, bool)
    if kind == _STR:
        return isinstance(value, str)
    if kind == "strs":
        return isinstance(value, list) and all(isinstance(s, str) for s in value)
    if kind == "ids":
        return _typed(value, _INT) or isinstance(value, list) and all(_typed(i, _INT) for i in value)
    if kind == "layer_types":
        return isinstance(value, list) and all(t in LAYER_TYPES for t in value)
    if kind == "rope":
        return isinstance(value, dict)
    if kind == "dtype":
        return value in DTYPES
    raise ValueError(f"unknown kind {kind!r}")
