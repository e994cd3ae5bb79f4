#!/usr/bin/env python
"""A GGUF file at a published model's real shape, random weights from a seed, written without a float copy.

    python scripts/make_real_shape_gguf.py --family olmoe|gemma3 [--type Q4_0|Q8_0|BF16] [--seed 0]
        [--tokenizer FILE.gguf] --out FILE

For benchmarks on the file both pagedinfer and llama.cpp load (scripts/bench_llamacpp.py --gguf),
at a size no float checkpoint of it fits in memory beside (OLMoE-1B-7B: 28 GB in float32). So no
float tensor is quantized in Python: each quantized matrix's blocks are drawn straight from the seeded
generator (random nibbles or int8 values, float16 scales whose spread gives weights of about
``WEIGHT_STD``; BF16: N(0, WEIGHT_STD) truncated), one tensor in memory at a time. The tensors are
those the family's declaration (`pagedinfer.model.families`) names, in llama.cpp's layout (experts
stacked in 3-D ``*_exps`` tensors), the metadata tests/gguf_models.py's writer gives a config (Gemma
3's keys included). Every matrix is in ``--type`` but an untied token embedding (float32, a lookup;
a tied one is the output matrix too, in ``--type``) and a mixture of experts' router (float32, as
llama-quantize keeps ``ffn_gate_inp``); the norms are float32 ones, a multiplier of 1 (for Gemma 3,
whose files store each norm's 1 + weight, its initial weight 0).

Shapes (``--family``): olmoe, OLMoE-1B-7B's (allenai/OLMoE-1B-7B-0924, scripts/bench_moe.py's shape
with its 16 layers); gemma3, Gemma-3-1B's (google/gemma-3-1b-it: `GEMMA3_1B`).

Tokenizer: llama.cpp loads no file without one, and its vocabulary must be the embedding's rows.
``--tokenizer`` names a GGUF whose ``tokenizer.*`` metadata is copied (default: SmolLM2-135M-Instruct's,
vocabulary 49152, the file scripts/bench_llamacpp.py uses), its token list padded with unused tokens
(``<|unused_N|>``, type UNUSED) up to the shape's vocabulary, so the embedding and lm_head keep the
real model's rows; the text a prompt decodes to is SmolLM2's, not the real model's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import transformers as tf

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "tests")]  # scripts/bench_moe.py, tests/gguf_models.py

from bench_moe import SHAPES  # noqa: E402
from gguf_models import config_writer  # noqa: E402

from pagedinfer.model import families  # noqa: E402
from pagedinfer.model.families.spec import EMBED, LM_HEAD, Family, Module  # noqa: E402
from pagedinfer.model.gguf_header import ArrayValue, read  # noqa: E402
from pagedinfer.model.validate import sizes  # noqa: E402

REAL_LAYERS = {"olmoe": 16}  # --family -> the published model's layer count
GEMMA3_1B = dict(  # google/gemma-3-1b-it's config
    vocab_size=262_144,
    hidden_size=1152,
    intermediate_size=6912,
    num_hidden_layers=26,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=256,
    max_position_embeddings=32_768,
    sliding_window=512,
    layer_types=["sliding_attention" if i % 6 < 5 else "full_attention" for i in range(26)],  # pattern 6
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
    },
    query_pre_attn_scalar=256,
    tie_word_embeddings=True,
)
FAMILIES = (*REAL_LAYERS, "gemma3")
TYPES = ("Q4_0", "Q8_0", "BF16")
WEIGHT_STD = 0.02  # the drawn matrices' spread (transformers' initializer_range)
EMBED_STD = 0.02
UNUSED = 5  # llama.cpp's token type of a padding token (LLAMA_TOKEN_TYPE_UNUSED)


def real_config(family: str) -> tf.PretrainedConfig:
    """The published model's config (its shape, every layer)."""
    if family == "gemma3":
        return tf.Gemma3TextConfig(**GEMMA3_1B)
    cls, shape = SHAPES[family]
    return cls(**shape, num_hidden_layers=REAL_LAYERS[family])


def tensors(config) -> list[tuple[str, tuple[int, ...], Module]]:
    """(GGUF name, numpy shape, module) of every tensor ``config``'s family declares for its model:
    weights (an experts' module stacked [experts, rows, in]), required biases [rows]; the lm_head
    unless the embedding is tied."""
    family = families.find(config)
    s = sizes(config, "the config")
    out = []

    def add(prefix: str, m: Module) -> None:
        for suffix, dims, required in m.tensors():
            if required or (m.hf == LM_HEAD and not config.tie_word_embeddings):
                weight = suffix == m.suffixes[0]
                shape = (s.experts, *s.shape(dims)) if m.experts and weight else s.shape(dims)
                out.append((f"{prefix}{m.gguf}{suffix}", shape, m))  # suffix: ".weight", ".bias"

    for m in family.top:
        add("", m)
    for i in range(s.layers):
        for m in family.layer_at(config, i):
            add(f"blk.{i}.", m)
    return out


def kind_of(shape: tuple[int, ...], m: Module, family: Family, kind: str, tied: bool) -> str:
    """The GGUF type a tensor is written in: ``kind`` for the matrices, float32 for the vectors, the
    router and an embedding not ``tied`` to the output (a lookup)."""
    router = family.experts is not None and m.hf == family.experts.router
    return "F32" if len(shape) < 2 or (m.hf == EMBED and not tied) or router else kind


