"""The vocabulary of a family declaration: what pagedinfer's own layers need to know of a model family.

A `Family` says, in one place, which Hugging Face ``model_type`` values and which GGUF architecture
it is; each module of its checkpoint under both names with its weight's shape as a function of the
config (`Sizes`, by dimension names) and whether its weight and bias must, may or must not be there;
which modules our layers fuse into one panel linear (`LINEAR_ROLES`) and which norm fills which of
our layers' norms (`NORM_ROLES`) and where those sit (`PLACED_NORMS`: before or after each
branch); Granite's scalars (`Multipliers`); Gemma's norm weight offset, embedding scale, query scale,
softcaps and RoPE per layer type; which rows llama.cpp's converter permuted (undone on reading); and
the kinds of norm, activation and RoPE the layers compute; and, for a mixture-of-experts family, its
router and experts (`Experts`: which modules, how the router's scores are turned into weights); and,
for the families `own_config` reads without transformers, their config classes' defaults. The
loader, the GGUF reader, the validation, the config reader, the layers (and so the C step's
per-layer pointers) and the LoRA sites read it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

# our dense layer's linears, in the order a layer runs them: q, k and v rows fused; o; gate and up
# rows fused (the product is act(gate) * up); down. A family names the modules that fill each.
LINEAR_ROLES = ("qkv", "o", "gate_up", "down")
# our dense layer's norms: where they sit is the family's ``norm_placement``: "pre" (Llama), on the
# attention's and the MLP's inputs (``input_norm``, ``post_norm``); "post" (OLMo-2), on the attention's
# and the MLP's outputs, each before its residual add (``attn_out_norm``, ``mlp_out_norm``); "both"
# (Gemma 3), the four; and (optional) on q and k
NORM_ROLES = ("input_norm", "post_norm", "attn_out_norm", "mlp_out_norm", "q_norm", "k_norm")
PLACED_NORMS = {
    "pre": ("input_norm", "post_norm"),
    "post": ("attn_out_norm", "mlp_out_norm"),
    "both": ("input_norm", "post_norm", "attn_out_norm", "mlp_out_norm"),
}
HF_LAYER = "model.layers.{}."  # a layer's modules' prefix in Hugging Face names (in GGUF names: "blk.{}.")
# what each dimension name of a shape stands for, in the config's fields (messages show these)
DIMS = {
    "vocab": "vocab_size",
    "hidden": "hidden_size",
    "inter": "intermediate_size",
    "q": "num_attention_heads * head_dim",
    "kv": "num_key_value_heads * head_dim",
    "qkv": "(num_attention_heads + 2 * num_key_value_heads) * head_dim",  # a checkpoint's fused q, k, v
    "gate_up": "2 * intermediate_size",  # a checkpoint's fused gate and up
    "head_dim": "head_dim",
    "experts": "num_experts (mixtral: num_local_experts)",
    "expert_inter": "moe_intermediate_size",
    "shared_inter": "shared_expert_intermediate_size",
    "one": "1",
    "heads": "num_attention_heads",
}
# llama.cpp's size keys (after "<arch>.") that become the config's sizes; each a positive integer
GGUF_SIZE_KEYS = (
    "context_length",
    "embedding_length",
    "feed_forward_length",
    "block_count",
    "attention.head_count",
    "attention.head_count_kv",
    "rope.dimension_count",
    "vocab_size",
)
GGUF_FLOAT_KEYS = ("rope.freq_base", "attention.layer_norm_rms_epsilon")  # each finite and positive


class Need(enum.Enum):
    """Whether a checkpoint must hold a tensor, may, or must not."""

    REQUIRED = "required"
    OPTIONAL = "optional"  # e.g. a Llama's biases (its config's attention_bias), a tied lm_head
    ABSENT = "absent"


@dataclass(frozen=True)
class Sizes:
    """The sizes a family's layers are built from (checked against each other by `validate.sizes`)."""

    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    experts: int = 0  # mixture-of-experts layers: the experts per layer (0: a dense model)
    top_k: int = 0  # the experts each token runs
    expert_inter: int = 0  # each expert's gate / up rows where the family sizes them apart (qwen3_moe)
    shared_inter: int = 0  # the shared expert's gate / up rows (qwen2_moe; 0: none)

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def qkv(self) -> int:
        return self.q + 2 * self.kv

    @property
    def gate_up(self) -> int:
        return 2 * self.inter

    @property
    def one(self) -> int:
        """A dimension of one row: the shared expert's gate, a linear giving one logit per token."""
        return 1

    def shape(self, dims: tuple[str, ...]) -> tuple[int, ...]:
        """A declared shape's sizes, e.g. ``("q", "hidden")`` -> ``(Hq * D, H)``."""
        return tuple(getattr(self, d) for d in dims)


