"""What decides the bytes of a run's records, as one hash, and whether the run is on the path the
reproducibility contract covers (docs/reproducibility.md).

``system_fingerprint`` (OpenAI's name) hashes the model's files, the dtype, the KV cache dtype, the
code path that computes (device, whose layers, where each linear and the attention run, the panels'
weight formats: the quantization), `NUMERICS_VERSION`, a probe of the C kernels' own rounding, the
versions of torch, transformers and tokenizers, and MKL's code path where it follows the CPU (`mkl_branch`).
Two runs with the same fingerprint and the same seeds write the same records, whatever their batch
settings, threads, replicas or interruptions (on a covered path); two runs whose fingerprints differ
need not agree. Batch settings, threads and the CPU's model are left out on purpose: the contract
says they change nothing.

The model's files are read once per process and file state; the loader's hashes are reused (a GGUF
file's SHA-256), and a hub model's cached files are named by their content hash already.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.metadata
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedinfer.kernels import paged_decode
from pagedinfer.lora import delta
from pagedinfer.model import fused_ops
from pagedinfer.model.dtype import dtype_name
from pagedinfer.model.packed_linear import PackedLinear

if TYPE_CHECKING:
    from pagedinfer.engine.llm_engine import LLMEngine
    from pagedinfer.model.loader import LoadedModel

# Bump when a change makes any path compute other bits for the same inputs (a kernel's order of sums or
# its roundings, the sampler's draw, how logprobs are normalised, how a seed is derived): the records
# made before and after it then carry different fingerprints.
NUMERICS_VERSION = 3
# files of a checkpoint folder that decide the outputs: weights, configs, tokenizer files, templates
DECIDING = ("*.safetensors", "*.json", "*.jinja", "*.model", "*.txt", "*.tiktoken")
PROBE_WIDTHS = (64, 256, 576, 1000)  # hidden sizes the norm probe sums over
MKL_CBWR_BRANCH, MKL_CBWR_COMPATIBLE = 1, 3  # mkl_cbwr.h: the code-path query, and the one path


@dataclass(frozen=True)
class Reproducibility:
    """Whether a run is on the path the contract covers, and in a few words why (not)."""

    covered: bool
    why: str

    def words(self) -> str:
        return f"{'yes' if self.covered else 'no'}: {self.why}"


def system_fingerprint(engine: LLMEngine, adapter: str | None = None) -> str:
    """``fp_`` and 16 hex digits of `components` (the base model's, or with ``adapter``'s files)."""
    text = json.dumps(components(engine, adapter), sort_keys=True)
    return "fp_" + hashlib.sha256(text.encode()).hexdigest()[:16]


def components(engine: LLMEngine, adapter: str | None = None) -> dict:
    """What `system_fingerprint` hashes, by name."""
    loaded = engine.loaded
    template = getattr(loaded.tokenizer, "chat_template", None)  # the file's, or --chat-template's
    parts = {
        "numerics": NUMERICS_VERSION,
        "model": model_digest(loaded),
        "chat_template": None if template is None else _digest(json.dumps(template).encode()),
        "dtype": dtype_name(loaded.dtype),
        "kv_cache_dtype": dtype_name(engine.kv.dtype),
        "device": loaded.device.type,
        "impl": loaded.impl,
        "linears": linear_paths(loaded.model),
        "attention": "C kernel" if _c_attention(engine) else "torch",
        "kernel_probe": kernel_probe() if loaded.device.type == "cpu" else None,
        "libraries": libraries(),
    }
    if loaded.device.type == "cpu" and mkl_branch() == "the CPU's":  # absent on the covered path
        parts["mkl"] = "the CPU's"
    if adapter is not None:
        parts["adapter"] = engine.lora.named[adapter].digest.hex()  # its scaling and weights
        parts["lora_deltas"] = "C kernel" if _c_deltas(engine) else "torch"
    return parts


def reproducibility(engine: LLMEngine) -> Reproducibility:
    """Whether the run is on the covered path: pagedinfer's own layers on the CPU, every linear on the
    C panels, attention in the C kernel and, with LoRA, the adapters' deltas in theirs."""
    loaded = engine.loaded
    if loaded.device.type != "cpu":
        return Reproducibility(False, f"on {loaded.device.type}, whose kernels the contract does not cover")
    if not _c_attention(engine):
        return Reproducibility(False, "attention runs on torch's path (no C kernel for this pool or shape)")
    if loaded.impl != "pagedinfer":
        family = getattr(loaded.model.config, "model_type", "?")
        other = [p for p in linear_paths(loaded.model) if not p.startswith("panels")]
        where = f"; its matrices on {', '.join(other)} vary with the batch" if other else ""
        return Reproducibility(False, f"transformers' {family} layers (outside the contract){where}")
    other = [p for p in linear_paths(loaded.model) if not p.startswith("panels")]
    if other:
        return Reproducibility(False, f"linears on {', '.join(other)}, not the C panels")
    if mkl_branch() == "the CPU's":
        return Reproducibility(
            False,
            "MKL (the sampler's exp and logsumexp) on the CPU's own code path: MKL_CBWR is not"
            " COMPATIBLE (set otherwise, or MKL ran before pagedinfer was imported)",
        )
    if engine.lora is not None and not _c_deltas(engine):
        return Reproducibility(
            True, "own layers and C kernels on the CPU; lines with a LoRA adapter excepted (deltas on torch)"
        )
    return Reproducibility(True, "own layers and C kernels on the CPU")


