"""Load a Hugging Face decoder, refuse families our packed attention cannot serve, and learn its K/V shapes."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

import torch

from pagedinfer import envs
from pagedinfer.attention import interface as attention
from pagedinfer.attention.kv_cache import LayerShape
from pagedinfer.chat_render import ChatRenderError, compile_error
from pagedinfer.config import LOAD_FORMATS, MATMUL_NUMERICS, MODEL_IMPLS, QUANTIZATIONS
from pagedinfer.errors import one_line
from pagedinfer.kernels import build, kernel_cache, weight_types
from pagedinfer.model import (
    families,
    gguf,
    gguf_blocks,
    hub,
    llama,
    own_config,
    packed_linear,
    panel_cache,
    panel_formats,
    tokenizer_snapshot,
    validate,
)
from pagedinfer.model.dtype import DTypeError, choose_dtype, dtype_name, emulated_note
from pagedinfer.model.random_models import random_model
from pagedinfer.model.weight_memory import WeightMemory, weight_memory
from pagedinfer.terminal import note

T = TypeVar("T")

DEMO_MODEL = Path(__file__).resolve().parents[1] / "demo_model"

# Families that bypass the attention interface, crash without a mask, or keep state outside K/V.
UNSUPPORTED = {
    "bloom": "computes attention itself (ALiBi) without the attention interface",
    "falcon": "does not accept a custom attention implementation",
    "gpt_neo": "does not accept a custom attention implementation",
    "mpt": "needs an attention mask we do not build",
    "xglm": "computes attention itself without the attention interface",
    "openai-gpt": "computes attention itself without the attention interface",
    "gpt_neox_japanese": "computes attention itself without the attention interface",
    "rwkv": "is a recurrent model without a KV cache",
    "llama4": "uses chunked attention that lives only in its mask",
    "llama4_text": "uses chunked attention that lives only in its mask",
}
HYBRID_MARKERS = ("mamba", "ssm", "linear", "conv", "recurrent", "deltanet", "rwkv")
# the files a tokenizer loads from, the one it reads first first (named when loading fails)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


class ModelLoadError(ValueError):
    """The model cannot be loaded or served; the message says why (shown to users as is)."""


@dataclass
class LoadedModel:
    model: torch.nn.Module
    # a transformers fast tokenizer, or its snapshot (`tokenizer_snapshot.Tokenizer`), or None (token-id
    # prompts only)
    tokenizer: object | None
    layer_shapes: dict[int, LayerShape]
    max_model_len: int
    eos_token_ids: set[int]
    dtype: torch.dtype
    device: torch.device
    name: str
    dtype_reason: str = ""  # why this dtype: "--dtype bfloat16", or what --dtype auto found
    dtype_emulated: bool = False  # a 16-bit dtype without this CPU's native instructions (model/dtype.py)
    impl: str = "transformers"  # whose modeling code runs: "transformers" or "pagedinfer"
    kernel_compile_s: float = 0.0  # seconds compiling the CPU kernels at load (0 when they were cached)
    matmul_numerics: str = "exact"  # how the quantized weights multiply (config.MATMUL_NUMERICS)
    weights: WeightMemory = WeightMemory(0, 0.0)  # the weights' bytes and the linears' bits per weight
    # what the weights are, where the load already knows it: "sha256:<hex>" of a GGUF file, or
    # "dummy" (random weights); "" for checkpoint folders (engine/fingerprint.py reads their files)
    content_digest: str = ""


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError("device 'cuda' was asked for but torch sees no CUDA device")
    if device not in ("cpu",) and not device.startswith("cuda"):
        raise ModelLoadError(f"unknown device {device!r}: use auto, cpu or cuda")
    return torch.device(device)


def check_family(config, name: str) -> None:
    """Refuse the model ``name`` when its family cannot be served (the reason names the family)."""
    kind = getattr(config, "model_type", "?")
    if getattr(config, "is_encoder_decoder", False):
        raise ModelLoadError(
            f"{name}: model family {kind!r} is an encoder-decoder; pagedinfer serves decoder-only models"
        )
    if kind in UNSUPPORTED:
        raise ModelLoadError(f"{name}: model family {kind!r} is not supported: it {UNSUPPORTED[kind]}")
    layer_types = getattr(config, "layer_types", None) or []
    hybrid = sorted({t for t in layer_types if any(m in str(t) for m in HYBRID_MARKERS)})
    if hybrid or any(m in kind for m in ("mamba", "jamba", "zamba", "_next", "nemotron_h", "lfm", "bamba")):
        raise ModelLoadError(
            f"{name}: model family {kind!r} is not supported: it mixes linear/state-space layers "
            f"({', '.join(hybrid) or kind}) with attention, which a paged KV cache alone cannot serve"
        )


def context_length(config) -> int:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx"):
        value = getattr(text, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


def load_model(
    name_or_path: str | os.PathLike | None,
    device: str = "auto",
    dtype: str = "auto",
    model_impl: str = "auto",
    load_format: str = "auto",
    quantization: str | None = None,
    chat_template: str | None = None,
    matmul_numerics: str = "exact",
) -> LoadedModel:
    """Load model, tokenizer and geometry from a hub id, a model directory or a ``.gguf`` file;
    every failure is a ModelLoadError with a one-line reason.

    ``load_format="dummy"`` (vLLM's name): random weights drawn on the device from the config alone,
    no weight file read (benchmarks of model shapes, e.g. ``pagedinfer bench --device cuda``).
    ``quantization`` (`config.QUANTIZATIONS`: int8, int4, ...): every packed linear's weight quantized
    (float32 activations; the CPU and float32 only). A GGUF file served by our layers on the CPU keeps
    its tensors' types (``--dtype auto``, no ``quantization``); otherwise it is dequantized.
    ``chat_template``: Jinja text replacing the tokenizer's. ``matmul_numerics`` (`config.MATMUL_NUMERICS`):
    ``llama.cpp`` multiplies a GGUF's Q4_0, Q4_1 and Q8_0 blocks by activations quantized per block
    (`packed_linear.use_llamacpp_numerics`); refused where no such weight is kept, or under bfloat16."""
    if load_format not in LOAD_FORMATS:
        raise ModelLoadError(f"unknown load format {load_format!r}: use {' or '.join(LOAD_FORMATS)}")
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ModelLoadError(f"unknown quantization {quantization!r}: use {', '.join(QUANTIZATIONS)}")
    if matmul_numerics not in MATMUL_NUMERICS:
        raise ModelLoadError(
            f"unknown matmul numerics {matmul_numerics!r}: use {' or '.join(MATMUL_NUMERICS)}"
        )
    quant = QUANTIZATIONS.get(quantization) if quantization else None
    name = str(name_or_path or DEMO_MODEL)
    ckpt = _open_gguf(name)
    folder, kwargs = (str(ckpt.folder), {}) if ckpt else _source(name)
    cache_only = _cache_only(name) if not (kwargs or ckpt) else {}
    # our own layers' families read without transformers' config classes (`own_config`); the
    # transformers path, and whatever that reader leaves, gets transformers' config
    ours = model_impl != "transformers" and load_format != "dummy" and not (kwargs or cache_only)
    if not ckpt:  # a GGUF's sizes were checked in its metadata
        _check(validate.check_config_file, folder)
    config = (ours and own_config.read(folder)) or _hf_config(name, folder, {**kwargs, **cache_only})
    check_family(config, name)
    family = families.find(config)  # the declaration our layers read, where they serve the family
    if ckpt and family is not None and family.gguf_layout is not None:
        family = family.gguf_layout  # its tensors as llama.cpp's files lay them out
    found: dict[str, validate.Found] = {}  # the checkpoint's tensors as its files state them
    if ckpt and family is not None:  # whoever's layers run them
        found = _check(gguf.tensor_index, ckpt, family)
        readable = gguf.readable_types(ckpt.kinds(matrices_only=False))
        _check(validate.check_tensors, config, family, found, str(ckpt.path), readable)
    dev = resolve_device(device)
    try:
        choice = choose_dtype(dtype, config, dev, quant)
    except DTypeError as e:
        raise ModelLoadError(str(e)) from None
    if choice.emulated:
        note(emulated_note(choice))
    # every CPU kernel built now, in parallel, before anything is timed (the first run's only wait)
    try:
        compile_s = build.prebuild() if dev.type == "cpu" else 0.0
    except kernel_cache.KernelCacheError as e:
        raise ModelLoadError(str(e)) from None
    dummy = load_format == "dummy"
    if ckpt:
        own = _own_gguf(name, config, model_impl, dev)
    else:
        own = [] if kwargs or dummy else own_implementation_files(name, config, model_impl, dev, cache_only)
    if not own and isinstance(config, own_config.OwnConfig):  # transformers' layers: their config
        config = _hf_config(name, folder, {**kwargs, **cache_only})
    if own and not ckpt:
        found = llama.tensor_index(own)
        _check(
            validate.check_tensors,
            config,
            family,
            found,
            llama.weight_files(own),
            validate.SAFETENSORS_FLOATS,
        )
    keep_blocks = (  # float32 activations (auto), or bfloat16 ones (--dtype bfloat16) over the blocks
        bool(ckpt)
        and own
        and (dtype == "auto" or choice.dtype == torch.bfloat16)
        and quant is None
        and packed_linear.panel_dtype(choice.dtype, 2)
    )
    # quantized weights are made from the checkpoint's values, the other tensors cast as they are packed
    load_dtype = torch.float32 if quant else choice.dtype
    try:
        if dummy:
            model = random_model(
                config, 0, load_dtype, dev, attn_implementation=attention.transformers_name()
            )
        elif ckpt and own:  # our layers on the GGUF's tensors: its blocks in panels, or dequantized
            panels = _panel_cache(ckpt) if keep_blocks else None
            sd, dequantized = gguf.state_dict(ckpt, config, family, keep_blocks, choice.dtype, panels)
            validate.check_values(sd, found)
            if keep_blocks:
                gguf.dequantized_note(ckpt.path, dequantized, choice.dtype)
                reason = _gguf_reason(ckpt, dequantized, choice.dtype)
                choice = replace(choice, reason=reason or choice.reason)
            model = llama.from_gguf(config, family, sd)
            del sd  # the model holds its tensors: those the packing replaces are freed as it goes
            if panels is not None:
                panels.save()
            model.generation_config = _generation_config(folder, config, cache_only)
        elif own:
            sd = llama.read_weights(own, load_dtype, dev)
            validate.check_values(sd, found)
            model = llama.build(config, family, sd, dev)
            model.generation_config = _generation_config(folder, config, cache_only)  # as HF's models carry
        else:
            from transformers import AutoModelForCausalLM

            src, src_kwargs = gguf.source(ckpt.path) if ckpt else (folder, kwargs)
            if ckpt and family is not None and family.gguf_config is not None:
                # the config as llama.cpp reads the file (Gemma 3's windows), not transformers' reading
                src_kwargs = {**src_kwargs, "config": config}
            if family is not None and not ckpt:  # a GGUF's tensors were checked against its config
                files = _weight_files(Path(folder).expanduser())
                validate.check_weights_hold(
                    config, family, files, llama.weight_files(files) if files else name
                )
            model, info = AutoModelForCausalLM.from_pretrained(
                src,
                dtype=load_dtype,
                attn_implementation=attention.transformers_name(),
                output_loading_info=True,
                ignore_mismatched_sizes=True,  # reported by check_module, naming the tensor, not raised
                **src_kwargs,
                **cache_only,
            )
            where = _check_complete(info["missing_keys"], name, src, src_kwargs)
            validate.check_module(model, info["mismatched_keys"], where)
    except ModelLoadError:
        raise
    except validate.ModelCheckError as e:
        raise ModelLoadError(str(e)) from None
    except gguf.GGUFError as e:
        raise ModelLoadError(str(e)) from None
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"cannot load model {name!r}: {one_line(e)}") from None
    if not getattr(model, "_supports_attention_backend", True):
        raise ModelLoadError(f"{name}: model family {config.model_type!r} does not support custom attention")
    model.to(dev).eval()
    if quant and not packed_linear.panel_dtype(choice.dtype, 2):
        raise ModelLoadError(
            f"quantization {quant.name} needs the CPU panel kernel, which did not build (no C compiler?)"
        )
    if quant or (envs.pack_weights() and packed_linear.can_pack(model)):
        try:
            packed_linear.pack_linears(  # quantized: every linear, however small (the run says so)
                model,
                min_weights=0 if quant else None,
                panels=envs.cpu_gemm() != "onednn",
                quantization=quant,
                activations=choice.dtype,
            )
        except ValueError as e:  # a linear the quantized panels cannot take under these activations
            raise ModelLoadError(f"cannot quantize {name!r}: {e}; use --dtype float32") from None
    if quant:
        _check_quantized(model, config.model_type, quant.name)
    _set_numerics(model, matmul_numerics, name, choice.dtype)
    shapes, logits = probe_layers(model, dev)
    _check(validate.check_probe, logits, name, choice.dtype)
    if not shapes:
        raise ModelLoadError(
            f"{name}: model family {config.model_type!r} is not supported: its attention does not go through "
            "the transformers attention interface"
        )
    tokenizer = _load_tokenizer(folder, {**kwargs, **cache_only}, config)
    if words := validate.vocabulary_note(tokenizer, model.get_input_embeddings().num_embeddings):
        note(f"pagedinfer: {name}: {words}")
    if chat_template is not None:
        _set_chat_template(tokenizer, chat_template, name)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        layer_shapes=shapes,
        max_model_len=context_length(config),
        eos_token_ids=_eos_ids(config, model),
        dtype=choice.dtype,
        device=dev,
        name=name,
        dtype_reason=choice.reason,
        dtype_emulated=choice.emulated,
        impl="pagedinfer" if own else "transformers",
        kernel_compile_s=compile_s,
        weights=weight_memory(model),
        content_digest="dummy" if dummy else f"sha256:{ckpt.digest}" if ckpt else "",
        matmul_numerics=matmul_numerics,
    )


def _check_complete(missing: list[str] | set[str], name: str, folder: str, kwargs: dict) -> str:
    """Refuse a checkpoint that lacks a tensor its config names (transformers would fill it with random
    values and warn; a run would then write noise as if it were the model's answer). Returns the
    weights' file(s) in a few words, for the other checks' messages."""
    path = Path(folder).expanduser()
    files = _weight_files(path)
    where = name if kwargs.get("gguf_file") else llama.weight_files(files) if files else folder
    if missing:
        first, *rest = sorted(missing)
        raise ModelLoadError(validate.missing(first, len(rest), where))
    return where


def _weight_files(folder: Path) -> list[Path]:
    """A local checkpoint folder's weight files, as transformers reads them (none for a hub id)."""
    return sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))


