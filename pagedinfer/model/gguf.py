"""GGUF checkpoints (the single-file format of llama.cpp, Ollama, LM Studio): read once, cached by content.

A GGUF file holds the model's config and tokenizer (with its chat template) as metadata, and its
tensors, usually quantized in blocks. The first load of a file reads its header once with
`gguf_header` (its own bounded walk: limits on counts and lengths, tensors inside the file), which
gives the tensor index and every metadata value; transformers builds the config from those values
through a stand-in for gguf-py's reader (`_HeaderReader`: gguf-py's own builds a numpy view per array
item, the vocabulary's included, and that parse was the first load's cost), and the tokenizer with
its own GGUF metadata reader. What it finds (config.json,
generation_config.json, the tokenizer files, and tensors.json: each tensor's type, shape and offset)
goes into a cache folder named by the file's SHA-256 (``$PAGEDINFER_GGUF_CACHE``, default
``~/.cache/pagedinfer/gguf``); a later load finds the digest by the file's identity (hashed once per
version of the file), reads the folder, the tensors' bytes straight from a memory map, and the
panels packed from them by an earlier load (`panel_cache`).

`state_dict` gives the tensors under Hugging Face names: quantized tensors of the types the panels
keep (`gguf_blocks.BLOCKS`) as their blocks (`GGUFWeight`), everything else dequantized by gguf-py
(norms are float32 already; gguf-py is imported only for a quantized type). `convert` still writes
a plain float32 model directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import mmap
import os
import re
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from pagedinfer import envs
from pagedinfer.errors import one_line
from pagedinfer.model import families
from pagedinfer.model.dtype import dtype_name
from pagedinfer.model.families.spec import HF_LAYER, Family, Module
from pagedinfer.model.gguf_blocks import BLOCKS, GGUFWeight
from pagedinfer.model.gguf_header import ARRAY, STRING, ArrayValue, Header, HeaderError, TensorInfo, read
from pagedinfer.model.panel_cache import PanelCache
from pagedinfer.model.validate import Found, ModelCheckError, check_metadata, sizes
from pagedinfer.terminal import keep, note

EXTRA = "gguf"
PACKAGES = ("gguf", "accelerate")
CACHE_VERSION = 6  # bump when the cache folder's contents change
MAGIC = b"GGUF"
FLOATS = ("F32", "F16")  # read without gguf-py
SETTLED_S = 2.0  # a file modified this recently is hashed on every load (see `_known_digest`)


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


def _known_digest(path: Path) -> str:
    """The file's SHA-256, hashed once per file identity: its device, inode, size, and modification and
    change times (a write changes them; the change time cannot be set back). The digest is kept under
    ``digests/`` in the cache, named by the identity, and written only once the file is `SETTLED_S` old,
    so that a write within the file system's clock tick of the hashing is not missed."""
    st = path.stat()
    identity = f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{path.resolve()}"
    kept = envs.gguf_cache() / "digests" / hashlib.sha256(identity.encode()).hexdigest()[:32]
    with contextlib.suppress(OSError, UnicodeDecodeError):
        digest = kept.read_text(encoding="ascii")
        if re.fullmatch(r"[0-9a-f]{64}", digest):
            return digest
    digest = file_digest(path)
    if time.time() - max(st.st_mtime, st.st_ctime) > SETTLED_S:
        tmp = kept.with_name(f"{kept.name}.{os.getpid()}.tmp")
        with contextlib.suppress(OSError):
            kept.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(digest, encoding="ascii")
            os.replace(tmp, kept)
    return digest


def open_checkpoint(path: Path) -> GGUFCheckpoint:
    """Validate ``path``, and fill its cache folder on first use; `GGUFError` names what is wrong."""
    with open(path, "rb") as f:
        head = f.read(4)
    if head != MAGIC:
        raise GGUFError(
            f"{path} is not a GGUF file: it does not start with the GGUF magic bytes (got {head!r})"
        )
    digest = _known_digest(path)
    folder = envs.gguf_cache() / f"{digest[:32]}-v{CACHE_VERSION}"
    index = folder / "tensors.json"
    if not index.exists():
        _fill_cache(path, folder)
    doc = json.loads(index.read_text())
    tensors = {t["name"]: TensorInfo(**t) for t in doc["tensors"]}
    return GGUFCheckpoint(path, doc["arch"], tensors, folder, digest)