def mkl_branch() -> str | None:
    """MKL's code path for torch's VML calls (float32 exp, log, ...) and BLAS: ``"COMPATIBLE"``, the
    same on every x86-64 CPU, as pagedinfer's import asks (``MKL_CBWR``); ``"the CPU's"``, chosen by
    the CPU, each rounding its own way; None where torch has no MKL (or does not export its query)."""
    get = _mkl_cbwr_get()
    if get is None:
        return None
    return "COMPATIBLE" if get(MKL_CBWR_BRANCH) == MKL_CBWR_COMPATIBLE else "the CPU's"


@functools.cache
def _mkl_cbwr_get():
    """MKL's ``mkl_cbwr_get``, as torch's library links it in (None: not there)."""
    if not torch.backends.mkl.is_available():
        return None
    try:
        return ctypes.CDLL(
            os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
        ).mkl_serv_cbwr_get
    except (OSError, AttributeError):
        return None


def linear_paths(model: nn.Module) -> list[str]:
    """Where the model's matrices are multiplied: ``panels:F32`` (and the panels' other formats:
    ``BF16``, ``I8``, ``I4/g32``, GGUF types; ``panels:Q4_0 llama.cpp numerics`` under
    ``--matmul-numerics llama.cpp``), ``oneDNN``, or ``torch (Linear, ...)``: the modules whose
    matrices are left to torch (MKL)."""
    paths, left = set(), set()
    for module in model.modules():
        if isinstance(module, PackedLinear):
            kinds = (
                f"panels:{s.kind}"
                + (f"/g{s.group}" if s.group else "")
                + (" llama.cpp numerics" if s.q8_dot else "")
                for s in module.segments or []
            )
            paths.update(kinds if module.segments else ["oneDNN"])
        elif not isinstance(module, nn.Embedding) and any(
            p.dim() >= 2 for p in module.parameters(recurse=False)
        ):
            left.add(type(module).__name__)
    return sorted(paths) + ([f"torch ({', '.join(sorted(left))})"] if left else [])


def model_digest(loaded: LoadedModel) -> str:
    """The loader's digest (a GGUF file, dummy weights), else the digest of the checkpoint folder's files."""
    if loaded.content_digest:
        return loaded.content_digest
    folder = _folder(loaded.name)
    return f"unread:{loaded.name}" if folder is None else folder_digest(folder)  # named, as a last resort


def folder_digest(folder: Path) -> str:
    """SHA-256 over the deciding files of ``folder`` (names and contents); a file the Hugging Face cache
    keeps as a link to ``blobs/<hash>`` is taken by that name (its content hash) without reading it."""
    files = sorted({f for pattern in DECIDING for f in folder.glob(pattern) if f.is_file()})
    if not any(f.suffix == ".safetensors" for f in files):
        files += sorted(f for f in folder.glob("*.bin") if f.is_file())
    entries = []
    for f in files:
        real = Path(os.path.realpath(f))
        if real.parent.name == "blobs":
            entries.append((f.name, real.name))
        else:
            st = real.stat()
            entries.append((f.name, _file_digest(str(real), st.st_size, st.st_mtime_ns)))
    return "sha256:" + _digest(json.dumps(entries).encode())


@functools.cache
def kernel_probe() -> str | None:
    """A digest of the C RMSNorm's results on fixed inputs (None without the C kernels). Its sum of
    squares is taken in a fixed order, the same bits in every build; a build that rounds it otherwise
    (a compiler that leaves its multiply-adds unfused, say) then shows in the fingerprint."""
    rows = []
    for width in PROBE_WIDTHS:
        n = torch.arange(4 * width, dtype=torch.int64)
        x = ((n * 2654435761 % 65521) - 32760).to(torch.float32).div_(8192).view(4, width)  # exact values
        if not fused_ops.use_c(x):
            return None
        w = (torch.arange(width, dtype=torch.int64) % 7 + 1).to(torch.float32).div_(4)
        rows.append(fused_ops.add_rms_norm(x, None, w, 1e-6, fast=True))
    return _digest(b"".join(r.numpy().tobytes() for r in rows))[:16]


@functools.cache
def libraries() -> dict[str, str]:
    """The versions of the libraries whose code computes part of a record: torch (RoPE's angles, the
    log-normaliser of logprobs, the filtered sampler), transformers (its layers, the rotary classes),
    tokenizers (prompt tokens, text). transformers' is its installed distribution's (the version its
    package states), read without importing it: a run that needs none of its code does not load it."""
    import tokenizers

    return {
        "torch": torch.__version__,
        "transformers": importlib.metadata.version("transformers"),
        "tokenizers": tokenizers.__version__,
    }


def _c_attention(engine: LLMEngine) -> bool:
    loaded, kv = engine.loaded, engine.kv
    config = loaded.model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", 0)
    return loaded.device.type == "cpu" and all(
        paged_decode.available(loaded.dtype, kv.dtype)
        and paged_decode.supports(heads, s.num_kv_heads, s.head_dim, s.head_dim_v, engine.pool.block_size)
        for s in loaded.layer_shapes.values()
    )


def _c_deltas(engine: LLMEngine) -> bool:
    """LoRA deltas go through kernels/cpu_lora.c (activations it takes, on the CPU)."""
    loaded = engine.loaded
    return loaded.device.type == "cpu" and loaded.dtype in delta.SUFFIX and delta.library() is not None


def _folder(name: str) -> Path | None:
    """The folder a model was loaded from: a local path, or a hub id's snapshot in the local cache
    (None when neither is found)."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(name, "config.json")
    return Path(found).parent if isinstance(found, str) else None


@functools.cache  # per file state: a file is read once per process
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