def _check(check: Callable[..., T], *args: object) -> T:
    """Run a `validate` check (its result returned); its refusal becomes this module's one-line error."""
    try:
        return check(*args)
    except validate.ModelCheckError as e:
        raise ModelLoadError(str(e)) from None


def _open_gguf(name: str) -> gguf.GGUFCheckpoint | None:
    """The opened GGUF file ``name`` (its cache folder filled on first use); None for other names."""
    if not gguf.is_gguf(name):
        return None
    path = Path(name).expanduser()
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {name} does not exist")
    problem = gguf.missing_extra()
    if problem:
        raise ModelLoadError(problem)
    try:
        return gguf.open_checkpoint(path)
    except gguf.GGUFError as e:
        raise ModelLoadError(str(e)) from None


def _own_gguf(name: str, config, impl: str, device: torch.device) -> bool:
    """Whether our layers serve this GGUF (as `own_implementation_files` decides for directories)."""
    if impl not in MODEL_IMPLS:
        raise ModelLoadError(f"unknown model implementation {impl!r}: use auto, pagedinfer or transformers")
    if impl == "transformers" or (impl == "auto" and device.type != "cpu"):
        return False
    reason = llama.unsupported_reason(config)
    if reason and impl == "pagedinfer":
        raise ModelLoadError(f"model implementation 'pagedinfer' cannot serve {name!r}: {reason}")
    return reason is None


