"""Our own decoder for the families `families` declares (llama, mistral, qwen2, qwen3, olmo2, granite,
phi3, gemma3_text; and the mixture-of-experts qwen3_moe, qwen2_moe, mixtral, olmoe, gpt_oss, whose MLP is
`moe.ExpertMLP` in the layers the family makes sparse), built for the engine's packed-row step.

transformers' modules run about 25 torch ops per layer plus their Python around them; at batch
1-16 that overhead is as large as the matrix multiplies. Here each layer is four GEMMs (fused QKV,
output, fused gate-up, down; concatenated once at load, packed for oneDNN by the loader like any
``nn.Linear``), three elementwise chains (`fused_ops`: residual add + RMSNorm twice, per-head norm +
RoPE in place) and SiLU x up (Gemma's gelu-tanh x up), and the attention call, which is the same
paged attention transformers' layers reach (`attention.interface.attend`, behind `paged_attention`:
same KV pool, kernels and step context). It reads the same Hugging Face checkpoints: config,
safetensors, tokenizer. Which checkpoint modules fill which linear and norm is the family's
declaration. transformers stays the reference (the parity tests compare the two) and the path for
every other family. Which path a step takes (these layers one by one, or all of them in the one-call
C step) is the runner's choice, passed to `forward`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from pagedinfer.attention import interface as attention
from pagedinfer.lora.site import LoRASite
from pagedinfer.model import families, fused_ops, moe, packed_linear
from pagedinfer.model.decode_step import OneCall
from pagedinfer.model.families.spec import EMBED, FINAL_NORM, HF_LAYER, LM_HEAD, Experts, Family, Sizes
from pagedinfer.model.gguf_blocks import GGUFWeight
from pagedinfer.model.validate import Found, sizes

# the kinds these layers compute (`fused_ops`): a family declaring another is served by transformers
NORMS, ACTIVATIONS, ROPES = ("rms",), ("silu", "gelu_pytorch_tanh"), ("half",)
# RoPE kinds that recompute their angles as a sequence grows: per layer type (`Family.rope_by_layer_type`)
# our tables follow one set of parameters each, not transformers' updates of them
GROWING_ROPES = ("dynamic", "longrope")


def unsupported_reason(config) -> str | None:
    """Why this config cannot run through our implementation (None: it can)."""
    kind = getattr(config, "model_type", "?")
    family = families.find(config)
    if family is None:
        return f"model family {kind!r} has no pagedinfer implementation ({families.names()} do)"
    if (act := family.activation_of(config)) not in ACTIVATIONS:
        return f"activation {act!r} (pagedinfer's implementation has {', '.join(ACTIVATIONS)} only)"
    if family.norm not in NORMS:
        return f"norm {family.norm!r} (pagedinfer's implementation has {', '.join(NORMS)} only)"
    if family.rope not in ROPES:
        return f"RoPE {family.rope!r} (pagedinfer's implementation has {', '.join(ROPES)} only)"
    if quantized := getattr(config, "quantization_config", None):  # e.g. gpt-oss's MXFP4 experts
        method = (
            quantized.get("quant_method", "?") if isinstance(quantized, dict) else type(quantized).__name__
        )
        return f"quantization_config {method!r} (pagedinfer's implementation reads unquantized weights only)"
    if getattr(config, "use_bidirectional_attention", False):
        return "use_bidirectional_attention (pagedinfer's implementation attends causally only)"
    rope = getattr(config, "rope_parameters", None) or {}
    for params in rope.values() if family.rope_by_layer_type else [rope]:
        if (rotary := params.get("partial_rotary_factor", 1.0)) != 1.0:  # the C chains rotate whole heads
            return f"partial_rotary_factor {rotary} (pagedinfer's implementation rotates whole heads only)"
        if family.rope_by_layer_type and (kind := params.get("rope_type")) in GROWING_ROPES:
            return f"rope_type {kind!r} per layer type (pagedinfer's implementation has fixed angles there)"
    switch = rope.get("original_max_position_embeddings") or getattr(
        config, "original_max_position_embeddings", 0
    )
    if rope.get("rope_type") == "longrope" and switch and config.max_position_embeddings > switch:
        # transformers recomputes a sequence's whole cache with the long factors once it passes the
        # switch (Phi3's prepare_inputs_for_generation); a paged pool keeps its K as written
        return (
            f"LongRoPE past original_max_position_embeddings ({switch}): transformers recomputes a "
            "sequence's cache with the long factors there, pagedinfer's implementation does not"
        )
    return moe.unsupported_reason(family, config)


@dataclass
class CausalLMOutput:
    logits: torch.Tensor  # [1, R, vocab]


def _linear(weight: torch.Tensor, bias: torch.Tensor | None, cls: type[nn.Linear] = nn.Linear) -> nn.Linear:
    """An ``nn.Linear`` (or ``cls``) around given tensors (no initialisation); the loader packs it."""
    lin = cls(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    lin.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias, requires_grad=False)
    return lin


def _fused(
    parts: list[torch.Tensor | GGUFWeight],
    biases: list[torch.Tensor | None],
    cls: type[nn.Linear] = nn.Linear,
) -> nn.Module:
    """One linear from row-concatenated parts (q, k, v; gate, up; or one weight): float tensors are
    concatenated into an ``nn.Linear`` the loader packs (one part as it is; the parts' pages, the
    checkpoint's memory map, handed back once copied: resident beside the copies they raised a float32
    load's peak by 280 MB on SmolLM2-135M); a GGUF's blocks go to panels in their own types at once
    (`packed_linear.gguf_linear`)."""
    bias = None if biases[0] is None else torch.cat(biases)
    if all(isinstance(p, torch.Tensor) for p in parts):
        if len(parts) == 1:
            return _linear(parts[0], bias, cls)
        weight = torch.cat(parts)
        for p in parts:
            if p.device.type == "cpu":
                packed_linear.release_pages(p)
        return _linear(weight, bias, cls)
    return packed_linear.gguf_linear(parts, biases, gated=cls is fused_ops.GatedLinear)


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.contiguous(), requires_grad=False)


class DecoderLayer(nn.Module):
    def __init__(
        self, config, family: Family, idx: int, sd: dict[str, torch.Tensor], s: Sizes, norm_offset: float
    ) -> None:
        super().__init__()
        p = HF_LAYER.format(idx)
        self.layer_idx = idx  # the attention function finds this layer's pool tensors by it
        self.q_heads, self.kv_heads, self.head_dim = s.heads, s.kv_heads, s.head_dim
        scalars = family.multipliers
        # Granite's attention scale (or Gemma's query_pre_attn_scalar ** -0.5) and the factor of each
        # branch before its residual add (None: 1)
        if scalars is not None:
            self.scaling = getattr(config, scalars.attention)
        elif family.query_scale is not None:
            self.scaling = getattr(config, family.query_scale) ** -0.5
        else:
            self.scaling = self.head_dim**-0.5
        self.residual_scale = None if scalars is None else getattr(config, scalars.residual)
        self.eps = config.rms_norm_eps
        types = getattr(config, "layer_types", None)
        if types:  # qwen2/qwen3: a window on the layers marked sliding only
            window = config.sliding_window if types[idx] == "sliding_attention" else None
        else:  # mistral: one window for all layers; llama: none
            window = getattr(config, "sliding_window", None)
        self.window = window or 0
        # which of the model's RoPE tables this layer rotates by (`rope_tables`)
        self.rope = rope_tables(config, family).index(types[idx] if family.rope_by_layer_type else None)
        # the MLP's activation: SiLU in the gate-up GEMM's epilogue (paired panels), or gelu-tanh by
        # its own chain over the plain product [T, 2 I]
        self.activation = family.activation_of(config)
        gated = self.activation == "silu"
        # qkv [(Hq + 2 Hkv) * D, H] (bias [(Hq + 2 Hkv) * D]); o [H, Hq * D]; gate_up [2 I, H], giving
        # silu(gate) * up [T, I] (gelu-tanh: gate, up [T, 2 I]); down [H, I]: each from the modules
        # the family fuses in it (a layer with experts: qkv and o, and the experts' MLP in place of
        # gate_up and down)
        linears = {
            role: _fused(
                [sd.pop(f"{p}{m}.weight") for m in modules],
                [sd.pop(f"{p}{m}.bias", None) for m in modules],
                fused_ops.GatedLinear if role == "gate_up" and gated else nn.Linear,
            )
            for role, modules in family.linears_at(config, idx).items()
        }
        self.qkv_proj, self.o_proj = linears["qkv"], linears["o"]
        self.mlp = _experts(config, family, p, sd, s) if family.sparse_at(config, idx) else None
        if self.mlp is None:
            self.gate_up_proj, self.down_proj = linears["gate_up"], linears["down"]
        norms = {
            role: _norm_weight(sd.pop(f"{p}{m}.weight"), norm_offset) for role, m in family.norms.items()
        }
        # [H] each, as the family places them: on the attention's and the MLP's inputs (input_norm,
        # post_norm), or on their outputs before each residual add (attn_out_norm, mlp_out_norm)
        self.input_norm, self.post_norm = norms.get("input_norm"), norms.get("post_norm")
        self.attn_out_norm, self.mlp_out_norm = norms.get("attn_out_norm"), norms.get("mlp_out_norm")
        self.norms_after = family.norm_placement == "post"
        # [D] where the family norms each head (the C chain's); [Hq D] and [Hkv D] where it norms all
        # of q and all of k (`_norm_all_qk`)
        self.q_norm, self.k_norm = norms.get("q_norm"), norms.get("k_norm")
        # [Hq] a sink logit per query head (gpt-oss's), None where the family has none
        self.sinks = None if family.sinks is None else _param(sd.pop(f"{p}{family.sinks}"))
        self.qk_norm_all = family.qk_norm_over == "all"
        self.clip_qkv = getattr(config, "clip_qkv", None)  # OLMoE's clamp of q, k and v (None: none)
        self.lora = None  # its LoRA sites (`lora_sites.LayerSites`) once an engine enables LoRA

    def forward(
        self,
        h: torch.Tensor,  # [T, H] the previous layer's MLP branch (None in layer 0)
        residual: torch.Tensor,  # [T, H] the residual stream, updated in place
        cos: torch.Tensor,  # [T, D / 2]
        sin: torch.Tensor,  # [T, D / 2]
        fast: bool,
    ) -> torch.Tensor:  # [T, H] this layer's MLP branch, as it is added to ``residual`` (not yet added)
        t, hq, hkv, d = residual.shape[0], self.q_heads, self.kv_heads, self.head_dim
        if self.norms_after:  # the stream itself is the attention's input
            if h is not None:
                residual.add_(h)
            x = residual
        else:
            x = fused_ops.add_rms_norm(residual, h, self.input_norm, self.eps, fast)  # [T, H]
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hkv) * D]
        lora = self.lora
        if lora is not None:
            lora.qkv.apply(qkv, x)
        if self.qk_norm_all or self.clip_qkv is not None:
            self._norm_all_qk(qkv, fast)
            fused_ops.qk_norm_rope_(qkv, hq, hkv, d, cos, sin, None, None, self.eps, fast)
        else:
            fused_ops.qk_norm_rope_(qkv, hq, hkv, d, cos, sin, self.q_norm, self.k_norm, self.eps, fast)
        heads = qkv.view(t, hq + 2 * hkv, d)  # [T, Hq + 2 Hkv, D]: q, k, v are views into it
        out = attention.attend(
            self.layer_idx,
            heads[:, :hq],
            heads[:, hq : hq + hkv],
            heads[:, hq + hkv :],
            self.scaling,
            self.window,
            sinks=self.sinks,
        ).view(t, hq * d)  # [T, Hq D]
        o = self.o_proj(out)  # [T, H]
        if lora is not None:
            lora.o.apply(o, out)
        o = self._branch(o, self.attn_out_norm, fast)
        if self.norms_after:
            residual.add_(o)
            x = residual
        else:
            x = fused_ops.add_rms_norm(residual, o, self.post_norm, self.eps, fast)
        if self.mlp is not None:  # the experts (LoRA sites: attention's linears only)
            return self.mlp(x)
        if lora is not None and lora.gate_up.active():  # deltas go in before act(gate) * up
            gate_up = packed_linear.ungated(self.gate_up_proj, x)  # [T, 2 I]
            lora.gate_up.apply(gate_up, x)
            act = fused_ops.act_mul(gate_up, self.activation, fast)  # [T, I]
        elif self.activation == "silu":
            act = self.gate_up_proj(x)  # [T, I]: the GEMM's epilogue
        else:
            act = fused_ops.act_mul(self.gate_up_proj(x), self.activation, fast)  # [T, I]
        down = self.down_proj(act)  # [T, H]
        if lora is not None:
            lora.down.apply(down, act)
        return self._branch(down, self.mlp_out_norm, fast)

    def _branch(self, out: torch.Tensor, norm: torch.Tensor | None, fast: bool) -> torch.Tensor:
        """A branch's output [T, H] as it is added to the stream: normed where the family norms it
        there (OLMo-2), times Granite's residual multiplier (in place) where it has one."""
        if norm is not None:
            out = fused_ops.add_rms_norm(out, None, norm, self.eps, fast)
        if self.residual_scale is not None:
            out.mul_(self.residual_scale)
        return out

    def _norm_all_qk(self, qkv: torch.Tensor, fast: bool) -> None:
        """In place, before RoPE: OLMoE's RMSNorm over all of q's rows and all of k's (where the family
        norms them so), then its clip of q, k and v to [-clip_qkv, clip_qkv] (where the config sets one)."""
        q_width, kv_width = self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        if self.qk_norm_all:
            for start, width, weight in ((0, q_width, self.q_norm), (q_width, kv_width, self.k_norm)):
                part = qkv[:, start : start + width].contiguous()  # [T, Hq D] or [T, Hkv D]
                qkv[:, start : start + width] = fused_ops.add_rms_norm(part, None, weight, self.eps, fast)
        if self.clip_qkv is not None:
            qkv.clamp_(-self.clip_qkv, self.clip_qkv)


def _norm_weight(weight: torch.Tensor, offset: float) -> nn.Parameter:
    """A norm's weight as the layers multiply by it: the family's offset added in float32 (Gemma's
    1 + weight; a float32 model's sum is transformers' bits), then in the weight's own dtype."""
    if offset:
        weight = (weight.float() + offset).to(weight.dtype)
    return _param(weight)


def _experts(config, family: Family, prefix: str, sd: dict, s: Sizes) -> moe.ExpertMLP:
    """A layer's mixture of experts from its tensors: the router, and each expert's gate-up (paired
    panels; plain ones where the family has its own activation) and down linears, as a dense layer's
    are made (float, quantized by the loader, or GGUF blocks), biased where the checkpoint holds biases."""
    spec = family.experts
    glu = None if spec.glu is None else spec.glu.of(config)
    gate_up_cls = fused_ops.GatedLinear if glu is None else nn.Linear

    def tensors(hf: str, expert: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        weight, bias = family.module(hf).names(prefix, expert)
        return sd.pop(weight), sd.pop(bias, None)

    def linear(hf: str, expert: int | None = None) -> nn.Module:
        weight, bias = tensors(hf, expert)
        return _fused([weight], [bias])

    def expert(gate_up: tuple[str, ...], down: str, e: int | None = None) -> moe.Expert:
        parts = [tensors(m, e) for m in gate_up]  # modules of one expert each: "{}" its index
        return moe.Expert(
            _fused([w for w, _ in parts], [b for _, b in parts], gate_up_cls), linear(down, e), glu
        )

    if family.module(spec.down).stacked:  # every expert's weights in one tensor each: split per expert
        experts = _stacked_experts(spec, *tensors(spec.gate_up[0]), *tensors(spec.down), gate_up_cls, glu)
    else:
        experts = [expert(spec.gate_up, spec.down, e) for e in range(s.experts)]
    router = linear(spec.router)  # [E, H] (bias [E] where the family's router has one)
    shared = None
    if spec.shared is not None:  # gate_up [2 I_shared, H], down [H, I_shared], gate [1, H]
        gate = _fused([sd.pop(f"{prefix}{spec.shared.gate}.weight")], [None])
        shared = moe.SharedExpert(expert(spec.shared.gate_up, spec.shared.down), gate)
    return moe.ExpertMLP(router, experts, s, spec.renormalises(config), shared)


def _stacked_experts(
    spec: Experts,
    gate_up: torch.Tensor,  # [E, H, 2 I]: x @ gate_up[e] (gate and up columns alternating where interleaved)
    gate_up_bias: torch.Tensor,  # [E, 2 I]
    down: torch.Tensor,  # [E, I, H]
    down_bias: torch.Tensor,  # [E, H]
    gate_up_cls: type[nn.Linear],
    glu: tuple[float, float] | None,
) -> list[moe.Expert]:
    """Each expert's linears from stacked tensors (gpt-oss's): weights transposed to [rows, in], an
    interleaved gate-up's rows put in halves (gate rows, then up), as our gate-up panels take them."""
    if spec.interleaved:  # [..., 0::2] gate, [..., 1::2] up -> [..., :I] gate, [..., I:] up
        gate_up = torch.cat([gate_up[..., 0::2], gate_up[..., 1::2]], dim=-1)
        gate_up_bias = torch.cat([gate_up_bias[..., 0::2], gate_up_bias[..., 1::2]], dim=-1)
    return [
        moe.Expert(
            _linear(gate_up[e].t().contiguous(), gate_up_bias[e].contiguous(), gate_up_cls),  # [2 I, H]
            _linear(down[e].t().contiguous(), down_bias[e].contiguous()),  # [H, I]
            glu,
        )
        for e in range(gate_up.shape[0])
    ]


class RotaryEmbedding(nn.Module):
    """transformers' RoPE of the families whose ``rope`` is "half" (their ``*RotaryEmbedding`` classes are
    one and the same): ``cos, sin`` of ``cat(freqs, freqs)`` from the same ``ROPE_INIT_FUNCTIONS`` and the
    same dynamic and long-context updates, so the values are transformers' own, without importing its
    modeling code (which loads torch's compiler stack: about a second of every start-up). The default
    RoPE (no scaling) is computed here as transformers computes it, and its update is none, so that
    transformers is imported only for a scaled RoPE."""

    def __init__(self, config, layer_type: str | None = None) -> None:
        super().__init__()
        self.config = config
        self.max_seq_len_cached = self.original_max_seq_len = config.max_position_embeddings
        # a family with RoPE per layer type: that type's parameters (never a growing kind: `GROWING_ROPES`)
        params = config.rope_parameters if layer_type is None else config.rope_parameters[layer_type]
        self.rope_type = params["rope_type"]
        by_type = {} if layer_type is None else {"layer_type": layer_type}
        if self.rope_type == "default":
            inv_freq, self.attention_scaling = _default_rope(config, **by_type)  # [D / 2]
            self._cos_sin = _cos_sin
        else:  # transformers' frequencies and its dynamic and long-context updates of them
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update

            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[self.rope_type](
                config, **by_type
            )  # [D / 2]
            self._cos_sin = dynamic_rope_update(_cos_sin)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._cos_sin(self, x, position_ids)


def _cos_sin(
    rope: RotaryEmbedding, x: torch.Tensor, position_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' rotary ``forward``: ``cos, sin`` of the positions' angles, in ``x``'s dtype."""
    freqs = position_ids[..., None].float() * rope.inv_freq.to(
        device=x.device, dtype=torch.float
    )  # [1, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [1, T, D]
    return (emb.cos() * rope.attention_scaling).to(x.dtype), (emb.sin() * rope.attention_scaling).to(x.dtype)


def _default_rope(config, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """The original RoPE's inverse frequencies (transformers' ``compute_default_rope_parameters``)."""
    params = config.rope_parameters if layer_type is None else config.rope_parameters[layer_type]
    base = params["rope_theta"]
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0  # [D / 2]


def rope_tables(config, family: Family) -> list[str | None]:
    """The model's RoPE tables, by layer type where the family rotates each type by its own
    parameters (in the order of the config's first layers of each type), else one (None)."""
    if not family.rope_by_layer_type:
        return [None]
    return list(dict.fromkeys(config.layer_types[: config.num_hidden_layers]))


class LlamaFamilyForCausalLM(nn.Module):
    """``forward(input_ids [1, T], position_ids [1, T], logits_to_keep)`` like HF's, on the packed row."""

    def __init__(
        self, config, family: Family, sd: dict[str, torch.Tensor], norm_offset: float | None = None
    ) -> None:
        """``norm_offset``: added to every norm's weight at load (None: the family's, for a Hugging Face
        checkpoint; a GGUF's norms are the multipliers as llama.cpp's converter stored them: 0)."""
        super().__init__()
        norm_offset = family.norm_weight_offset if norm_offset is None else norm_offset
        self.config = config
        self.family = family  # its declaration: the LoRA sites name the modules of each fused linear by it
        self.sizes = sizes(config, "the config")  # checked by the loader (`validate.check_tensors`) already
        self.eps = config.rms_norm_eps
        scalars = family.multipliers  # Granite's: the embeddings' factor, the logits' divisor (None: 1)
        self.embed_scale = None if scalars is None else getattr(config, scalars.embedding)
        self.logits_scale = None if scalars is None else getattr(config, scalars.logits)
        softcap = family.logits_softcap and getattr(config, family.logits_softcap, None)
        self.logits_softcap = softcap or None  # Gemma's cap * tanh(logits / cap) (None: none)
        embed = sd.pop(f"{EMBED}.weight")  # [V, H]
        self.embed_tokens: nn.Module
        if isinstance(embed, GGUFWeight):  # looked up from its panels, which a tied lm_head shares
            table = packed_linear.gguf_segment([embed], None, gated=False)
            self.embed_tokens = packed_linear.PanelEmbedding(table)
            looked_up = table.activation_dtype
        else:
            self.embed_tokens = nn.Embedding.from_pretrained(embed, freeze=True)
            looked_up = embed.dtype
        if family.embedding_scaled:  # sqrt(H) rounded to the embeddings' dtype, as transformers' Gemma
            self.embed_scale = torch.tensor(config.hidden_size**0.5).to(looked_up).item()
        self.layers = nn.ModuleList(
            DecoderLayer(config, family, i, sd, self.sizes, norm_offset)
            for i in range(config.num_hidden_layers)
        )
        self.norm = _norm_weight(sd.pop(f"{FINAL_NORM}.weight"), norm_offset)  # [H]
        head = sd.pop(f"{LM_HEAD}.weight", None)
        tied = head is None or getattr(config, "tie_word_embeddings", False)
        if tied and isinstance(embed, GGUFWeight):
            self.lm_head = packed_linear.PackedLinear.from_segments(
                table.in_features, table.cols, False, [table]
            )
        elif tied:
            self.lm_head = _linear(self.embed_tokens.weight, None)  # the loader's packing keeps the embedding
        else:
            self.lm_head = _fused([head], [None])
        # one per RoPE table (`rope_tables`); each layer's ``rope`` indexes them
        self.rotary = nn.ModuleList(RotaryEmbedding(config, t) for t in rope_tables(config, family))
        self.lora_head: LoRASite | None = None  # lm_head's LoRA site once an engine enables LoRA
        if sd:
            raise ValueError(f"unexpected weights in the checkpoint: {', '.join(sorted(sd)[:5])}")

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def forward(
        self,
        input_ids: torch.Tensor,  # [1, T]
        position_ids: torch.Tensor,  # [1, T]
        logits_to_keep: int | torch.Tensor = 0,  # HF's meaning: 0 all rows, k the last k, or row indices
        one_call: OneCall | None = None,  # the runner's choice: every layer in the C step (else one by one)
        **_: object,
    ) -> CausalLMOutput:
        residual = self.embed_tokens(input_ids[0])  # [T, H], the residual stream from here on
        if self.embed_scale is not None:
            residual.mul_(self.embed_scale)
        fast = fused_ops.use_c(residual)
        ropes = []  # (cos, sin) [T, D / 2] each, per RoPE table
        for rotary in self.rotary:
            cos, sin = rotary(residual, position_ids)  # [1, T, D]: cat(freqs, freqs), halves equal
            half = cos.shape[-1] // 2
            ropes.append((cos[0, :, :half].contiguous(), sin[0, :, :half].contiguous()))
        if isinstance(logits_to_keep, torch.Tensor):
            keep = logits_to_keep
        else:
            keep = slice(-logits_to_keep, None) if logits_to_keep else slice(None)
        if one_call is not None:  # a decoding step: all layers and the final norm in one C call
            x = one_call.run(residual, ropes)[keep].contiguous()  # [R, H]
        else:
            h = None
            for layer in self.layers:
                h = layer(h, residual, *ropes[layer.rope], fast)
            residual, h = residual[keep].contiguous(), h[keep].contiguous()  # [R, H]
            x = fused_ops.add_rms_norm(residual, h, self.norm, self.eps, fast)  # [R, H]
        if x.shape[0] == 0:  # no lm_head for no rows
            return CausalLMOutput(x.new_empty(1, 0, self.lm_head.out_features))
        logits = self.lm_head(x)  # [R, vocab]
        if self.lora_head is not None:
            self.lora_head.apply(logits, x)
        if self.logits_scale is not None:
            logits.div_(self.logits_scale)
        if self.logits_softcap is not None:  # transformers' three ops, in its order
            logits.div_(self.logits_softcap).tanh_().mul_(self.logits_softcap)
        return CausalLMOutput(logits.unsqueeze(0))  # [1, R, vocab]


def checkpoint_files(name: str, local_files_only: bool = False) -> list[Path]:
    """The safetensors files of a model directory or a hub id (``local_files_only``: from the cache)."""
    path = Path(name).expanduser()
    if not path.is_dir():
        from huggingface_hub import snapshot_download

        try:
            path = Path(
                snapshot_download(name, allow_patterns=["*.safetensors"], local_files_only=local_files_only)
            )
        except Exception:  # noqa: BLE001 - no safetensors to be had: the caller falls back
            return []
    return sorted(path.glob("*.safetensors"))


def tensor_index(files: list[Path]) -> dict[str, Found]:
    """Each tensor's shape and dtype, from the safetensors headers alone (`validate.check_tensors`)."""
    out = {}
    for f in files:
        with safe_open(str(f), "pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
                if "rotary_emb" not in name:
                    part = st.get_slice(name)
                    out[name] = Found(tuple(part.get_shape()), part.get_dtype(), name, str(f))
    return out


def read_weights(files: list[Path], dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors cast to ``dtype`` on ``device`` (RoPE buffers left out)."""
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        for name, stored in load_file(str(f)).items():
            if "rotary_emb" in name:
                continue
            sd[name] = stored.to(device=device, dtype=dtype)
            if sd[name].data_ptr() != stored.data_ptr():  # a copy: the stored pages need not stay resident
                packed_linear.release_pages(stored)
    return sd


def build(
    config, family: Family, sd: dict[str, torch.Tensor], device: torch.device
) -> LlamaFamilyForCausalLM:
    """The model from its config and the tensors of `read_weights` (checked by `validate` first)."""
    return LlamaFamilyForCausalLM(config, family, sd).to(device).eval()


def weight_files(files: list[Path]) -> str:
    """The checkpoint's files in a few words: one path, or how many in which folder."""
    return str(files[0]) if len(files) == 1 else f"{len(files)} files in {files[0].parent}"


def from_gguf(config, family: Family, sd: dict[str, torch.Tensor | GGUFWeight]) -> LlamaFamilyForCausalLM:
    """Build the model from a GGUF's tensors (`gguf.state_dict`): its blocks in panels of their own
    types as they are read, the float tensors as they are (on the CPU); each norm's weight the
    multiplier as stored (Gemma 3's 1 + weight, summed by llama.cpp's converter: kept as the value
    llama.cpp multiplies by, not taken apart and summed again)."""
    return LlamaFamilyForCausalLM(config, family, sd, norm_offset=0.0).eval()
