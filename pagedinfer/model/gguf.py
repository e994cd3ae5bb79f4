"""GGUF checkpoints (the single-file format of llama.cpp, Ollama, LM Studio): read once, cached by content.

A GGUF file holds the model's config and tokenizer (with its chat template) as metadata, and its
tensors, usually quantized in blocks. Parsing that metadata is what took the time: gguf-py's reader
builds a view per array element (the 49k-token vocabulary of SmolLM2 included), and transformers
parses the file again for the config and again for the tokenizer (13-19 s each on two loaded
cores, against 4 s to dequantize every tensor). So the first load of a file reads it once with
gguf-py's memory-mapped reader for its tensor index and once through transformers for config and
tokenizer, and writes what it found (config.json, generation_config.json, the tokenizer files, and
tensors.json: each tensor's type, shape and offset) into a cache folder named by the file's SHA-256
(``$PAGEDINFER_GGUF_CACHE``, default ``~/.cache/pagedinfer/gguf``); a later load hashes the file and
reads the folder and the tensors' bytes straight from a memory map.

`state_dict` gives the tensors under Hugging Face names: quantized tensors of the types the panels
keep (`gguf_blocks.BLOCKS`) as their blocks (`GGUFWeight`), everything else dequantized by gguf-py
(norms are float32 already). `convert` still writes a plain float32 model directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import mmap
import os
import shutil
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from pagedinfer import envs
from pagedinfer.errors import first_line
from pagedinfer.model.dtype import dtype_name
from pagedinfer.model.gguf_blocks import BLOCKS, GGUFWeight
from pagedinfer.terminal import keep, note

EXTRA = "gguf"
PACKAGES = ("gguf", "accelerate")
CACHE_VERSION = 1  # bump when the cache folder's contents change
MAGIC = b"GGUF"
# Hugging Face names of a Llama-family layer's tensors (gguf-py's name map gives the GGUF ones)
LAYER_TENSORS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "self_attn.q_norm",
    "self_attn.k_norm",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
    "input_layernorm",
    "post_attention_layernorm",
)


class GGUFError(ValueError):
    """A GGUF file that cannot be read; the message names the file and what is wrong."""


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


@dataclass
class TensorInfo:
    name: str
    kind: str  # gguf-py's type name: F32, F16, BF16, Q4_1, Q6_K, ...
    shape: list[int]  # numpy order: [rows, in] for a matrix (GGUF's ne reversed)
    offset: int  # of its bytes in the file
    nbytes: int


@dataclass
class GGUFCheckpoint:
    """An opened GGUF file: its tensor index, its architecture, and the cache folder holding its config
    and tokenizer (what ``from_pretrained`` reads)."""

    path: Path
    arch: str  # general.architecture: llama (mistral too), qwen2, qwen3, ...
    tensors: dict[str, TensorInfo]
    folder: Path
    digest: str = (
        ""  # the file's SHA-256 (hex), hashed once per load: its cache folder's name, its fingerprint
    )
    _map: mmap.mmap | None = field(default=None, repr=False)

    def kinds(self, matrices_only: bool = True) -> Counter:
        """How many tensors of each type (matrices only: the norms are float32 vectors)."""
        return Counter(t.kind for t in self.tensors.values() if len(t.shape) > 1 or not matrices_only)

    def raw(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes in the file, ``[rows, row bytes]`` (a view of the memory map)."""
        if self._map is None:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
        return np.frombuffer(self._map, np.uint8, info.nbytes, info.offset).reshape(rows, -1)

    def release(self, info: TensorInfo) -> None:
        """Drop the tensor's pages from this process's memory (they stay in the page cache)."""
        if self._map is None:
            return
        start = info.offset // mmap.PAGESIZE * mmap.PAGESIZE
        end = -(-(info.offset + info.nbytes) // mmap.PAGESIZE) * mmap.PAGESIZE
        with contextlib.suppress(OSError, ValueError):
            self._map.madvise(mmap.MADV_DONTNEED, start, min(end, len(self._map)) - start)


def file_digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def open_checkpoint(path: Path) -> GGUFCheckpoint:
    """Validate ``path``, and fill its cache folder on first use; `GGUFError` names what is wrong."""
    with open(path, "rb") as f:
        head = f.read(4)
    if head != MAGIC:
        raise GGUFError(
            f"{path} is not a GGUF file: it does not start with the GGUF magic bytes (got {head!r})"
        )
    digest = file_digest(path)
    folder = envs.gguf_cache() / f"{digest[:32]}-v{CACHE_VERSION}"
    index = folder / "tensors.json"
    if not index.exists():
        _fill_cache(path, folder)
    doc = json.loads(index.read_text())
    tensors = {t["name"]: TensorInfo(**t) for t in doc["tensors"]}
    return GGUFCheckpoint(path, doc["arch"], tensors, folder, digest)


def _fill_cache(path: Path, folder: Path) -> None:
    """Read ``path`` once with gguf-py and transformers and write the cache folder (atomically)."""
    import gguf
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    try:
        reader = gguf.GGUFReader(path)
        arch = str(reader.get_field(gguf.Keys.General.ARCHITECTURE).contents())
    except Exception as e:  # noqa: BLE001 - any parse failure of a corrupt file is one line
        why = first_line(e)
        if "reshape" in why:  # gguf-py's views of tensor data the file does not hold
            why = f"its tensor data is cut short at {path.stat().st_size:,} bytes (a truncated download?)"
        raise GGUFError(f"{path} is not a valid GGUF file: {why}") from None
    tensors = [
        {
            "name": t.name,
            "kind": t.tensor_type.name,
            "shape": [int(n) for n in reversed(t.shape.tolist())],
            "offset": int(t.data_offset),
            "nbytes": int(t.n_bytes),
        }
        for t in reader.tensors
    ]
    del reader
    folder_in, kwargs = source(path)
    try:
        config = AutoConfig.from_pretrained(folder_in, **kwargs)
    except Exception as e:  # noqa: BLE001
        raise GGUFError(f"{path}: cannot read the model config from its metadata: {first_line(e)}") from None
    tmp = folder.with_name(f"{folder.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config.save_pretrained(tmp)
    GenerationConfig.from_model_config(config).save_pretrained(tmp)
    with contextlib.suppress(Exception):  # no (usable) tokenizer metadata: token-id prompts only
        AutoTokenizer.from_pretrained(folder_in, **kwargs).save_pretrained(tmp)
    (tmp / "tensors.json").write_text(json.dumps({"arch": arch, "tensors": tensors}))
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)


def hf_names(arch: str, layers: int) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face name, for the Llama-family tensors of ``arch``."""
    import gguf

    key = next((k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), None)
    if key is None:
        return {}
    names = gguf.get_tensor_name_map(key, layers)
    stems = ["model.embed_tokens", "model.norm", "lm_head"]
    stems += [f"model.layers.{i}.{t}" for i in range(layers) for t in LAYER_TENSORS]
    out = {}
    for stem in stems:
        g = names.get_name(stem)
        if g is not None:
            out |= {f"{g}.weight": f"{stem}.weight", f"{g}.bias": f"{stem}.bias"}
    return out


def _reverse_permute(a: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's converter's Q/K row permutation (as transformers' GGUF loader does), on rows."""
    w = a.reshape(heads, a.shape[0] // heads // 2, 2, *a.shape[1:])
    return w.swapaxes(2, 1).reshape(a.shape)


def state_dict(
    ckpt: GGUFCheckpoint, config, keep_blocks: bool, dtype: torch.dtype = torch.float32
) -> tuple[dict[str, torch.Tensor | GGUFWeight], Counter]:
    """The Llama-family tensors under Hugging Face names, and the types that were dequantized.

    ``keep_blocks``: matrices of a type in `gguf_blocks.BLOCKS` stay as their blocks (`GGUFWeight`,
    for the panels, multiplied under ``dtype`` activations: float32 or bfloat16), the other tensors
    are dequantized to ``dtype``; else every tensor is dequantized to ``dtype``. Q and K rows are
    un-permuted for llama files, as transformers does."""
    import gguf

    names = hf_names(ckpt.arch, config.num_hidden_layers)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    sd: dict[str, torch.Tensor | GGUFWeight] = {}
    dequantized: Counter = Counter()
    bf16_io = dtype == torch.bfloat16  # kept blocks multiplied under bfloat16 activations
    for info in ckpt.tensors.values():
        hf = names.get(info.name)
        if hf is None:  # e.g. rope_freqs: transformers ignores it too
            continue
        raw = ckpt.raw(info)
        permute = None
        if ckpt.arch == "llama" and (".attn_q." in info.name or ".attn_k." in info.name):
            permute = heads if ".attn_q." in info.name else kv_heads
        if keep_blocks and info.kind in BLOCKS and len(info.shape) == 2:
            data = raw if permute is None else _reverse_permute(raw, permute)
            sd[hf] = GGUFWeight(info.kind, data, info.shape[1], lambda i=info: ckpt.release(i), bf16_io)
            continue
        if len(info.shape) > 1 and info.kind != "F32":
            dequantized[info.kind] += 1
        kind = getattr(gguf.GGMLQuantizationType, info.kind)
        values = (
            gguf.quants.dequantize(raw.reshape(-1), kind).reshape(info.shape).astype(np.float32, copy=False)
        )
        if permute is not None:
            values = _reverse_permute(values, permute)
        sd[hf] = torch.from_numpy(np.array(values, dtype=np.float32)).to(dtype)
        ckpt.release(info)
    return sd, dequantized


def dequantized_note(path: Path, kinds: Counter, dtype: torch.dtype = torch.float32) -> None:
    """One line on stderr naming the matrices' types that were dequantized (to ``dtype``)."""
    if kinds:
        listed = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
        note(
            f"pagedinfer: {keep(path.name)}: tensors of types the panels do not keep ({listed}) are dequantized "
            f"to {dtype_name(dtype)}; kept as stored: {', '.join(BLOCKS)}"
        )


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