def _panel_cache(ckpt: gguf.GGUFCheckpoint) -> panel_cache.PanelCache:
    """The file's panels as this code packs them (`panel_cache`), kept in its cache folder."""
    modules = (gguf, gguf_blocks, packed_linear, panel_cache, panel_formats, weight_types)
    sources = [Path(m.__file__) for m in modules]
    key = panel_cache.key(sources, packed_linear.library_name())
    return panel_cache.PanelCache.open(ckpt.folder / f"panels-{key}.bin")


def _gguf_reason(ckpt: gguf.GGUFCheckpoint, dequantized, dtype: torch.dtype) -> str | None:
    """The report's dtype reason for a GGUF kept in its types: the activations, which types, how many
    matrices each (None under bfloat16 activations when no matrix kept its blocks: float ones are cast)."""
    kept = {
        k: n
        for k, n in ckpt.kinds().items()
        if k not in dequantized and (dtype == torch.float32 or k in gguf_blocks.BLOCKS)
    }
    if not kept:
        return None
    types = ", ".join(f"{k} x{n}" for k, n in sorted(kept.items(), key=lambda kv: -kv[1]))
    return f"{dtype_name(dtype)} activations; weights as stored in the GGUF ({types})"


def _set_numerics(model: torch.nn.Module, numerics: str, name: str, dtype: torch.dtype) -> None:
    """Put the packed linears on ``numerics`` (`config.MATMUL_NUMERICS`), or refuse in one line where
    ``llama.cpp`` cannot apply: bfloat16 activations, or no panels of `packed_linear.Q8_DOT_KINDS` (a GGUF's
    Q4_0 / Q4_1 / Q8_0 kept as stored, ``--quantization`` int8 / int4) with an input width it takes."""
    if numerics == "exact":
        return
    if dtype != torch.float32:
        raise ModelLoadError(
            f"matmul numerics llama.cpp quantizes float32 activations; this run's are {dtype_name(dtype)}"
            " (use --dtype auto)"
        )
    if not packed_linear.use_llamacpp_numerics(model):
        kinds = sorted(
            {k for m in model.modules() if isinstance(m, packed_linear.PackedLinear) for k in m.kinds}
        )
        held = f"its packed linears are {', '.join(kinds)}" if kinds else "it has no packed linear"
        raise ModelLoadError(
            f"matmul numerics llama.cpp applies to GGUF {', '.join(weight_types.GGUF_Q8_DOT_KINDS)} weights kept "
            "as stored and to --quantization int8 / int4 ones, with input widths a multiple of 32 (--dtype auto, "
            f"on the CPU); {name} has none: {held}"
        )