def formula(dims: tuple[str, ...]) -> str:
    """A declared shape in the config's fields, e.g. ``[num_attention_heads * head_dim, hidden_size]``."""
    return "[" + ", ".join(DIMS[d] for d in dims) + "]"


@dataclass(frozen=True)
class Module:
    """One module of a checkpoint: its weight (and bias) under Hugging Face and GGUF names."""

    hf: str  # e.g. "self_attn.q_proj" (inside layer i, after `HF_LAYER`), or a top-level name
    gguf: str  # e.g. "attn_q" (inside layer i, after "blk.{i}."), or a top-level name
    shape: tuple[str, ...]  # the weight's dimensions by `DIMS` names, numpy order [rows, in]
    weight: Need = Need.REQUIRED
    bias: Need = Need.ABSENT  # [rows]
    # one module per expert: ``hf`` holds "{}" for the expert's index ("mlp.experts.{}.gate_proj"); a
    # GGUF stores every expert's weight in one 3-D tensor [experts, rows, in] (llama.cpp's "*_exps")
    experts: bool = False
    # a matrix of one row [1, in] that llama.cpp's files store as a vector [in] (qwen2moe's
    # ffn_gate_inp_shexp): the reader takes either
    gguf_vector: bool = False
    # every expert's weight in one tensor [experts, in, rows] (multiplied as x @ W: a linear's weight
    # transposed) and its bias [experts, rows] (gpt-oss's "mlp.experts.down_proj"); ``shape`` is one
    # expert's [rows, in] as for the others
    stacked: bool = False
    # its tensors' names after the module's: ".weight" and ".bias"; a bare parameter (gpt-oss's
    # "self_attn.sinks") or stacked experts ("mlp.experts.down_proj", "mlp.experts.down_proj_bias")
    # are named by the module itself
    suffixes: tuple[str, str] = (".weight", ".bias")

    def hf_name(self, expert: int | None = None) -> str:
        """Its Hugging Face name, of expert ``expert`` for a module per expert."""
        return self.hf.format(expert) if self.experts else self.hf

    def tensors(self) -> list[tuple[str, tuple[str, ...], bool]]:
        """(name suffix, dims, required) of its weight and bias, where the checkpoint may hold them
        (stacked experts: as stored, ``[experts, in, rows]`` and ``[experts, rows]``)."""
        out = []
        weight, bias = self.suffixes
        for suffix, need, dims in ((weight, self.weight, self.shape), (bias, self.bias, self.shape[:1])):
            if need is not Need.ABSENT:
                out.append(
                    (suffix, ("experts", *reversed(dims)) if self.stacked else dims, need is Need.REQUIRED)
                )
        return out

    def names(self, prefix: str, expert: int | None = None) -> tuple[str, str]:
        """The state dict's names of its weight and bias inside ``prefix`` (a layer's "model.layers.0.")."""
        name = prefix + self.hf_name(expert)
        return name + self.suffixes[0], name + self.suffixes[1]


# the modules outside the layers, the same for every decoder family so far
DECODER_TOP = (
    Module("model.embed_tokens", "token_embd", ("vocab", "hidden")),
    Module("model.norm", "output_norm", ("hidden",)),
    Module("lm_head", "output", ("vocab", "hidden"), weight=Need.OPTIONAL),  # absent: tied to the embedding
)
EMBED, FINAL_NORM, LM_HEAD = (m.hf for m in DECODER_TOP)


