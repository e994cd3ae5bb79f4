"""Structure-aware GGUF mutations, and the check each mutated file must pass.

Two valid tiny GGUF files are built from scratch (`bases`): a llama with a byte-level BPE tokenizer,
an untied lm_head and the 32-value block types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, F16, F32), and a tied
qwen3 (q/k norms) in K-quants (Q4_K, Q5_K, Q6_K). `encode` writes a `Layout` and remembers where each
count, length, type, dimension and offset sits (`Spot`), so a mutation can target the header's
structure rather than random bytes. `mutate` draws one mutation of a seeded random kind: a spot set to
a boundary value, the file cut or extended, a metadata value retyped, removed, duplicated or grown past
its limit, a tensor's dimensions, type, offset or name changed (with its data kept, or rewritten to fit
the new shape: disagreements only the model check can see), quantized scales set to NaN, Inf, a
denormal or the largest float16, float weights set to NaN or Inf, and layout changes that must not
change a single token. `check` loads one file: it is refused with one line naming the file, or it
runs and every record is well-formed (ids in the vocabulary, finite logprobs; the base's exact tokens
for a neutral change). Used by tests/test_gguf_fuzz.py (a seeded subset) and scripts/fuzz_gguf.py.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import gguf
import numpy as np

from pagedinfer.kernels.weight_types import (
    GGUF_SCALE_OFFSETS as F16_SCALES,  # byte offsets of each block's float16 scales
)
from pagedinfer.model.gguf_header import MAX_ARRAY_ITEMS, MAX_TOKENIZER_ITEMS, SCALARS

STRING, ARRAY = 8, 9
F16_VALUES = {"nan": 0x7E00, "inf": 0x7C00, "-inf": 0xFC00, "denormal": 0x0001, "max": 0x7BFF, "zero": 0}
PROMPTS = [[1, 2, 3, 4], [7, 200, 9]]
MAX_TOKENS = 4


@dataclass
class Field:
    key: str
    vtype: int
    value: object  # a scalar, a str (or bytes: written as is), or the items of an array
    item_type: int | None = None  # for arrays


@dataclass
class Tensor:
    name: str
    dims: list[int]  # GGUF order: the fastest-varying first ([in, rows] for a matrix)
    kind: str
    data: bytes


@dataclass
class Layout:
    fields: list[Field]
    tensors: list[Tensor]
    version: int = 3
    alignment: int = 32
    n_tensors: int | None = None  # a count to write instead of the true one
    n_fields: int | None = None


@dataclass
class Spot:
    """A structural number in an encoded file: where, its struct format, and what it is."""

    offset: int
    fmt: str
    label: str


@dataclass
class Base:
    name: str
    layout: Layout
    vocab: int
    neutral_tokens: list[list[int]] = field(default_factory=list)  # the base's greedy tokens


@dataclass
class Case:
    name: str  # the mutation, e.g. "spot:tensor 3 dim 0=0"
    data: bytes
    neutral: bool = False  # a layout change: the base's exact tokens are expected


# -- encoding -------------------------------------------------------------------------------------


def _pack_value(out: bytearray, spots: list[Spot], vtype: int, value, item_type, label: str) -> None:
    if vtype == STRING:
        raw = value if isinstance(value, bytes) else str(value).encode()
        spots.append(Spot(len(out), "Q", f"{label} length"))
        out += struct.pack("<Q", len(raw)) + raw
    elif vtype == ARRAY:
        spots.append(Spot(len(out), "I", f"{label} item type"))
        out += struct.pack("<I", item_type)
        spots.append(Spot(len(out), "Q", f"{label} count"))
        out += struct.pack("<Q", len(value))
        if item_type in SCALARS:
            out += np.asarray(value, dtype=np.dtype("<" + SCALARS[item_type])).tobytes()
        else:
            for i, item in enumerate(value):
                _pack_value(out, spots if i < 3 else [], item_type, item, None, f"{label} item {i}")
    else:
        out += struct.pack("<" + SCALARS[vtype], value)


def encode(layout: Layout) -> tuple[bytes, list[Spot]]:
    """The file's bytes and its structural spots."""
    out, spots = bytearray(b"GGUF"), []
    spots.append(Spot(len(out), "I", "version"))
    out += struct.pack("<I", layout.version)
    spots.append(Spot(len(out), "Q", "tensor count"))
    out += struct.pack("<Q", len(layout.tensors) if layout.n_tensors is None else layout.n_tensors)
    spots.append(Spot(len(out), "Q", "key count"))
    out += struct.pack("<Q", len(layout.fields) if layout.n_fields is None else layout.n_fields)
    for f in layout.fields:
        label = f"key {f.key}"
        _pack_value(out, spots, STRING, f.key, None, f"{label} name")
        spots.append(Spot(len(out), "I", f"{label} type"))
        out += struct.pack("<I", f.vtype)
        _pack_value(out, spots, f.vtype, f.value, f.item_type, label)
    align = layout.alignment
    offsets, at = [], 0
    for t in layout.tensors:  # each tensor's data aligned, one after another
        offsets.append(at)
        at = -(-(at + len(t.data)) // align) * align
    for t, offset in zip(layout.tensors, offsets, strict=True):
        label = f"tensor {t.name}"
        _pack_value(out, spots, STRING, t.name, None, f"{label} name")
        spots.append(Spot(len(out), "I", f"{label} n_dims"))
        out += struct.pack("<I", len(t.dims))
        for i, d in enumerate(t.dims):
            spots.append(Spot(len(out), "Q", f"{label} dim {i}"))
            out += struct.pack("<Q", d)
        spots.append(Spot(len(out), "I", f"{label} type"))
        out += struct.pack("<I", int(getattr(gguf.GGMLQuantizationType, t.kind)))
        spots.append(Spot(len(out), "Q", f"{label} offset"))
        out += struct.pack("<Q", offset)
    out += bytes(-len(out) % align)
    for t in layout.tensors:
        out += t.data + bytes(-len(t.data) % align)
    return bytes(out), spots


# -- the base files -------------------------------------------------------------------------------


def tensor_bytes(kind: str, rows: int, cols: int, rng: np.random.Generator) -> bytes:
    """Random weights ``[rows, cols]`` (std 0.2: sharp logits, as tests/models.py) stored as ``kind``."""
    from gguf_models import quantize_k

    w = (rng.standard_normal((rows, cols)) * 0.2).astype(np.float32)
    if kind == "F32":
        return w.tobytes()
    if kind == "F16":
        return w.astype(np.float16).tobytes()
    if kind in ("Q4_K", "Q5_K", "Q6_K"):
        return quantize_k(w, kind).tobytes()
    return gguf.quants.quantize(w, getattr(gguf.GGMLQuantizationType, kind)).tobytes()


def _norm(name: str, n: int, rng: np.random.Generator) -> Tensor:
    return Tensor(name, [n], "F32", (1 + 0.1 * rng.standard_normal(n)).astype(np.float32).tobytes())


def _model(
    arch: str, sizes: dict, kinds: Callable[[str], str], vocab: int, tied: bool, seed: int, qk_norm: bool
) -> list[Tensor]:
    rng = np.random.default_rng(seed)
    h, i, hq, hkv, d = (sizes[k] for k in ("hidden", "inter", "heads", "kv_heads", "head_dim"))

    def mat(name: str, rows: int, cols: int) -> Tensor:
        kind = kinds(name)
        return Tensor(name, [cols, rows], kind, tensor_bytes(kind, rows, cols, rng))

    out = [mat("token_embd.weight", vocab, h), _norm("output_norm.weight", h, rng)]
    if not tied:
        out.append(mat("output.weight", vocab, h))
    for layer in range(sizes["layers"]):
        p = f"blk.{layer}."
        out += [
            mat(p + "attn_q.weight", hq * d, h),
            mat(p + "attn_k.weight", hkv * d, h),
            mat(p + "attn_v.weight", hkv * d, h),
            mat(p + "attn_output.weight", h, hq * d),
            mat(p + "ffn_gate.weight", i, h),
            mat(p + "ffn_up.weight", i, h),
            mat(p + "ffn_down.weight", h, i),
            _norm(p + "attn_norm.weight", h, rng),
            _norm(p + "ffn_norm.weight", h, rng),
        ]
        if qk_norm:
            out += [_norm(p + "attn_q_norm.weight", d, rng), _norm(p + "attn_k_norm.weight", d, rng)]
    return out


def _hparams(arch: str, sizes: dict, vocab: int) -> list[Field]:
    u32 = 4
    return [
        Field("general.architecture", STRING, arch),
        Field("general.name", STRING, f"fuzz-{arch}"),
        Field(f"{arch}.context_length", u32, 128),
        Field(f"{arch}.embedding_length", u32, sizes["hidden"]),
        Field(f"{arch}.feed_forward_length", u32, sizes["inter"]),
        Field(f"{arch}.block_count", u32, sizes["layers"]),
        Field(f"{arch}.attention.head_count", u32, sizes["heads"]),
        Field(f"{arch}.attention.head_count_kv", u32, sizes["kv_heads"]),
        Field(f"{arch}.rope.dimension_count", u32, sizes["head_dim"]),
        Field(f"{arch}.rope.freq_base", 6, 10000.0),
        Field(f"{arch}.attention.layer_norm_rms_epsilon", 6, 1e-6),
        Field(f"{arch}.vocab_size", u32, vocab),
    ]


def _tokenizer_fields() -> tuple[list[Field], int]:
    """tests/cli_helpers.py's byte-level BPE as llama.cpp's gpt2 tokenizer metadata (and its size)."""
    import json

    from cli_helpers import _tokenizer

    tok = _tokenizer()
    spec = json.loads(tok.backend_tokenizer.to_str())
    vocab = sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1])
    special = {t["content"] for t in spec["added_tokens"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    tokens = [t for t, _ in vocab]
    return [
        Field("tokenizer.ggml.model", STRING, "gpt2"),
        Field("tokenizer.ggml.pre", STRING, "default"),
        Field("tokenizer.ggml.tokens", ARRAY, tokens, STRING),
        Field("tokenizer.ggml.token_type", ARRAY, [3 if t in special else 1 for t in tokens], 5),
        Field("tokenizer.ggml.merges", ARRAY, merges, STRING),
        Field("tokenizer.ggml.bos_token_id", 4, tok.bos_token_id),
        Field("tokenizer.ggml.eos_token_id", 4, tok.eos_token_id),
    ], len(tokens)


LLAMA = dict(hidden=64, inter=128, layers=2, heads=4, kv_heads=2, head_dim=16)
QWEN3 = dict(hidden=256, inter=256, layers=1, heads=2, kv_heads=1, head_dim=128)
LLAMA_KINDS = {
    "token_embd": "Q8_0",
    "attn_q": "Q4_0",
    "attn_k": "Q5_1",
    "attn_v": "F16",
    "attn_output": "Q8_0",
    "ffn_gate": "Q4_1",
    "ffn_up": "Q5_0",
    "ffn_down": "F32",
    "output.": "Q8_0",
}
QWEN3_KINDS = {"token_embd": "Q6_K", "attn_v": "Q6_K", "ffn_down": "Q6_K", "ffn_up": "Q5_K"}


def _kind_of(table: dict[str, str], default: str) -> Callable[[str], str]:
    return lambda name: next((k for part, k in table.items() if part in name), default)


def bases() -> list[Base]:
    """The two valid files every mutation starts from."""
    tok_fields, tok_vocab = _tokenizer_fields()
    llama = Layout(
        _hparams("llama", LLAMA, tok_vocab) + tok_fields,
        _model("llama", LLAMA, _kind_of(LLAMA_KINDS, "Q8_0"), tok_vocab, False, 1, False),
    )
    qwen3 = Layout(
        _hparams("qwen3", QWEN3, 256),
        _model("qwen3", QWEN3, _kind_of(QWEN3_KINDS, "Q4_K"), 256, True, 2, True),
    )
    return [Base("llama", llama, tok_vocab), Base("qwen3", qwen3, 256)]


# -- mutations ------------------------------------------------------------------------------------


def _boundary(fmt: str, old: int, rng: random.Random) -> int:
    top = (1 << (8 * struct.calcsize(fmt))) - 1
    pool = [0, 1, 2, 3, 5, 7, 31, 33, 255, top, top - 1, top >> 1, (top >> 1) + 1, 20_000_000]
    pool += [old + 1, max(old - 1, 0), old * 2, old + 32, max(old - 32, 0), old << 16]
    pool += [MAX_ARRAY_ITEMS + 1, MAX_TOKENIZER_ITEMS + 1, 1 << 32, 1 << 40, rng.randrange(top + 1)]
    return min(rng.choice(pool), top)


def _spot(base: Base, rng: random.Random) -> Case:
    data, spots = encode(base.layout)
    s = rng.choice(spots)
    old = struct.unpack_from("<" + s.fmt, data, s.offset)[0]
    new = _boundary(s.fmt, old, rng)
    out = bytearray(data)
    struct.pack_into("<" + s.fmt, out, s.offset, new)
    return Case(f"spot:{s.label}={new}", bytes(out))


def _cut(base: Base, rng: random.Random) -> Case:
    data, spots = encode(base.layout)
    header_end = max(s.offset for s in spots) + 8
    at = rng.choice([rng.randrange(4, header_end), rng.randrange(header_end, len(data)), len(data) - 1])
    return Case(f"cut:{at}/{len(data)}", data[:at])


def _append(base: Base, rng: random.Random) -> Case:
    data, _ = encode(base.layout)
    extra = rng.randbytes(rng.choice([1, 31, 4096]))
    return Case(f"append:{len(extra)}", data + extra)


def _flip(base: Base, rng: random.Random) -> Case:
    data, spots = encode(base.layout)
    out = bytearray(data)
    header_end = max(s.offset for s in spots) + 8
    picks = [rng.randrange(8, header_end) for _ in range(rng.choice([1, 2, 8]))]
    for at in picks:
        out[at] ^= 1 << rng.randrange(8)
    return Case(f"flip:{picks}", bytes(out))


def _retype_value(f: Field, rng: random.Random) -> Field:
    """The field as another type or value: the boundaries its readers must survive."""
    choices = [
        lambda: replace(f, vtype=STRING, value=str(f.value)[:20], item_type=None),
        lambda: replace(f, vtype=6, value=rng.choice([math.nan, math.inf, -math.inf, 0.0, -1.0, 1e30])),
        lambda: replace(f, vtype=12, value=rng.choice([math.nan, 1e300, 2.5])),
        lambda: replace(f, vtype=5, value=rng.choice([-1, 0, -(1 << 31)])),
        lambda: replace(f, vtype=4, value=rng.choice([0, 1, 3, 7, 1 << 20, (1 << 32) - 1])),
        lambda: replace(f, vtype=10, value=rng.choice([1 << 40, (1 << 64) - 1])),
        lambda: replace(f, vtype=7, value=True),
        lambda: replace(f, vtype=ARRAY, value=[2, 2], item_type=4),
        lambda: replace(f, vtype=ARRAY, value=[], item_type=STRING),
        lambda: replace(f, vtype=STRING, value=b"\xff\xfe"),
    ]
    return rng.choice(choices)()


def _field(base: Base, rng: random.Random) -> Case:
    fields = list(base.layout.fields)
    i = rng.randrange(len(fields))
    f = fields[i]
    what = rng.choice(["retype", "remove", "duplicate", "huge", "arch", "alignment", "scale"])
    if what == "retype":
        fields[i] = _retype_value(f, rng)
        label = f"{f.key}:{fields[i].vtype}={fields[i].value!r}"[:120]
    elif what == "remove":
        del fields[i]
        label = f"{f.key} removed"
    elif what == "duplicate":
        fields.insert(i, f)
        label = f"{f.key} twice"
    elif what == "huge":
        key = rng.choice(["general.big", "tokenizer.ggml.big", "tokenizer.ggml.tokens"])
        n = rng.choice([MAX_ARRAY_ITEMS + 1, MAX_TOKENIZER_ITEMS + 1, 20_000_000])
        fields = [g for g in fields if g.key != key] + [Field(key, ARRAY, np.zeros(n, np.uint8), 0)]
        label = f"{key}: {n:,} uint8"
    elif what == "arch":
        arch = rng.choice(["qwen2", "qwen3", "llama", "gpt2", "falcon", "mamba", "", "bogus"])
        fields = [replace(g, value=arch) if g.key == "general.architecture" else g for g in fields]
        label = f"architecture={arch!r}"
    elif what == "alignment":
        vtype, value = rng.choice([(4, 0), (4, 3), (4, 1), (4, 64), (10, 32), (4, 1 << 31)])
        fields.append(Field("general.alignment", vtype, value))
        neutral = vtype == 4 and value in (1, 64)  # valid: the file laid out to it
        layout = replace(base.layout, fields=fields, alignment=value if neutral else 32)
        return Case(f"field:alignment {vtype}={value}", encode(layout)[0], neutral)
    else:  # a size the config is made of, set to a value that disagrees with the tensors
        arch = base.layout.fields[0].value
        key = rng.choice(
            [
                f"{arch}.{k}"
                for k in (
                    "block_count",
                    "embedding_length",
                    "feed_forward_length",
                    "attention.head_count",
                    "attention.head_count_kv",
                    "rope.dimension_count",
                    "vocab_size",
                    "context_length",
                )
            ]
        )
        value = rng.choice([0, 1, 3, 5, 7, 48, 1000, 1 << 20, 1 << 30])
        fields = [replace(g, vtype=4, value=value) if g.key == key else g for g in fields]
        label = f"{key}={value}"
    return Case(f"field:{label}", encode(replace(base.layout, fields=fields))[0])


def _tensor(base: Base, rng: random.Random) -> Case:
    tensors = [replace(t) for t in base.layout.tensors]
    i = rng.randrange(len(tensors))
    t = tensors[i]
    nrng = np.random.default_rng(rng.randrange(1 << 30))
    what = rng.choice(["dims", "dims-fit", "kind", "kind-fit", "offset", "name", "drop", "swap"])
    if what in ("dims", "dims-fit"):
        block = gguf.GGML_QUANT_SIZES[getattr(gguf.GGMLQuantizationType, t.kind)][0]
        dims = list(t.dims)
        j = rng.randrange(len(dims))
        dims[j] = max(
            1, rng.choice([dims[j] + block, dims[j] - block, dims[j] * 2, dims[j] // 2, dims[j] + 1])
        )
        if rng.random() < 0.15:
            dims = rng.choice([dims + [1], dims + [2], dims[:1], list(reversed(dims))])
        t.dims = dims
        if what == "dims-fit" and len(dims) <= 2 and dims[0] % block == 0:
            rows = int(np.prod(dims[1:])) if len(dims) > 1 else 1
            t.data = tensor_bytes(t.kind, rows, dims[0], nrng) if len(dims) > 1 else t.data
        label = f"{t.name} dims={dims}"
    elif what in ("kind", "kind-fit"):
        t.kind = rng.choice([k.name for k in gguf.GGMLQuantizationType])
        block = gguf.GGML_QUANT_SIZES[getattr(gguf.GGMLQuantizationType, t.kind)][0]
        if what == "kind-fit" and len(t.dims) == 2 and t.dims[0] % block == 0:
            with contextlib.suppress(NotImplementedError, ValueError, KeyError, AttributeError):
                t.data = tensor_bytes(t.kind, t.dims[1], t.dims[0], nrng)  # unless gguf-py has no quantizer
        label = f"{t.name} kind={t.kind}"
    elif what == "offset":  # written into the encoded index: the data stays where it is
        data, spots = encode(base.layout)
        spot = next(p for p in spots if p.label == f"tensor {t.name} offset")
        old = struct.unpack_from("<Q", data, spot.offset)[0]
        new = max(0, rng.choice([old + 1, old + 2, old + 32, old - 32, len(data), 1 << 40, (1 << 64) - 1]))
        out = bytearray(data)
        struct.pack_into("<Q", out, spot.offset, new)
        return Case(f"tensor:{t.name} offset={new}", bytes(out))
    elif what == "name":
        t.name = rng.choice(
            [tensors[(i + 1) % len(tensors)].name, "blk.7.attn_q.weight", "bogus.weight", "", "x" * 300]
        )
        label = f"{base.layout.tensors[i].name} renamed {t.name[:40]!r}"
    elif what == "drop":
        del tensors[i]
        label = f"{t.name} dropped"
    else:
        j = rng.randrange(len(tensors))
        tensors[i], tensors[j] = tensors[j], tensors[i]  # a reordered index: the same model
        return Case(f"tensor:order {i}<->{j}", encode(replace(base.layout, tensors=tensors))[0], True)
    return Case(f"tensor:{label}", encode(replace(base.layout, tensors=tensors))[0])


def _scale(base: Base, rng: random.Random) -> Case:
    """A quantized block's float16 scale set to NaN, Inf, a denormal, zero or the largest value."""
    tensors = [replace(t) for t in base.layout.tensors]
    quantized = [t for t in tensors if t.kind in F16_SCALES]
    t = rng.choice(quantized)
    size = gguf.GGML_QUANT_SIZES[getattr(gguf.GGMLQuantizationType, t.kind)][1]
    name, bits = rng.choice(list(F16_VALUES.items()))
    block = rng.randrange(len(t.data) // size)
    at = block * size + rng.choice(F16_SCALES[t.kind])
    data = bytearray(t.data)
    struct.pack_into("<H", data, at, bits)
    t.data = bytes(data)
    return Case(f"scale:{t.name} block {block}={name}", encode(replace(base.layout, tensors=tensors))[0])


def _weight(base: Base, rng: random.Random) -> Case:
    """A float tensor's value set to NaN or +-Inf (a norm, an F16 or F32 matrix)."""
    tensors = [replace(t) for t in base.layout.tensors]
    t = rng.choice([t for t in tensors if t.kind in ("F32", "F16")])
    dtype = np.float32 if t.kind == "F32" else np.float16
    values = np.frombuffer(t.data, dtype).copy()
    j = rng.randrange(len(values))
    values[j] = rng.choice([np.nan, np.inf, -np.inf])
    t.data = values.tobytes()
    return Case(f"weight:{t.name}[{j}]={values[j]}", encode(replace(base.layout, tensors=tensors))[0])


def _shape(base: Base, rng: random.Random) -> Case:
    """Tensors whose data fits their stated shape, but the shape disagrees with the metadata."""
    tensors = [replace(t) for t in base.layout.tensors]
    by_name = {t.name: t for t in tensors}
    nrng = np.random.default_rng(rng.randrange(1 << 30))
    emb = by_name["token_embd.weight"]
    vocab, hidden = emb.dims[1], emb.dims[0]
    block = gguf.GGML_QUANT_SIZES[getattr(gguf.GGMLQuantizationType, emb.kind)][0]
    q = by_name["blk.0.attn_q.weight"]
    choices = {
        "embedding narrower than hidden": (emb, vocab, hidden - block),
        "embedding fewer rows than vocab": (emb, vocab - 16, hidden),
        "embedding more rows than vocab": (emb, vocab + 16, hidden),
        "q fewer rows": (q, q.dims[1] - 16, q.dims[0]),
        "q more rows": (q, q.dims[1] + 32, q.dims[0]),
        "k rows of q": (by_name["blk.0.attn_k.weight"], q.dims[1], q.dims[0]),
        "down transposed": (by_name["blk.0.ffn_down.weight"], *by_name["blk.0.ffn_down.weight"].dims),
    }
    if "output.weight" in by_name:
        out = by_name["output.weight"]
        choices["lm_head wider than embedding"] = (out, vocab + 64, hidden)
        choices["lm_head narrower than embedding"] = (out, vocab - 64, hidden)
    label = rng.choice(sorted(choices))
    t, rows, cols = choices[label]
    if cols % gguf.GGML_QUANT_SIZES[getattr(gguf.GGMLQuantizationType, t.kind)][0]:
        t.kind = "F32"
    t.dims = [cols, rows]
    t.data = tensor_bytes(t.kind, rows, cols, nrng)
    return Case(f"shape:{label}", encode(replace(base.layout, tensors=tensors))[0])


def _neutral(base: Base, rng: random.Random) -> Case:
    """Changes that leave the model as it was: an unused key, a reordered metadata, an unknown tensor."""
    fields, tensors = list(base.layout.fields), list(base.layout.tensors)
    what = rng.choice(["key", "order", "tensor"])
    if what == "key":
        fields.append(Field("general.fuzz_note", STRING, "x" * rng.choice([0, 1, 1000])))
    elif what == "order":
        head, rest = fields[:1], fields[1:]
        rng.shuffle(rest)
        fields = head + rest
    else:
        tensors.append(Tensor("rope_freqs.weight", [8], "F32", np.ones(8, np.float32).tobytes()))
    return Case(f"neutral:{what}", encode(replace(base.layout, fields=fields, tensors=tensors))[0], True)


MUTATIONS = {
    "spot": (_spot, 8),
    "cut": (_cut, 2),
    "append": (_append, 1),
    "flip": (_flip, 2),
    "field": (_field, 5),
    "tensor": (_tensor, 6),
    "scale": (_scale, 3),
    "weight": (_weight, 2),
    "shape": (_shape, 3),
    "neutral": (_neutral, 1),
}


def mutate(base: Base, rng: random.Random) -> Case:
    kinds = list(MUTATIONS)
    make = MUTATIONS[rng.choices(kinds, weights=[MUTATIONS[k][1] for k in kinds])[0]][0]
    return make(base, rng)


def cases(count: int, seed: int, all_bases: list[Base]) -> Iterator[tuple[Base, Case]]:
    rng = random.Random(seed)
    for _ in range(count):
        base = rng.choice(all_bases)
        yield base, mutate(base, rng)


# -- the check ------------------------------------------------------------------------------------


class NonFiniteLogits(AssertionError):
    """A record marked ok whose tokens came from NaN or infinite logits (garbage presented as success)."""


@dataclass
class Outcome:
    kind: str  # "refused" or "ran"
    detail: str  # the refusal's line, or the tokens


def greedy(path: Path) -> list[list[int] | str]:
    """Greedy completions of `PROMPTS`, each its tokens or its request's error (raises ModelLoadError
    when the file is refused). Every record is checked: ids in the vocabulary, finite logprobs."""
    from pagedinfer import LLM, SamplingParams

    llm = LLM(str(path), device="cpu", num_blocks=16, block_size=16)
    vocab = llm.engine.vocab_size
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    prompts = [{"prompt_token_ids": [t % vocab for t in p]} for p in PROMPTS]
    out: list[list[int] | str] = []
    for o in llm.generate(prompts, params, use_tqdm=False):
        if o.error is not None:  # e.g. a context of one token, or logits that turn non-finite later
            assert o.error and "\n" not in o.error, o
            for c in o.outputs:  # what came before a failure was drawn from finite logits
                assert all(
                    math.isfinite(lp[t].logprob) for lp, t in zip(c.logprobs, c.token_ids, strict=True)
                ), o
            out.append(o.error)
            continue
        (c,) = o.outputs
        assert 1 <= len(c.token_ids) <= MAX_TOKENS and c.finish_reason == "length", c
        assert all(0 <= t < vocab for t in c.token_ids), c.token_ids
        if not all(math.isfinite(lp[t].logprob) for lp, t in zip(c.logprobs, c.token_ids, strict=True)):
            raise NonFiniteLogits(f"tokens {c.token_ids} sampled from NaN or infinite logits: {c.logprobs}")
        out.append(list(c.token_ids))
    return out


def check(path: Path, case: Case, base: Base) -> Outcome:
    """Load and run one mutated file: a one-line refusal naming the file, or correct records. Any other
    exception is a failure and propagates."""
    from pagedinfer.model.loader import ModelLoadError

    try:
        tokens = greedy(path)
    except ModelLoadError as e:
        line = str(e)
        assert line and "\n" not in line, f"{case.name}: a refusal of more than one line: {line!r}"
        assert str(path) in line or path.name in line, (
            f"{case.name}: the refusal does not name the file: {line}"
        )
        return Outcome("refused", line)
    if case.neutral:
        assert tokens == base.neutral_tokens, f"{case.name}: {tokens} != the base's {base.neutral_tokens}"
    return Outcome("ran", json.dumps(tokens))