def _check_quantized(model: torch.nn.Module, family: str, quantization: str) -> None:
    """Quantization covers ``nn.Linear`` layers: refuse a model that keeps matrices elsewhere (GPT-2's
    Conv1D, mixture-of-experts tensors) rather than run them in float32 under a quantized label."""
    left = sorted(
        {
            type(m).__name__
            for m in model.modules()
            if not isinstance(m, torch.nn.Embedding)
            for p in m.parameters(recurse=False)
            if p.dim() >= 2
        }
    )
    if left:
        raise ModelLoadError(
            f"quantization {quantization} covers nn.Linear layers; model family {family!r} keeps weights in "
            f"{', '.join(left)}, which would stay float32"
        )


def own_implementation_files(
    name: str, config, impl: str, device: torch.device, cache_only: dict | None = None
) -> list[Path]:
    """The safetensors files our own implementation loads, or [] when transformers' modeling runs.

    ``auto`` takes ours for the families it covers, on the CPU (where it is measured and faster);
    ``pagedinfer`` insists (any device) and says why it cannot; ``transformers`` never takes it.
    """
    if impl not in MODEL_IMPLS:
        raise ModelLoadError(f"unknown model implementation {impl!r}: use auto, pagedinfer or transformers")
    if impl == "transformers" or (impl == "auto" and device.type != "cpu"):
        return []
    reason = llama.unsupported_reason(config)
    files = [] if reason else llama.checkpoint_files(name, **(cache_only or {}))
    if impl == "pagedinfer" and not files:
        raise ModelLoadError(
            f"model implementation 'pagedinfer' cannot serve {name!r}: {reason or 'it has no safetensors weights'}"
        )
    return files


