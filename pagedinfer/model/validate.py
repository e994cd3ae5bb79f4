"""One check of a model against itself before any kernel runs.

The C ops (the panels' row lookup, the fused QKV split, the one-call decode step) trust the config's
sizes: a tensor with fewer rows than the config implies is read past its end, one with more is
misread, and an lm_head wider than the embedding samples ids the embedding cannot look up. So the
loader hands this module what it knows, in order, and nothing is packed or run until it passes:

- `check_metadata`: a GGUF file's size metadata (positive integers, finite positive floats), before
  transformers makes a config of it;
- `check_config_file`: a model folder's config.json, of a family our layers serve: each size and
  setting of the right type and range, the head counts dividing, before any config class reads it
  (transformers' would refuse it in its own words, or divide by zero);
- `check_weights_hold`: before transformers' layers are built from a served family's config (they
  allocate every tensor the config sizes before a weight is read), the sizes against the bytes of its
  weight files, so a hostile size is refused rather than allocated;
- `check_tensors`: the config's own consistency, then every tensor's shape and type against it (as
  the family's declaration in `families` states them), which makes the vocabulary's three sizes (the
  config's, the embedding's rows, the lm_head's rows) one; from the GGUF index or the safetensors
  headers, before a byte of weight data is read;
- `check_values`: every weight finite (a quantized block's scales, a float tensor's values), once the
  state dict is read, before it is packed;
- `check_module`: a model transformers built (any family): the tensors its loading found of another
  size than the config's, its embedding against its lm_head, and its weights finite;
- `check_probe`: the logits of the loader's one-token probe finite (finite weights can still
  overflow);
- `vocabulary_note`: a tokenizer larger than the embedding, noted at load (intake refuses a prompt
  whose text tokenizes past the embedding's rows, as it does given ids).

Each refusal is a `ModelCheckError` whose message names the file, the tensor, and the expected and
found shape (or what else is wrong), in one line.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pagedinfer.kernels.weight_types import (
    GGUF_SCALE_OFFSETS,  # the float16 scale fields of each kept block type
)
from pagedinfer.model import families
from pagedinfer.model.dtype import dtype_name
from pagedinfer.model.families.spec import HF_LAYER, Family, Module, Sizes, formula
from pagedinfer.model.gguf_blocks import BLOCKS, GGUFWeight
from pagedinfer.model.gguf_header import ArrayValue

INTEGER_TYPES = (0, 1, 2, 3, 4, 5, 10, 11)  # GGUF's integer value types (7 is bool)
SAFETENSORS_FLOATS = ("F64", "F32", "F16", "BF16")  # the safetensors dtypes our loader casts from
F16_EXPONENT = 0x7C00  # all ones: Inf or NaN
FINITE_CHUNK = 1 << 24  # values per isfinite pass over a tensor whose sum overflowed (bounds its mask)


class ModelCheckError(ValueError):
    """The model disagrees with itself; the message names the file and the tensor or setting."""


@dataclass(frozen=True)
class Found:
    """A tensor as its file states it."""

    shape: tuple[int, ...]  # numpy order: [rows, in]
    kind: str  # a GGUF type (F32, Q4_K, ...) or a safetensors dtype (F32, BF16, I64, ...)
    stored_as: str  # its name in the file (a GGUF name; the same as the key for safetensors)
    file: str


def _fmt(shape: Iterable[int]) -> str:
    return "[" + ", ".join(f"{d:,}" for d in shape) + "]"


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_metadata(metadata: dict[str, object], types: dict[str, int], tensors: int, where: str) -> None:
    """The size keys of a GGUF of a family our layers serve (`families.by_gguf_arch`): each a positive
    integer (the layer count at most the file's ``tensors``: transformers builds a list per layer),
    each float a finite positive number (transformers divides by them, or makes a config no layer can
    be built from)."""
    arch = metadata.get("general.architecture")
    family = families.by_gguf_arch(arch, metadata)
    if family is None:
        return
    for key in (f"{arch}.{k}" for k in family.gguf_size_keys if f"{arch}.{k}" in metadata):
        value = metadata[key]
        if types[key] not in INTEGER_TYPES or not _is_int(value) or value < 1:
            raise ModelCheckError(
                f"{where}: metadata {key} is {_value(value)}; it must be a positive integer"
            )
    for key in (f"{arch}.{k}" for k in family.gguf_float_keys):
        value = metadata.get(key, 1.0)
        if not (_finite(value) and value > 0):
            raise ModelCheckError(
                f"{where}: metadata {key} is {_value(value)}; it must be a finite positive number"
            )
    layers = metadata.get(f"{arch}.block_count", 0)
    if layers > tensors:
        raise ModelCheckError(
            f"{where}: metadata {arch}.block_count is {layers:,}, but the file holds {tensors:,} tensors "
            "(each layer has its own)"
        )


# config.json's sizes: each a positive integer where the file sets it; those after the first six may
# also be null (the head counts and head_dim derived, no window), and sliding_window 0 where
# use_sliding_window is false (Qwen2-MoE's class saves that for no window); the experts' only for
# their families
CONFIG_SIZES = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
    "max_position_embeddings",
    "num_key_value_heads",
    "head_dim",
    "sliding_window",
)
CONFIG_NULLABLE = ("num_key_value_heads", "head_dim", "sliding_window")
CONFIG_EXPERT_SIZES = (
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "decoder_sparse_step",
)


def check_config_file(folder: str | Path) -> None:
    """``folder``/config.json, where it is a JSON object of a family our layers serve: the fields our
    layers, the cache and the validation read, each as `sizes` wants it (the relations between the
    head counts and the hidden size taken with the family's defaults where the file leaves one out).
    Sizes too large for the weights are refused against them (`check_tensors`), before any allocation.
    Anything else (no such file, not JSON, another family, other keys) is left to the config reader."""
    path = Path(folder) / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    family = families.by_model_type(raw.get("model_type")) if isinstance(raw, dict) else None
    if family is None:
        return

    def refuse(key: str, expected: str) -> None:
        raise ModelCheckError(f"{path}: {key} is {_json(raw[key])}; it must be {expected}")

    for key in (*CONFIG_SIZES, *(CONFIG_EXPERT_SIZES if family.experts else ())):
        value = raw.get(key)
        off = key == "sliding_window" and value == 0 and raw.get("use_sliding_window") is False
        if key in raw and not (
            _is_int(value) and value > 0 or value is None and key in CONFIG_NULLABLE or off
        ):
            refuse(key, "a positive integer" + (" or null" if key in CONFIG_NULLABLE else ""))
    if "rms_norm_eps" in raw and not (_finite(raw["rms_norm_eps"]) and raw["rms_norm_eps"] >= 0):
        refuse("rms_norm_eps", "a finite number >= 0")
    if "tie_word_embeddings" in raw and not isinstance(raw["tie_word_embeddings"], bool):
        refuse("tie_word_embeddings", "true or false")
    rope = raw.get("rope_parameters")
    if not isinstance(rope, (dict, type(None))):
        refuse("rope_parameters", "an object (rope_type, rope_theta, ...) or null")
    for key, theta in (("rope_theta", raw), ("rope_parameters.rope_theta", rope or {})):
        value = theta.get("rope_theta", 1.0)
        if not (_finite(value) and value > 0):
            raise ModelCheckError(f"{path}: {key} is {_json(value)}; it must be a finite positive number")
    glu = family.experts.glu if family.experts else None
    for key in (glu.alpha, glu.limit) if glu else ():  # gpt-oss's clamped SwiGLU's constants
        if key in raw and not (_finite(raw[key]) and raw[key] > 0):
            refuse(key, "a finite positive number")
    _check_heads(raw, family, str(path))


def _json(value: object) -> str:
    """A config.json value as the file spells it (null, true, "8", NaN), cut to a message's length."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_heads(raw: dict, family: Family, where: str) -> None:
    """The head counts of a config.json whose sizes are each valid: the KV heads dividing the query
    heads, the query heads the hidden size where no head_dim is set; the experts a token runs at most
    the experts."""
    value = {**family.config_defaults, **raw}.get
    heads, kv_heads, hidden = value("num_attention_heads"), value("num_key_value_heads"), value("hidden_size")
    if heads and kv_heads and heads % kv_heads:
        raise ModelCheckError(
            f"{where}: num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads})"
        )
    # no head_dim: hidden // heads, where the file says so or the family's class has no other default
    derived = value("head_dim") is None and ("head_dim" in raw or family.config_defaults)
    if heads and hidden and derived and hidden % heads:
        raise ModelCheckError(
            f"{where}: hidden_size ({hidden}) is not a multiple of num_attention_heads ({heads}), and no "
            "head_dim is set"
        )
    top_k = value("num_experts_per_tok")
    for count in ("num_experts", "num_local_experts") if family.experts and top_k else ():
        if count in raw and top_k > raw[count]:  # either name: transformers 5 saves qwen3_moe's as the other
            raise ModelCheckError(
                f"{where}: num_experts_per_tok ({top_k}) is more than {count} ({raw[count]})"
            )


def _finite(value: object) -> bool:
    """A finite number (a bool is not one)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _value(v: object) -> str:
    if isinstance(v, ArrayValue):
        return f"an array of {v.count:,} items"
    text = repr(v) if isinstance(v, (str, bool, float)) else str(v)
    return text if len(text) <= 40 else text[:37] + "..."


def sizes(config, where: str) -> Sizes:
    """The config's sizes, each checked (positive integers that fit together); raises `ModelCheckError`."""

    def positive(name: str, value: object) -> int:
        if not _is_int(value) or value < 1:
            raise ModelCheckError(
                f"{where}: the config's {name} is {_value(value)}; it must be a positive integer"
            )
        return value

    hidden = positive("hidden_size", getattr(config, "hidden_size", None))
    heads = positive("num_attention_heads", getattr(config, "num_attention_heads", None))
    kv_heads = positive("num_key_value_heads", getattr(config, "num_key_value_heads", None) or heads)
    if heads % kv_heads:
        raise ModelCheckError(
            f"{where}: the config's num_attention_heads ({heads}) is not a multiple of its "
            f"num_key_value_heads ({kv_heads})"
        )
    head_dim = getattr(config, "head_dim", None)
    if head_dim is None:
        if hidden % heads:
            raise ModelCheckError(
                f"{where}: the config's hidden_size ({hidden}) is not a multiple of its num_attention_heads "
                f"({heads}), and it sets no head_dim"
            )
        head_dim = hidden // heads
    head_dim = positive("head_dim", head_dim)
    if head_dim % 2:
        raise ModelCheckError(
            f"{where}: the config's head_dim is {head_dim}; rotary embeddings need an even one"
        )
    eps = getattr(config, "rms_norm_eps", 1e-6)
    if not (_finite(eps) and eps >= 0):
        raise ModelCheckError(
            f"{where}: the config's rms_norm_eps is {_value(eps)}; it must be a finite number >= 0"
        )
    theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    if not (_finite(theta) and theta > 0):
        raise ModelCheckError(
            f"{where}: the config's rope_theta is {_value(theta)}; it must be a finite positive number"
        )
    positive("max_position_embeddings", getattr(config, "max_position_embeddings", None))
    experts = top_k = expert_inter = shared_inter = 0
    count = next((k for k in ("num_experts", "num_local_experts") if hasattr(config, k)), None)
    if count is not None:  # a mixture of experts: top-k of the experts, each of its own size
        experts = positive(count, getattr(config, count))
        top_k = positive("num_experts_per_tok", getattr(config, "num_experts_per_tok", None))
        if top_k > experts:
            raise ModelCheckError(
                f"{where}: the config's num_experts_per_tok ({top_k}) is more than its {count} ({experts})"
            )
        if hasattr(config, "moe_intermediate_size"):
            expert_inter = positive("moe_intermediate_size", config.moe_intermediate_size)
        if hasattr(config, "shared_expert_intermediate_size"):
            shared_inter = positive("shared_expert_intermediate_size", config.shared_expert_intermediate_size)
        if hasattr(config, "decoder_sparse_step"):  # which layers are sparse (`Experts.sparse`) divides by it
            positive("decoder_sparse_step", config.decoder_sparse_step)
    return Sizes(
        hidden,
        positive("intermediate_size", getattr(config, "intermediate_size", None)),
        positive("num_hidden_layers", getattr(config, "num_hidden_layers", None)),
        heads,
        kv_heads,
        head_dim,
        positive("vocab_size", getattr(config, "vocab_size", None)),
        experts,
        top_k,
        expert_inter,
        shared_inter,
    )


def check_weights_hold(config, family: Family, files: list[Path], where: str) -> None:
    """Refuse a config whose sizes need more weights than ``files`` (the checkpoint's) could hold, at
    the fewest bits any format stores a weight in (one): transformers would allocate them all first.
    The count is a floor every checkpoint of ``family`` holds: the embedding, each layer's q, k, v and
    o, and its dense MLP or its experts' (`Experts.sparse_layers` of them)."""
    if not files:
        return
    s = sizes(config, where)
    sparse = family.experts.sparse_layers(config, s.layers) if family.experts else 0
    mlp = sparse * s.experts * (s.expert_inter or s.inter) + (s.layers - sparse) * s.inter  # all layers'
    need = s.vocab * s.hidden + s.layers * s.hidden * (2 * s.q + 2 * s.kv) + 3 * s.hidden * mlp
    held = sum(f.stat().st_size for f in files)
    if need > 8 * held:
        fields = {  # the largest named: a hostile size is far the largest
            "vocab_size": s.vocab,
            "hidden_size": s.hidden,
            "num_hidden_layers": s.layers,
            "num_attention_heads": s.heads,
            "head_dim": s.head_dim,
            **({"num_experts": s.experts, "moe_intermediate_size": s.expert_inter} if family.experts else {}),
            "intermediate_size": s.inter,
        }
        name = max(fields, key=fields.get)
        raise ModelCheckError(
            f"{where}: the config's {name} ({fields[name]:,}) with its other sizes needs at least {need:,} "
            f"weights, but its weight files hold {held:,} bytes"
        )


def _expected(family: Family, config, s: Sizes) -> Iterator[tuple[str, tuple[int, ...], str, bool]]:
    """Every tensor the config implies as ``family`` declares it (name, shape, its formula, required),
    layer by layer, each layer's modules as the family gives them for its index (`Family.layer_at`)
    (lazily: a config of a billion layers stops at the first layer the file lacks)."""
    yield from _tensors("", family.top, s)
    for i in range(s.layers):
        yield from _tensors(HF_LAYER.format(i), family.layer_at(config, i), s)


def _tensors(
    prefix: str, modules: Iterable[Module], s: Sizes
) -> Iterator[tuple[str, tuple[int, ...], str, bool]]:
    for m in modules:
        for e in range(s.experts) if m.experts else (None,):  # a module per expert: each expert's
            for suffix, dims, required in m.tensors():
                yield f"{prefix}{m.hf_name(e)}{suffix}", s.shape(dims), formula(dims), required


def _named(name: str, found: Found) -> str:
    """A tensor as messages name it: its name in the file, and the Hugging Face name when they differ."""
    return repr(name) if found.stored_as == name else f"{found.stored_as!r} ({name})"


def check_tensors(
    config, family: Family, found: dict[str, Found], where: str, readable: Iterable[str]
) -> None:
    """The config's sizes, then each tensor ``family`` declares against them (Hugging Face names ->
    what the file states): every required tensor present, each present one of the expected shape and
    of a ``readable`` type, none unexpected. ``where``: the weights' file(s), for a tensor that is missing."""
    s = sizes(config, where)
    readable = set(readable)
    seen = set()
    for name, shape, dims, required in _expected(family, config, s):
        seen.add(name)
        got = found.get(name)
        if got is None:
            if required:
                raise ModelCheckError(missing(name, 0, where))
            continue
        if got.shape != shape:
            raise ModelCheckError(
                f"{got.file}: tensor {_named(name, got)} has shape {_fmt(got.shape)}; the config expects "
                f"{_fmt(shape)} ({dims[1:-1]} = {', '.join(f'{d:,}' for d in shape)})"
            )
        if got.kind not in readable:
            raise ModelCheckError(
                f"{got.file}: tensor {_named(name, got)} is stored as {got.kind}, a type pagedinfer does not "
                "read as weights"
            )
    extra = sorted(set(found) - seen)
    if extra:
        got = found[extra[0]]
        more = f" and {len(extra) - 1} more" if len(extra) > 1 else ""
        raise ModelCheckError(
            f"{got.file}: tensor {_named(extra[0], got)}{more} {'are' if more else 'is'} not part of the "
            f"config's {config.model_type} model (num_hidden_layers = {s.layers})"
        )


def missing(name: str, more: int, where: str) -> str:
    """The refusal of weights that lack a tensor the config implies (and ``more`` others)."""
    others = f" and {more} more" if more else ""
    return f"{where}: the weights have no tensor {name!r}{others}, which the config implies"


def check_values(sd: dict[str, torch.Tensor | GGUFWeight], found: dict[str, Found]) -> None:
    """Every weight of a state dict read from the files ``found`` indexes: finite (`check_finite`)."""
    for name, value in sd.items():
        got = found[name]
        check_finite(_named(name, got), value, got.file)


def check_finite(name: str, value: torch.Tensor | GGUFWeight, where: str) -> None:
    """Refuse a weight holding NaN or Inf (it would turn every logit into NaN, argmaxed to token 0).
    ``name``: as the message shows it."""
    if isinstance(value, GGUFWeight):
        bad = _bad_scale(value)
        if bad is not None:
            raise ModelCheckError(
                f"{where}: tensor {name} ({value.kind}) has a NaN or infinite scale in row {bad[0]:,}, block "
                f"{bad[1]:,}"
            )
        return
    if not value.is_floating_point() or value.numel() == 0:
        return
    flat = value.detach().reshape(-1)
    # one summing pass (no mask), chunk by chunk (a bfloat16 tensor is summed through a float32 copy:
    # one chunk's, never the whole tensor's): finite unless a value is not, or finite values overflow;
    # only then is the exact check run, in chunks
    acc = torch.float64 if flat.dtype == torch.float64 else torch.float32
    chunks = range(0, flat.numel(), FINITE_CHUNK)
    if all(torch.isfinite(flat[start : start + FINITE_CHUNK].sum(dtype=acc)) for start in chunks):
        return
    for start in range(0, flat.numel(), FINITE_CHUNK):
        chunk = flat[start : start + FINITE_CHUNK]
        ok = torch.isfinite(chunk)
        if not bool(ok.all()):
            at = start + int((~ok).nonzero()[0, 0])
            index = np.unravel_index(at, tuple(value.shape))
            raise ModelCheckError(
                f"{where}: tensor {name} holds {chunk[at - start].item()} at {list(map(int, index))}"
            )


def _bad_scale(w: GGUFWeight) -> tuple[int, int] | None:
    """(row, block) of the first float16 scale that is NaN or Inf in ``w``'s blocks, else None."""
    size = BLOCKS[w.kind][1]
    blocks = w.data.reshape(w.data.shape[0], -1, size)  # [out, blocks per row, block bytes]
    for at in GGUF_SCALE_OFFSETS[w.kind]:
        bits = blocks[:, :, at : at + 2].view("<u2")[..., 0]  # [out, blocks per row]: a view, no copy
        bad = (bits & F16_EXPONENT) == F16_EXPONENT
        if bad.any():
            row, col = np.argwhere(bad)[0]
            return int(row), int(col)
    return None


def check_module(model: torch.nn.Module, mismatched: Iterable, where: str) -> None:
    """A model transformers built from its config: the tensors its loading found of another size, its
    embedding's and lm_head's rows (one vocabulary), and every parameter finite."""
    first = min(mismatched, default=None, key=lambda m: m[0])  # (name, stored shape, built shape)
    if first is not None:
        name, stored, built = first
        raise ModelCheckError(
            f"{where}: tensor {name!r} has shape {_fmt(stored)}; the config expects {_fmt(built)}"
        )
    rows = model.get_input_embeddings().weight.shape[0]
    head = model.get_output_embeddings()  # None for a family without one
    out = head.weight.shape[0] if head is not None else rows
    if out != rows:
        raise ModelCheckError(
            f"{where}: the lm_head has {out:,} rows but the embedding {rows:,}: every sampled id must be one "
            "the embedding holds"
        )
    for name, p in model.named_parameters():
        check_finite(repr(name), p, where)


def check_probe(logits: torch.Tensor, where: str, dtype: torch.dtype) -> None:
    """The logits of the loader's one-token probe: finite weights that overflow (a norm of 1e30) give
    NaN or Inf here, and every token sampled from them would be garbage."""
    if not bool(torch.isfinite(logits).all()):
        raise ModelCheckError(
            f"{where}: one token through the model gives NaN or infinite logits: its weights are finite but "
            f"overflow {dtype_name(dtype)} (a corrupt file, or a dtype too narrow for this model)"
        )


def vocabulary_note(tokenizer, rows: int) -> str | None:
    """A tokenizer that knows more tokens than the embedding has rows (their ids cannot be looked up):
    what a run does about it, in one line (None when they agree)."""
    size = len(tokenizer) if tokenizer is not None else 0
    if size <= rows:
        return None
    return (
        f"its tokenizer has {size:,} tokens but its embedding {rows:,} rows: a prompt whose text "
        f"tokenizes to an id of {rows:,} or more fails its line"
    )