@dataclass(frozen=True)
class SharedExpert:
    """A gated MLP every token runs beside its routed experts (Qwen2-MoE's), its output scaled by
    ``sigmoid(gate(x))`` (a linear ``[1, hidden]``, one logit per token) and added to theirs."""

    gate_up: tuple[str, str]  # its modules fused in its gate-up panels: gate rows, then up
    down: str
    gate: str  # the [1, hidden] linear whose sigmoid scales its output

    def modules(self) -> tuple[str, ...]:
        return (*self.gate_up, self.down, self.gate)


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation over its gate and up rows, each constant a config field:
    ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``."""

    alpha: str
    limit: str

    def of(self, config) -> tuple[float, float]:
        """(alpha, limit) as the config sets them."""
        return float(getattr(config, self.alpha)), float(getattr(config, self.limit))


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts MLP in place of the dense one: a router linear scores the experts, each
    token runs its top-k experts (each a gated MLP of its own), their outputs weighted by the scores;
    a shared expert beside them where the family has one. Which layers have the experts is `sparse`'s
    rule (the validation, the GGUF reader, the layers and the LoRA sites ask it, through the family)."""

    router: str  # the router module [experts, hidden] (its bias where the module declares one)
    # each expert's modules fused in its gate-up panels: gate rows, then up; or one module holding both
    gate_up: tuple[str, ...]
    down: str  # each expert's down module
    count: str  # the config field of the expert count
    # whether the top-k scores are renormalised to sum to 1: a config field (its default), or always
    renormalise: tuple[str, bool] | bool = True
    scoring: str = "softmax"  # softmax over every expert's logit, then the top k
    shared: SharedExpert | None = None
    # whether the config's mlp_only_layers and decoder_sparse_step make some layers dense (qwen2_moe,
    # qwen3_moe, as transformers builds them): those take the family's gate_up and down linears
    dense_layers: bool = False
    # whether the one gate-up module's rows alternate gate, up (gpt-oss's): put in halves at load
    interleaved: bool = False
    # the experts' activation where it is not the family's SiLU (gpt-oss's clamped SwiGLU)
    glu: ClampedSwiGLU | None = None

    def renormalises(self, config) -> bool:
        if isinstance(self.renormalise, bool):
            return self.renormalise
        key, default = self.renormalise
        return bool(getattr(config, key, default))

    def sparse(self, config, i: int) -> bool:
        """Whether layer ``i`` has the experts (else the family's dense MLP): every layer, or, where the
        family has dense layers, those not in mlp_only_layers whose number (from 1) decoder_sparse_step
        divides."""
        if not self.dense_layers:
            return True
        dense = getattr(config, "mlp_only_layers", None) or ()
        return i not in dense and (i + 1) % getattr(config, "decoder_sparse_step", 1) == 0

    def sparse_layers(self, config, layers: int) -> int:
        """How many of the first ``layers`` layers `sparse` gives the experts, counted without a pass
        over them (a hostile layer count is refused by the weights it needs, not looped over)."""
        if not self.dense_layers:
            return layers
        step = getattr(config, "decoder_sparse_step", 1)
        dense = getattr(config, "mlp_only_layers", None) or ()
        return layers // step - len({i for i in dense if 0 <= i < layers and (i + 1) % step == 0})

    def modules(self) -> tuple[str, ...]:
        """The layer modules of the experts' MLP: the router, the experts', the shared expert's."""
        shared = self.shared.modules() if self.shared is not None else ()
        return (self.router, *self.gate_up, self.down, *shared)


@dataclass(frozen=True)
class Multipliers:
    """Granite's scalars, each a config field: the embeddings times ``embedding``; ``attention`` the
    attention's scale in place of 1/sqrt(head_dim); each branch (attention's output, the MLP's) times
    ``residual`` before its residual add; the logits divided by ``logits``."""

    embedding: str = "embedding_multiplier"
    attention: str = "attention_multiplier"
    residual: str = "residual_multiplier"
    logits: str = "logits_scaling"