def _source(name: str) -> tuple[str, dict]:
    """``from_pretrained``'s folder or hub id (not a GGUF file: `_open_gguf`); bad paths refused."""
    path = Path(name).expanduser()
    if name.startswith((".", "/", "~")) and not path.exists():
        raise ModelLoadError(f"model directory {name} does not exist")
    if path.exists() and not path.is_dir():
        raise ModelLoadError(f"model path {name} is a file; give a model directory, a .gguf file or a hub id")
    return name, {}


def _cache_only(name: str) -> dict:
    """``from_pretrained``'s keywords for ``name``: ``local_files_only`` for a hub id without a network."""
    try:
        return {"local_files_only": True} if hub.local_only(name) else {}
    except hub.HubUnavailable as e:
        raise ModelLoadError(str(e)) from None


@torch.inference_mode()
def probe_layers(model: torch.nn.Module, device: torch.device) -> tuple[dict[int, LayerShape], torch.Tensor]:
    """Run one token through the model to learn each attention layer's K/V shape (works for any family);
    returns them and the token's logits ``[1, 1, vocab]`` (attention gives zeros while probing)."""
    shapes: dict[int, LayerShape] = {}
    attention.set_context(attention.StepContext(meta=None, kv=None, probe=shapes))
    try:
        ids = torch.zeros(1, 1, dtype=torch.long, device=device)
        logits = model(input_ids=ids, position_ids=torch.zeros_like(ids), use_cache=False).logits
    finally:
        attention.set_context(None)
    return shapes, logits