def _fill_cache(path: Path, folder: Path) -> None:
    """Read ``path`` once with `gguf_header` (within its limits) and transformers and write the cache
    folder (atomically)."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    try:  # within limits, before gguf-py and transformers parse it (they trust its counts and lengths)
        header = read(path)
    except HeaderError as e:
        raise GGUFError(f"{path} is not a valid GGUF file: {e}") from None
    family = families.by_gguf_arch(header.arch, header.metadata)
    for t in header.tensors:
        if family is not None and t.name in family.gguf_refused_with:
            raise GGUFError(f"{path}: tensor {t.name} is refused: {family.gguf_refused_with[t.name]}")
    try:
        check_metadata(header.metadata, header.types, len(header.tensors), str(path))
    except ModelCheckError as e:
        raise GGUFError(str(e)) from None
    tensors = [asdict(t) for t in header.tensors]
    folder_in, kwargs = source(path)
    tmp = folder.with_name(f"{folder.name}.{os.getpid()}.tmp")
    with _HeaderReader.standing_in(_read_as(header)):
        try:
            config = AutoConfig.from_pretrained(folder_in, **kwargs)
        except Exception as e:  # noqa: BLE001
            raise GGUFError(
                f"{path}: cannot read the model config from its metadata: {one_line(e)}"
            ) from None
        config = _family_config(config, header.metadata, header.arch, path)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        config.save_pretrained(tmp)
        GenerationConfig.from_model_config(config).save_pretrained(tmp)
        with contextlib.suppress(Exception):  # no (usable) tokenizer metadata: token-id prompts only
            _file_tokenizer(header, AutoTokenizer.from_pretrained, folder_in, kwargs).save_pretrained(tmp)
            _name_added_tokens(tmp)
    (tmp / "tensors.json").write_text(json.dumps({"arch": header.arch, "tensors": tensors}))
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)


def _file_tokenizer(header: Header, load: Callable, folder: str, kwargs: dict):
    """transformers' tokenizer of the file (``load(folder, **kwargs)``) with the file's tokens only, as
    llama.cpp's vocabulary has them: a special token its class adds by default where the file's list
    lacks it (GemmaTokenizer's ``<mask>``, for a gemma3 file of another vocabulary) is left out, which
    would otherwise be counted past the embedding's rows."""
    tokenizer = load(folder, **kwargs)
    listed = header.metadata.get("tokenizer.ggml.tokens")
    count = len(listed.items) if isinstance(listed, ArrayValue) else len(tokenizer)
    added = {  # the special tokens of ids past the file's list: none of the file's
        name: None
        for name, token in tokenizer.special_tokens_map.items()
        if isinstance(token, str) and tokenizer.convert_tokens_to_ids(token) >= count
    }
    return load(folder, **kwargs, **added) if added else tokenizer


def _name_added_tokens(folder: Path) -> None:
    """tokenizer.json's added tokens written into tokenizer_config.json as ``added_tokens_decoder``, as
    transformers reads them from there when it is present: without it (what its ``save_pretrained``
    writes) every load parses the whole tokenizer.json in Python for them, beside the tokenizers
    library's own parse of it. The tokens, and so the tokenizer, are the same either way."""
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    if "added_tokens_decoder" in config:
        return
    added = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8")).get("added_tokens", [])
    config["added_tokens_decoder"] = {str(token.pop("id")): token for token in added}
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _read_as(header: Header) -> Header:
    """The header as transformers' GGUF reader is to see it: a family's whose architecture it has no
    config mapping for (`Family.gguf_read_as`: OLMoE's) under the architecture whose keys it shares, so
    that the reader makes a config (then `_family_config`'s) and the tokenizer of it; without the keys
    it misreads (`Family.gguf_unread`)."""
    family = families.by_gguf_arch(header.arch, header.metadata)
    if family is not None and family.gguf_unread:
        unread = tuple(f"{header.arch}.{prefix}" for prefix in family.gguf_unread)
        kept = {k: v for k, v in header.metadata.items() if not k.startswith(unread)}
        header = replace(header, metadata=kept, types={k: header.types[k] for k in kept})
    if family is None or family.gguf_read_as is None:
        return header
    ours, theirs = f"{header.arch}.", f"{family.gguf_read_as}."
    renamed = {k: theirs + k[len(ours) :] if k.startswith(ours) else k for k in header.metadata}
    metadata = {renamed[k]: v for k, v in header.metadata.items()}
    metadata["general.architecture"] = family.gguf_read_as
    return replace(header, metadata=metadata, types={renamed[k]: t for k, t in header.types.items()})


def _family_config(config, metadata: dict[str, object], arch: str, path: Path):
    """transformers' config of a GGUF with what its GGUF reader leaves out or reads otherwise than
    llama.cpp: a mixture of experts' experts (a llama file with an expert count is a Mixtral's, which
    it reads as a dense llama), the family's other keys (`Family.gguf_config_keys`), the fields
    llama.cpp fixes for the architecture, and those it derives from the metadata (`Family.gguf_config`:
    Gemma 3's windows and RoPE bases)."""
    from transformers import AutoConfig

    family = families.by_gguf_arch(arch, metadata)
    if family is None or not (
        family.experts or family.gguf_config or family.gguf_config_keys or family.gguf_read_as
    ):
        return config
    fields = config.to_dict()
    for key in ("model_type", "architectures", "transformers_version"):
        fields.pop(key, None)
    keys = dict(family.gguf_config_keys)
    if family.experts is not None:
        keys = {"expert_count": family.experts.count, "expert_used_count": "num_experts_per_tok", **keys}
    for key, name in keys.items():
        if f"{arch}.{key}" not in metadata:
            raise GGUFError(
                f"{path}: metadata {arch}.{key} is missing; a {family.name} file gives its {name}"
            )
        fields[name] = metadata[f"{arch}.{key}"]
    if family.gguf_config is not None:
        try:
            fields |= family.gguf_config(metadata, arch)
        except ValueError as e:
            raise GGUFError(f"{path}: {e}") from None
    return AutoConfig.for_model(family.name, **{**fields, **family.gguf_config_fixed})


@dataclass
class _Field:
    """One metadata value in the shape gguf-py's ``ReaderField`` gives it to transformers:
    ``parts[i]`` for ``i`` in ``data`` are the items (a 1-element row of a scalar, a string's bytes)."""

    types: list[int]
    parts: list | np.ndarray
    data: range


class _HeaderReader:
    """Stands in for gguf-py's ``GGUFReader`` while transformers reads a file's config and tokenizer
    (``load_gguf_checkpoint`` uses ``fields`` and the tensors' names alone when it reads no tensor), with
    the values `gguf_header` already read, so the file is parsed once, within its limits."""

    header: Header | None = None  # set while `standing_in`

    def __init__(self, path, mode: str = "r") -> None:
        header = type(self).header
        if header is None:
            raise RuntimeError("_HeaderReader is used only within _HeaderReader.standing_in")
        self.tensors = header.tensors  # each with its .name
        self.fields = {key: _field(header.types[key], value) for key, value in header.metadata.items()}

    @classmethod
    @contextlib.contextmanager
    def standing_in(cls, header: Header):
        import gguf

        own, cls.header, gguf.GGUFReader = gguf.GGUFReader, header, cls
        try:
            yield
        finally:
            gguf.GGUFReader, cls.header = own, None


def _field(vtype: int, value: object) -> _Field:
    if vtype == STRING:
        return _Field([STRING], [value.encode()], range(1))
    if vtype != ARRAY:
        return _Field([vtype], [(value,)], range(1))
    assert isinstance(value, ArrayValue)
    items = value.items
    if value.item_type == STRING:
        return _Field([ARRAY, STRING], [item.encode() for item in items], range(len(items)))
    return _Field([ARRAY, value.item_type], items.reshape(-1, 1), range(len(items)))


def hf_names(family: Family) -> Callable[[str], tuple[str, Module] | None]:
    """GGUF tensor name -> its Hugging Face name and module, as ``family`` declares them, for any layer
    (None: not one of the family's tensors, e.g. rope_freqs). A module per expert's name holds "{}"
    for the expert (its GGUF tensor holds every expert's: `experts_of`)."""
    top = {m.gguf: m for m in family.top}
    layer = {m.gguf: m for m in family.layer}

    def hf(name: str) -> tuple[str, Module] | None:
        stem, _, suffix = name.rpartition(".")
        if suffix not in ("weight", "bias"):
            return None
        own = lambda m: m.suffixes[suffix == "bias"]  # noqa: E731 - its name's suffix (gpt-oss's sinks: none)
        if stem in top:
            return f"{top[stem].hf}{own(top[stem])}", top[stem]
        match = re.fullmatch(r"blk\.(\d+)\.(.+)", stem)
        if match is None or match.group(2) not in layer:
            return None
        module = layer[match.group(2)]
        return f"{HF_LAYER.format(int(match.group(1)))}{module.hf}{own(module)}", module

    return hf


def _family_arch(ckpt: GGUFCheckpoint, family: Family) -> None:
    """Refuse a file whose architecture is not the one ``family``'s GGUF names and row order are of."""
    if ckpt.arch != family.gguf_arch:
        raise ModelCheckError(
            f"{ckpt.path}: its architecture is {ckpt.arch!r}; pagedinfer reads {family.name} GGUF files of "
            f"architecture {family.gguf_arch!r}"
        )


def experts_of(info: TensorInfo, named: tuple[str, Module]) -> list[tuple[str, str, tuple[int, ...]]]:
    """The Hugging Face tensors one GGUF tensor holds: (name, name in the file, shape) of each; one for
    most, one per expert for a 3-D tensor of every expert's weight (``blk.0.ffn_up_exps.weight[2]``);
    a one-row matrix stored as a vector (`Module.gguf_vector`) as its one row."""
    hf, module = named
    if module.gguf_vector and len(info.shape) == 1:
        return [(hf, info.name, (1, *info.shape))]
    if not module.experts or len(info.shape) < 2:  # (a 1-D "experts" tensor: refused by its shape)
        return [(hf, info.name, tuple(info.shape))]
    return [(hf.format(e), f"{info.name}[{e}]", tuple(info.shape[1:])) for e in range(info.shape[0])]


def tensor_index(ckpt: GGUFCheckpoint, family: Family) -> dict[str, Found]:
    """The file's tensors of ``family`` as `validate.check_tensors` takes them: Hugging Face name ->
    shape, type and GGUF name (the other tensors, e.g. rope_freqs, are not read)."""
    _family_arch(ckpt, family)
    hf = hf_names(family)
    out = {}
    for info in ckpt.tensors.values():
        if (named := hf(info.name)) is not None:
            for name, stored_as, shape in experts_of(info, named):
                out[name] = Found(shape, info.kind, stored_as, str(ckpt.path))
    return out


def readable_types(kinds: Iterable[str] = ()) -> tuple[str, ...]:
    """The GGUF types `state_dict` reads: float32, float16, and those gguf-py dequantizes. Where every
    one of ``kinds`` (a file's) is a float or a type the panels keep, those (gguf-py not imported)."""
    if set(kinds) <= {*FLOATS, *BLOCKS}:
        return (*FLOATS, *BLOCKS)
    import gguf

    types = gguf.GGMLQuantizationType
    return (*FLOATS, *(t.name for t in types if isinstance(getattr(gguf.quants, t.name, None), type)))


def _reverse_permute(a: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's converter's Q/K row permutation (as transformers' GGUF loader does), on rows."""
    w = a.reshape(heads, a.shape[0] // heads // 2, 2, *a.shape[1:])
    return w.swapaxes(2, 1).reshape(a.shape)


def state_dict(
    ckpt: GGUFCheckpoint,
    config,
    family: Family,
    keep_blocks: bool,
    dtype: torch.dtype = torch.float32,
    panels: PanelCache | None = None,
) -> tuple[dict[str, torch.Tensor | GGUFWeight], Counter]:
    """The tensors of ``family`` under Hugging Face names, and the types that were dequantized.

    ``keep_blocks``: matrices of a type in `gguf_blocks.BLOCKS` stay as their blocks (`GGUFWeight`,
    for the panels, multiplied under ``dtype`` activations: float32 or bfloat16), the other tensors
    are dequantized to ``dtype``; else every tensor is dequantized to ``dtype``. The rows of the
    modules the family declares permuted (llama's Q and K) are put back, as transformers does.
    ``panels``: where the kept blocks' panels may be stored already (`panel_cache`)."""
    names = hf_names(family)
    s = sizes(config, str(ckpt.path))
    sd: dict[str, torch.Tensor | GGUFWeight] = {}
    dequantized: Counter = Counter()
    bf16_io = dtype == torch.bfloat16  # kept blocks multiplied under bfloat16 activations
    for info in ckpt.tensors.values():
        named = names(info.name)
        if named is None:  # e.g. rope_freqs: transformers ignores it too
            continue
        module = named[1]
        parts = experts_of(info, named)  # [(name, _, shape)]: one, or one per expert
        stored = ckpt.raw(info)  # [rows, row bytes]: every part's rows
        raw = stored.reshape(len(parts), -1, stored.shape[1])  # [parts, rows, row bytes]
        heads = family.gguf_permuted.get(module.hf)
        permute = None if heads is None else getattr(s, heads)
        if keep_blocks and info.kind in BLOCKS and len(parts[0][2]) == 2:
            for e, (hf, stored_as, shape) in enumerate(parts):  # pages dropped once the last is packed
                data = raw[e] if permute is None else _reverse_permute(raw[e], permute)
                last = e == len(parts) - 1
                release = (lambda i=info: ckpt.release(i)) if last else None
                sd[hf] = GGUFWeight(info.kind, data, shape[1], release, bf16_io, stored_as, panels)
            continue
        if len(info.shape) > 1 and info.kind != "F32":
            dequantized[info.kind] += 1
        # bfloat16 as its bits, copied as stored and cast (to float32: exactly): the same values as
        # gguf-py's float32 gives, without a float32 copy of a bfloat16 model (one tensor's at most)
        bits = info.kind == "BF16"
        flat = raw.reshape(-1).view(np.int16) if bits else _dequantized(raw.reshape(-1), info.kind)
        values = flat.reshape(len(parts), *parts[0][2])
        for e, (hf, _, _) in enumerate(parts):
            part = values[e] if permute is None else _reverse_permute(values[e], permute)
            own = torch.from_numpy(np.array(part, dtype=np.int16 if bits else np.float32))  # [rows, in]
            sd[hf] = (own.view(torch.bfloat16) if bits else own).to(dtype)
        ckpt.release(info)
    return sd, dequantized


def _dequantized(data: np.ndarray, kind: str) -> np.ndarray:
    """A tensor's bytes as float32 values, as gguf-py's ``dequantize`` gives them (gguf-py imported only
    for a quantized type: float32 and float16 are read as they are)."""
    if kind == "F32":
        return data.view(np.float32)
    if kind == "F16":
        return data.view(np.float16).astype(np.float32)
    import gguf

    with np.errstate(all="ignore"):  # non-finite scales: refused by validate.check_values, not warned
        values = gguf.quants.dequantize(data, getattr(gguf.GGMLQuantizationType, kind))
    return values.astype(np.float32, copy=False)


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