def random_blocks(rng: np.random.Generator, shape: tuple[int, ...], kind: str) -> np.ndarray:
    """``shape`` (numpy order, the last a multiple of 32) as ``kind`` blocks drawn from ``rng``:
    uint8 [..., rows, row bytes]. Q4_0: a float16 scale d and 32 nibbles q, values (q - 8) * d (the
    nibbles' spread 4.6 d); Q8_0: d and 32 int8 values q * d (spread 73 d); BF16: N(0, WEIGHT_STD)
    values truncated to bfloat16, two bytes each."""
    if kind == "BF16":
        x = rng.standard_normal(shape, dtype=np.float32)
        x *= np.float32(WEIGHT_STD)
        return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)  # the top half of each float
    blocks = int(np.prod(shape)) // 32
    quants, spread = (16, 4.6) if kind == "Q4_0" else (32, 73.0)
    d = rng.normal(0.0, WEIGHT_STD / spread, blocks).astype(np.float16)
    out = np.empty((blocks, 2 + quants), np.uint8)  # one block a row: d, then the quants
    out[:, :2] = d.view(np.uint8).reshape(blocks, 2)
    out[:, 2:] = np.frombuffer(rng.bytes(blocks * quants), np.uint8).reshape(blocks, quants)
    return out.reshape(*shape[:-1], -1)


def copy_tokenizer(writer, source: Path, vocab: int) -> None:
    """``source``'s ``tokenizer.*`` metadata into ``writer``, its tokens padded to ``vocab``."""
    import gguf

    header = read(source)
    tokens = header.metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, ArrayValue) or len(tokens.items) > vocab:
        raise SystemExit(f"{source}: no tokenizer.ggml.tokens of at most {vocab} tokens to borrow")
    pad = vocab - len(tokens.items)
    for key, value in header.metadata.items():
        if not key.startswith("tokenizer."):
            continue
        kind, sub = header.types[key], None
        if isinstance(value, ArrayValue):
            sub, items = value.item_type, list(value.items)
            if key == "tokenizer.ggml.tokens":
                items += [f"<|unused_{i}|>" for i in range(len(items), vocab)]
            elif key == "tokenizer.ggml.token_type":
                items += [UNUSED] * pad
            elif key == "tokenizer.ggml.scores":
                items += [0.0] * pad
            value = items
        writer.add_key_value(key, value, gguf.GGUFValueType(kind), sub_type=sub and gguf.GGUFValueType(sub))


def write(config, out: Path, kind: str = "Q4_0", seed: int = 0, tokenizer: Path | None = None) -> Path:
    """``config``'s model with random weights as a GGUF file at ``out`` (written beside it, then
    renamed): matrices in ``kind`` (`kind_of`), the tokenizer of ``tokenizer`` (a GGUF file; None:
    no tokenizer, token-id prompts only)."""
    import gguf

    if kind not in TYPES:
        raise SystemExit(f"--type {kind}: choose from {', '.join(TYPES)}")
    family = families.find(config)
    rng = np.random.default_rng(seed)
    tmp = out.with_name(out.name + ".tmp")
    writer = config_writer(config, tmp, f"random-{config.model_type}")
    writer.add_file_type(getattr(gguf.LlamaFileType, f"MOSTLY_{kind}"))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if tokenizer is not None:
        copy_tokenizer(writer, tokenizer, config.vocab_size)
    tied = config.tie_word_embeddings
    planned = [(name, shape, kind_of(shape, m, family, kind, tied)) for name, shape, m in tensors(config)]
    for name, shape, k in planned:
        qtype = getattr(gguf.GGMLQuantizationType, k)
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(shape)) // block * size
        if k == "F32":
            writer.add_tensor_info(name, shape, np.dtype(np.float32), nbytes)
        else:  # the shape in bytes, as gguf-py takes a quantized tensor's
            writer.add_tensor_info(
                name, (*shape[:-1], shape[-1] // block * size), np.dtype(np.uint8), nbytes, qtype
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, shape, k in planned:  # one tensor in memory at a time, in the order of the header
        if k != "F32":
            data = random_blocks(rng, shape, k)
        elif name.endswith(".bias"):
            data = np.zeros(shape, np.float32)
        elif len(shape) == 1:
            data = np.ones(shape, np.float32)  # the norms' weights
        else:
            data = rng.standard_normal(shape, dtype=np.float32) * np.float32(EMBED_STD)
        writer.write_tensor_data(data)
    writer.close()
    tmp.rename(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=FAMILIES, default="olmoe")
    ap.add_argument("--type", default="Q4_0", choices=TYPES, help="the matrices' GGUF type")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--tokenizer", type=Path, help="a GGUF file whose tokenizer to borrow (default: SmolLM2's)"
    )
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    if a.tokenizer is None:
        import bench_llamacpp

        a.tokenizer = bench_llamacpp.q4_gguf(Path.home() / ".cache" / "pagedinfer-llamacpp")
    write(real_config(a.family), a.out, a.type, a.seed, a.tokenizer)
    print(a.out)


if __name__ == "__main__":
    main()