def _hf_config(name: str, folder: str, kwargs: dict):
    """transformers' config of the model (its class chosen by model_type); refused in one line."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder, **kwargs)
    except Exception as e:  # noqa: BLE001 - any loading failure becomes one clear line
        raise ModelLoadError(f"cannot load the model config from {name!r}: {one_line(e)}") from None


def _load_tokenizer(folder: str, kwargs: dict, config):
    """The model's fast tokenizer; None when it has no tokenizer files (token-id prompts only). Files that
    are there but do not load are refused now, naming the file, rather than failing every text line.
    Beside an `own_config.OwnConfig`, the class transformers' ``AutoTokenizer`` would choose is loaded
    without it reading config.json again through its config classes (`own_config.tokenizer_loader`),
    and its snapshot is read instead where an earlier load saved one (`tokenizer_snapshot`)."""
    own = isinstance(config, own_config.OwnConfig)
    if own and not _tokenizer_files(Path(folder)):  # AutoTokenizer would find none, reading config.json
        return None
    load = (own and own_config.tokenizer_loader(folder, config)) or own_config.auto_tokenizer
    try:
        if own:  # a local folder
            tok = tokenizer_snapshot.load(folder, functools.partial(load, folder, **kwargs))
        else:
            tok = load(folder, **kwargs)
    except Exception as e:  # noqa: BLE001 - any failure: missing files (fine) or broken ones (refused)
        present = [Path(folder) / f for f in TOKENIZER_FILES if (Path(folder) / f).is_file()]
        if present:
            reason = (
                f"not valid JSON ({e})"
                if isinstance(e, json.JSONDecodeError)
                else f"missing key {e}"
                if isinstance(e, KeyError)
                else one_line(e)
            )
            raise ModelLoadError(f"cannot load the tokenizer of {folder!r}: {present[0]}: {reason}") from None
        return None
    return tok if getattr(tok, "is_fast", False) else None


def _tokenizer_files(folder: Path) -> list[Path]:
    """The files in ``folder`` a tokenizer may load from (`TOKENIZER_FILES`, vocabularies, merges, any
    file named for tokens)."""
    names = (*TOKENIZER_FILES, "vocab.txt", "merges.txt")
    return [p for p in folder.iterdir() if p.name in names or "token" in p.name]


def _set_chat_template(tokenizer, template: str, name: str) -> None:
    """Chat prompts render with ``template`` instead of the tokenizer's own (vLLM's ``--chat-template``)."""
    if tokenizer is None:
        raise ModelLoadError(
            f"a chat template needs a tokenizer; model {name!r} has none (token-id prompts only)"
        )
    try:
        error = compile_error(template)
    except ChatRenderError as e:
        raise ModelLoadError(str(e)) from None
    if error is not None:
        raise ModelLoadError(f"the chat template does not compile: {error}")
    tokenizer.chat_template = template


@dataclass(frozen=True)
class GenerationDefaults:
    """What the engine reads of a checkpoint's generation config (its EOS ids), read from a local
    folder's generation_config.json as transformers' ``GenerationConfig`` reads that key, without
    importing transformers for a file of a few numbers."""

    eos_token_id: int | list[int] | None


def _generation_config(folder: str, config, cache_only: dict) -> object:
    """The checkpoint's generation_config.json, else one derived from the model config (whose EOS is
    the config's). A local folder's file is read here (`GenerationDefaults`); a hub id's through
    transformers' ``GenerationConfig``, which finds it in the hub's cache."""
    if Path(folder).is_dir():
        try:
            doc = json.loads((Path(folder) / "generation_config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            doc = None
        eos = doc.get("eos_token_id") if isinstance(doc, dict) else getattr(config, "eos_token_id", None)
        return GenerationDefaults(eos)
    from transformers.generation.configuration_utils import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(folder, **cache_only)
    except Exception:  # noqa: BLE001 - no generation_config.json
        return GenerationConfig.from_model_config(config)


def _eos_ids(config, model) -> set[int]:
    """EOS ids of the config and of the generation config (generation_config.json, or the GGUF's)."""
    ids: set[int] = set()
    for value in (getattr(config, "eos_token_id", None), model.generation_config.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return ids