@dataclass(frozen=True)
class Family:
    """One model family as pagedinfer's own layers serve it (see the module docstring)."""

    model_types: tuple[str, ...]  # the Hugging Face config's model_type values it serves
    gguf_arch: str  # general.architecture of its GGUF files (mistral's are "llama")
    layer: tuple[Module, ...]  # one layer's modules, in the order validation checks them
    linears: dict[str, tuple[str, ...]]  # `LINEAR_ROLES` -> the modules fused in it, rows in order
    # `NORM_ROLES` -> its module: the two of its ``norm_placement``; q_norm and k_norm where it has them
    norms: dict[str, str]
    # module -> the head count (`Sizes` name) whose rows llama.cpp's converter interleaved for its RoPE
    # (as convert_hf_to_gguf.py's permute); the reader puts them back in rotate-half order
    gguf_permuted: dict[str, str] = field(default_factory=dict)
    top: tuple[Module, ...] = DECODER_TOP
    norm: str = "rms"  # "rms": x / sqrt(mean(x^2) + rms_norm_eps) * weight
    activation: tuple[str, str] = ("hidden_act", "silu")  # the config field naming the MLP's, its default
    # "half": dimension i rotates with i + D/2 (Hugging Face's rotate_half, llama.cpp's NEOX), by
    # angles from the config's rope_parameters (any rope_type transformers computes) and head_dim
    rope: str = "half"
    gguf_size_keys: tuple[str, ...] = GGUF_SIZE_KEYS
    gguf_float_keys: tuple[str, ...] = GGUF_FLOAT_KEYS
    # a mixture-of-experts MLP: then ``linears`` has qkv and o, and gate_up and down where some layers
    # are dense (`Experts.dense_layers`); ``layer`` every module of either kind of layer (`layer_at`)
    experts: Experts | None = None
    # what q_norm and k_norm normalise: each head on its own ("head", Qwen3: weights [D]) or all of q's
    # and all of k's rows at once ("all", OLMoE: weights [Hq D] and [Hkv D])
    qk_norm_over: str = "head"
    # GGUF metadata (after "<arch>.") -> the config field it sets, where transformers' GGUF reader
    # leaves it out; and config fields llama.cpp fixes for the architecture
    gguf_config_keys: dict[str, str] = field(default_factory=dict)
    gguf_config_fixed: dict[str, object] = field(default_factory=dict)
    # (metadata, arch) -> config fields as llama.cpp reads the file, over transformers' GGUF reader's
    # (Gemma 3's windows, RoPE bases, query scale); ValueError: a value llama.cpp reads otherwise
    gguf_config: Callable[[dict[str, object], str], dict[str, object]] | None = None
    # metadata key prefixes (after "<arch>.") transformers' GGUF reader is not shown, where it misreads
    # them (gpt-oss's "rope.scaling.": `gguf_config` reads them instead)
    gguf_unread: tuple[str, ...] = ()
    # the architecture whose keys its GGUF files share, where transformers' GGUF reader maps none for
    # its own (OLMoE's: llama's): the reader is shown the file under that name
    gguf_read_as: str | None = None
    # transformers' class defaults of the config.json fields `own_config` reads (the family's class's
    # fields: a file holding another family's field is left to transformers); empty: every file of
    # the family is read by transformers' config class
    config_defaults: dict[str, object] = field(default_factory=dict)
    # whether transformers' AutoTokenizer keeps the tokenizer class a tokenizer_config.json declares
    # (False: the family registers its own class, which replaces it)
    keeps_declared_tokenizer: bool = False
    # a GGUF tensor -> why a file holding it is refused (what it carries that the config would lack)
    gguf_refused_with: dict[str, str] = field(default_factory=dict)
    norm_placement: str = "pre"  # `PLACED_NORMS`: on each branch's input (Llama), output (OLMo-2) or both
    multipliers: Multipliers | None = None  # Granite's scalars
    # added to every norm's weight of a Hugging Face checkpoint once, at load (Gemma's norms multiply
    # by 1 + weight: 1.0); its llama.cpp files hold the sum (the converter adds it), taken as stored
    norm_weight_offset: float = 0.0
    # the embeddings times sqrt(hidden_size), that factor first rounded to the weights' dtype (Gemma)
    embedding_scaled: bool = False
    # the config field whose value to the power -0.5 is the attention's scale in place of head_dim's
    # (Gemma's query_pre_attn_scalar; None: head_dim's)
    query_scale: str | None = None
    # the config field of a tanh softcap on the final logits (cap * tanh(logits / cap); None in the
    # config: none), Gemma's final_logit_softcapping
    logits_softcap: str | None = None
    # the module of a learned sink logit per query head [heads] (gpt-oss's): softmax mass no key takes
    sinks: str | None = None
    # the family as its GGUF files lay out its tensors, where llama.cpp's converter stores them otherwise
    # than its Hugging Face checkpoints (gpt-oss: each expert's gate, up and down apart in the 3-D
    # "*_exps" tensors, not stacked and interleaved): what the GGUF reader, its checks and the layers
    # read for a GGUF file (None: the family itself)
    gguf_layout: Family | None = None
    # whether the config's rope_parameters holds one set per layer type (Gemma 3: "sliding_attention"'s
    # local base, "full_attention"'s global one and its scaling), each layer rotating by its type's
    rope_by_layer_type: bool = False

    @property
    def name(self) -> str:
        return self.model_types[0]

    @property
    def qk_norm(self) -> bool:
        """Whether q and k are normed before RoPE (per head, Qwen3; or all rows, OLMo-2): the C step's flag."""
        return "q_norm" in self.norms

    def module(self, hf: str) -> Module:
        """The layer module of Hugging Face name ``hf`` (e.g. "self_attn.q_proj")."""
        return next(m for m in self.layer if m.hf == hf)

    def sparse_at(self, config, i: int) -> bool:
        """Whether layer ``i`` of ``config``'s model has the experts' MLP (False: a dense family's)."""
        return self.experts is not None and self.experts.sparse(config, i)

    def layer_at(self, config, i: int) -> tuple[Module, ...]:
        """Layer ``i``'s modules: without the dense MLP's where it has the experts, without the
        experts' where it is dense."""
        if self.experts is None:
            return self.layer
        if self.experts.sparse(config, i):
            drop = {m for role in ("gate_up", "down") for m in self.linears.get(role, ())}
        else:
            drop = set(self.experts.modules())
        return tuple(m for m in self.layer if m.hf not in drop)

    def linears_at(self, config, i: int) -> dict[str, tuple[str, ...]]:
        """Layer ``i``'s linears (`LINEAR_ROLES`): qkv and o only where it has the experts."""
        if self.sparse_at(config, i):
            return {role: self.linears[role] for role in ("qkv", "o")}
        return self.linears

    def activation_of(self, config) -> str:
        """The MLP's activation as the config names it."""
        key, default = self.activation
        return getattr(config, key, default)
