"""Every layer of a decoding CPU step, and the final norm, in one C call (kernels/cpu_decode_step.c).

Per layer, our dense layers (model/llama.py) make about ten Python calls into C kernels (norms, GEMMs, RoPE,
the K/V write, attention), each converting its arguments through ctypes, allocating its output and,
for attention, walking the step's plan: Python overhead that is a large share of a small model's
batch-1 step (docs/kernels.md). When a step only decodes (one new token per sequence, or that and
the tokens drafted after it: a few query rows, each attended over its own context as the layer path
attends it) and every
piece runs on a C kernel (weights in cpu_gemm.c's panels: float32, int8, int4 or GGUF blocks under
float32 activations, or bfloat16; a KV pool in host memory), this module hands the whole stack of
layers to one C function that calls the same kernels in the same order, so the outputs are the same
bits. The layers' pointers are gathered once per KV pool; a step passes only its metadata. The
layer's shape flags come from the family's declaration (`families`): its q/k norms, where it has
them. The model runner decides which steps take it (`OneCall`); ``PAGEDINFER_DECODE_STEP=0`` keeps
the layer-by-layer path. The family's norms (each of `NORM_ROLES` a pointer, NULL where it has none:
OLMo-2's after each branch, Gemma's before and after), its q/k norm over all of q and k, Granite's
residual multiplier, Gemma's gelu-tanh MLP and RoPE tables per layer type are the
step's (its embedding and logits scalars are the model's, outside the step).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from pagedinfer import envs
from pagedinfer.attention.kv_cache import KVCache
from pagedinfer.attention.metadata import AttentionMetadata
from pagedinfer.attention.portable_backend import row_contexts
from pagedinfer.kernels import abi, build, paged_decode
from pagedinfer.kernels.sources import KERNELS_DIR
from pagedinfer.model.families.spec import LINEAR_ROLES, NORM_ROLES
from pagedinfer.model.packed_linear import GemmSegment, PackedLinear, c_segment

SOURCE = KERNELS_DIR / "cpu_decode_step.c"
TIMERS_FLAG = "-DSTEP_TIMERS"  # a build with the step's clocks (`gemm_seconds`): for the profiling scripts
_ptr = ctypes.c_void_p


MAX_QKV_SEGMENTS = 3  # a GGUF's q, k and v of three types
# the most query rows of one sequence a step may have to take the C step: a decoding sequence's pending
# token and its drafted ones (speculative decoding's verification rows); a longer query, a prompt
# chunk, goes layer by layer (the step keeps its scratch buffers for the most rows it has run)
MAX_QUERY_ROWS = 16


class StepLayer(ctypes.Structure):  # kernels/cpu_decode_step.c: step_layer
    _fields_ = [
        *((name, _ptr) for name in NORM_ROLES),
        ("qkv", GemmSegment * MAX_QKV_SEGMENTS),
        ("o", GemmSegment),
        ("gate_up", GemmSegment),
        ("down", GemmSegment),
        ("moe", _ptr),
        ("qkv_segments", ctypes.c_int),
        ("k_cache", _ptr),
        ("v_cache", _ptr),
        ("window", ctypes.c_int),
        ("group", ctypes.c_int),
        ("rope", ctypes.c_int),
    ]


class StepMeta(ctypes.Structure):  # kernels/cpu_decode_step.c: step_meta
    _fields_ = [
        *(
            (n, ctypes.c_int)
            for n in ("layers", "rows", "hidden", "q_heads", "kv_heads", "head_dim", "inter")
        ),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        *((n, _ptr) for n in ("final_norm", "cos", "sin", "slots", "tables", "max_blocks")),
        ("groups", ctypes.c_int),
        *((n, _ptr) for n in ("ctx_lens", "query_rows")),
        ("block_size", ctypes.c_int),
        ("bounds", _ptr),
        ("parts", ctypes.c_int),
        ("num_blocks", ctypes.c_int64),
        ("qk_norm_all", ctypes.c_int),
        ("residual_scale", ctypes.c_float),
        ("gelu", ctypes.c_int),
        ("clip_qkv", ctypes.c_float),
    ]


@functools.cache
def _library() -> ctypes.CDLL | None:
    try:
        lib = build.compile_library(SOURCE)
    except build.KernelUnavailable:  # the decode kernel's message already said it
        return None
    if lib is None:
        return None
    dll = ctypes.CDLL(str(lib))
    for name in ("f32", "bf16"):  # every build has both (bfloat16: vdpbf16ps or its emulation)
        for pool in ("", "_kv_bf16", "_kv_f16"):  # the activations' dtype, or a 16-bit pool under float32
            fn = getattr(dll, f"decode_layers_{name}{pool}", None)
            if fn is None:
                continue
            fn.argtypes = [ctypes.POINTER(StepLayer), ctypes.POINTER(StepMeta)] + [_ptr] * 8
            fn.argtypes += [ctypes.POINTER(abi.Refusal)]
            fn.restype = ctypes.c_int  # 0, or what was out of range
    for clock in ("decode_gemm_seconds", "decode_attention_seconds"):  # built with TIMERS_FLAG only
        if hasattr(dll, clock):
            getattr(dll, clock).restype = ctypes.c_double
    return dll


def _clock(name: str) -> float:
    lib = _library()
    return getattr(lib, name)() if lib is not None and hasattr(lib, name) else 0.0


def gemm_seconds() -> float:
    """Wall seconds the C steps spent in their GEMMs since the last call (0.0 where none ran, or the
    step was built without its clocks: `TIMERS_FLAG` in ``PAGEDINFER_CC_FLAGS`` builds them in)."""
    return _clock("decode_gemm_seconds")


def attention_seconds() -> float:
    """Wall seconds the C steps spent writing K/V and in decode attention since the last call (as
    `gemm_seconds`)."""
    return _clock("decode_attention_seconds")


def _entry(qkv: PackedLinear, pool: torch.dtype) -> str:
    """The step's instantiation for these activations and this pool: ``decode_layers_f32`` (any weight
    format under float32 activations), ``_bf16``, or with a 16-bit pool under float32 activations
    ``decode_layers_f32_kv_f16`` etc."""
    act = qkv.activation_dtype
    kv = "" if pool == act else f"_kv_{abi.SUFFIX.get(pool)}"
    return f"decode_layers_{abi.SUFFIX[act]}{kv}"


class DecodeStep:
    """The C description of a model's layers over one KV pool; `run` computes a decoding step."""

    def __init__(self, model: torch.nn.Module, kv: KVCache) -> None:
        first = model.layers[0]
        self.qk_norm_all = model.family.qk_norm_over == "all"
        self.residual_scale = 1.0 if first.residual_scale is None else first.residual_scale
        self.gelu = first.activation != "silu"  # (`serves`: every layer's)
        self.kv = kv  # the pool the pointers below point into (kept alive with them)
        self.q_heads, self.kv_heads, self.head_dim = first.q_heads, first.kv_heads, first.head_dim
        self.hidden = model.norm.shape[0]
        dense = [layer for layer in model.layers if layer.mlp is None]
        self.inter = dense[0].gate_up_proj.out_features // 2 if dense else 0  # (every dense layer's)
        self.eps, self.scale = first.eps, first.scaling
        self.clip_qkv = first.clip_qkv or 0.0
        dtype = first.qkv_proj.activation_dtype
        # each layer's mixture of experts (None: a dense layer), described once
        self.moe = [None if layer.mlp is None else layer.mlp.one_call_layer(dtype) for layer in model.layers]
        self.final_norm = model.norm  # [H]
        self._buffers: list[torch.Tensor] | None = None  # see _scratch
        self.decode_layers = getattr(_library(), _entry(first.qkv_proj, kv.k[first.layer_idx].dtype))
        self.layers = (StepLayer * len(model.layers))()
        for entry, layer in zip(self.layers, model.layers, strict=True):
            qkv = layer.qkv_proj.segments
            for i, seg in enumerate(qkv):
                c_segment(seg, entry.qkv[i])
            entry.qkv_segments = len(qkv)
            for name in _linear_roles(layer)[1:]:
                c_segment(getattr(layer, f"{name}_proj").segments[0], getattr(entry, name))
            for role in NORM_ROLES:  # NULL where the layer has none
                norm = getattr(layer, role)
                setattr(entry, role, None if norm is None else norm.data_ptr())
            k, v = kv.k[layer.layer_idx], kv.v[layer.layer_idx]
            assert k.shape == v.shape == (kv.num_blocks, kv.block_size, self.kv_heads, self.head_dim)
            assert k.is_contiguous() and v.is_contiguous() and layer.q_heads == self.q_heads
            entry.k_cache, entry.v_cache = k.data_ptr(), v.data_ptr()
            entry.window = layer.window
            entry.group = kv.layer_group[layer.layer_idx]
            entry.rope = layer.rope
        for entry, moe in zip(self.layers, self.moe, strict=True):
            entry.moe = None if moe is None else ctypes.addressof(moe.c)

    @staticmethod
    def serves(model: torch.nn.Module, kv: KVCache) -> bool:
        """Every piece has its C kernel: panel-packed linears of one activation dtype (float32 for
        float32, int8, int4 and GGUF panels; or bfloat16), the QKV in at most three
        segments and the others in one (a SiLU's gate-up paired, a gelu-tanh's plain), every layer of
        one activation, a pool in host memory of the activations'
        dtype or 16-bit under float32, shapes within the decode kernel's limits (the step library
        holds its own copies of the decode kernel and the chains). A layer with experts in place of
        its MLP: its router, experts and shared expert as `moe.ExpertMLP.one_call_layer` takes them
        (the code of its layer path's C call); no attention sinks (gpt-oss's: the step passes none)."""
        lib = _library()
        if not envs.decode_step() or lib is None:
            return False
        first = model.layers[0]
        k = kv.k[first.layer_idx]
        linears = [getattr(lay, f"{n}_proj") for lay in model.layers for n in _linear_roles(lay)]
        if not all(isinstance(lin, PackedLinear) and lin.segments for lin in linears):
            return False
        dtype = first.qkv_proj.activation_dtype
        shapes_ok = all(
            len(lay.qkv_proj.segments) <= MAX_QKV_SEGMENTS
            and len(lay.o_proj.segments) == 1
            and lay.activation == first.activation
            and lay.sinks is None
            and lay.clip_qkv == first.clip_qkv
            and (_dense_mlp_served(lay) if lay.mlp is None else lay.mlp.one_call_layer(dtype) is not None)
            for lay in model.layers
        )
        return (
            k.device.type == "cpu"
            and shapes_ok
            and len({lin.activation_dtype for lin in linears}) == 1
            and hasattr(lib, _entry(first.qkv_proj, k.dtype))
            and model.norm.dtype == first.qkv_proj.activation_dtype
            and paged_decode.supports(
                first.q_heads, first.kv_heads, first.head_dim, first.head_dim, k.shape[1]
            )
        )

    def _scratch(self, rows: int, like: torch.Tensor) -> list[torch.Tensor]:
        """The step's buffers for ``rows`` rows: views of ones kept for the most rows seen so far (a
        step's allocations would fault fresh pages in, at cold caches, every step)."""
        if self._buffers is None or self._buffers[0].shape[0] < rows:
            qkv_width = (self.q_heads + 2 * self.kv_heads) * self.head_dim
            moe_work = max((moe.work(rows) for moe in self.moe if moe is not None), default=0)
            self._buffers = [
                like.new_empty(rows, self.hidden),  # h [S, H]
                like.new_empty(rows, self.hidden),  # x [S, H]
                like.new_empty(rows, qkv_width),  # qkv [S, (Hq + 2 Hkv) D]
                like.new_empty(rows, self.q_heads * self.head_dim),  # attn [S, Hq D]
                like.new_empty(rows, self.inter),  # act [S, I]
                torch.arange(rows, device=like.device),  # query rows [S]: 0 .. S - 1
                like.new_empty(rows, 2 * self.inter if self.gelu else 0),  # gate_up [S, 2 I]: gelu-tanh's
                like.new_empty(moe_work),  # the experts' scratch [moe_layer_work(rows)] (cpu_moe.h)
            ]
        return [b[:rows] for b in self._buffers[:-1]] + [self._buffers[-1]]

    def run(
        self,
        residual: torch.Tensor,  # [T, H] the embeddings; the residual stream after the last layer on return
        ropes: list[tuple[torch.Tensor, torch.Tensor]],  # (cos, sin) [T, D / 2] each, per RoPE table
        meta: AttentionMetadata,  # the step's: each sequence's query rows (`MAX_QUERY_ROWS` at most), in order
    ) -> torch.Tensor:  # [T, H] the final norm of the stream, the lm_head's input (valid until the next run)
        rows = residual.shape[0]
        groups = meta.group_metas or [meta]  # each layer group's slots and block tables
        ctx_lens, row_tables, lens = _row_attention(meta, groups)
        if abi.debug():  # what the caller vouches for
            half = (rows, self.head_dim // 2)
            assert residual.shape == (rows, self.hidden)
            assert all(
                c.shape == s.shape == half and c.is_contiguous() and s.is_contiguous() for c, s in ropes
            )
            assert max(entry.rope for entry in self.layers) < len(ropes)
            assert len(groups) == len(self.kv.groups) and meta.block_size == self.kv.block_size
            assert ctx_lens.shape == (rows,) and ctx_lens.dtype == torch.int32 and ctx_lens.is_contiguous()
            for m, t in zip(groups, row_tables, strict=True):
                assert m.slot_mapping.shape == (rows,) and m.slot_mapping.dtype == torch.int64
                assert t.shape[0] == rows and t.is_contiguous() and t.dtype == torch.int32
        slots = (_ptr * len(groups))(*(m.slot_mapping.data_ptr() for m in groups))
        tables = (_ptr * len(groups))(*(t.data_ptr() for t in row_tables))
        max_blocks = (ctypes.c_int32 * len(groups))(*(t.shape[1] for t in row_tables))
        per_key = self.q_heads * 2 * self.head_dim  # multiply-adds per key and sequence, as the plan splits
        bounds = paged_decode.split(lens, per_key)
        h, x, qkv, attn, act, query_rows, gate_up, moe_work = self._scratch(rows, residual)
        cos = (_ptr * len(ropes))(*(c.data_ptr() for c, _ in ropes))
        sin = (_ptr * len(ropes))(*(s.data_ptr() for _, s in ropes))
        step = StepMeta(
            len(self.layers),
            rows,
            self.hidden,
            self.q_heads,
            self.kv_heads,
            self.head_dim,
            self.inter,
            self.eps,
            self.scale,
            self.final_norm.data_ptr(),
            ctypes.addressof(cos),
            ctypes.addressof(sin),
            ctypes.addressof(slots),
            ctypes.addressof(tables),
            ctypes.addressof(max_blocks),
            len(groups),
            ctx_lens.data_ptr(),
            query_rows.data_ptr(),
            meta.block_size,
            ctypes.addressof(bounds),
            len(bounds) - 1,
            self.kv.num_blocks,
            self.qk_norm_all,
            self.residual_scale,
            self.gelu,
            self.clip_qkv,
        )
        refusal = abi.Refusal()
        code = self.decode_layers(
            self.layers,
            ctypes.byref(step),
            residual.data_ptr(),
            h.data_ptr(),
            x.data_ptr(),
            qkv.data_ptr(),
            attn.data_ptr(),
            act.data_ptr(),
            gate_up.data_ptr(),
            moe_work.data_ptr(),
            refusal,
        )
        abi.check(code, refusal, "decode step")
        return x


def _linear_roles(layer: torch.nn.Module) -> tuple[str, ...]:
    """The layer's linears the step reads as segments: all four, or a layer with experts' qkv and o."""
    return LINEAR_ROLES if layer.mlp is None else LINEAR_ROLES[:2]


def _dense_mlp_served(layer: torch.nn.Module) -> bool:
    """A dense MLP's gate-up and down in one segment each, the gate-up paired for SiLU (the GEMM's
    epilogue), plain for gelu-tanh (its chain after)."""
    gate_up = layer.gate_up_proj
    return (gate_up.paired if layer.activation == "silu" else not gate_up.gated) and len(
        gate_up.segments
    ) == len(layer.down_proj.segments) == 1


def _row_attention(
    meta: AttentionMetadata, groups: list[AttentionMetadata]
) -> tuple[torch.Tensor, list[torch.Tensor], list[int]]:
    """What the attention kernel reads per query row, as the layer-by-layer path hands it
    (`portable_backend.row_contexts`): each row's context length ``[T]`` int32, each layer group's
    block table of each row's sequence ``[T, max_blocks]`` int32, and the lengths as a list. In a
    decode-only step a row is its sequence, and the step's own tensors serve."""
    if meta.max_query_len == 1:
        lens = meta.context_lens_host
        if lens is None:  # a step through the graph path's static buffers (padding rows included)
            lens = meta.context_lens.tolist()
        return meta.context_lens, [m.block_tables for m in groups], lens
    seq, ctx_lens = row_contexts(meta)  # [T] each
    return ctx_lens, [m.block_tables[seq].contiguous() for m in groups], ctx_lens.tolist()


@dataclass(frozen=True)
class OneCall:
    """The model runner's choice for one decoding step: every layer in ``step``'s one C call, over
    the step's metadata (handed to the model's forward, which otherwise runs its layers one by one)."""

    step: DecodeStep
    meta: AttentionMetadata

    def run(self, residual: torch.Tensor, ropes: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """`DecodeStep.run` over this step's metadata: the final norm of the stream ``[S, H]``."""
        return self.step.run(residual, ropes, self.meta)
