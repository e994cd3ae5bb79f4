"""A mixture-of-experts MLP on the panels: the router, and each expert a gated MLP of its own linears.

A step's rows are grouped by expert (each row's top-k choices, sorted by expert, stably: rows in step
order within an expert), and each expert's two GEMMs (gate-up paired, then down) run once over its
rows, through the same panels a dense layer's linears use, so its GEMM gives a row the same bits
whatever the other rows are. A row's output is then the weighted sum of its k expert outputs in
rank order (its highest-scored expert first), each row on its own: not an index-add in expert order,
whose sum for a row would depend on which other rows share the step. A shared expert (Qwen2-MoE's)
runs on every row through its own panels, scaled by a sigmoid computed row by row (`sigmoid`), and is
added to that sum. So the reproducibility contract (docs/reproducibility.md) holds for these layers
as for the dense ones. Where every expert is on the panels, the routing, grouping, GEMMs and sums
after the router run as one C call (`moe_kernel`, the same arithmetic in the same order: the same
bits); the torch loop here serves every other case.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pagedinfer.model import fused_ops
from pagedinfer.model.families.spec import Family, Sizes
from pagedinfer.model.moe_kernel import MoeLayer, RoutedExperts

SCORINGS = ("softmax",)  # the router scorings computed here (a family declaring another: transformers)


class Expert(nn.Module):
    """One expert: ``down(silu(gate(x)) * up(x))``, its gate and up rows fused (paired panels); or,
    with ``glu`` (gpt-oss's (alpha, limit)), its clamped SwiGLU over a plain gate-up product."""

    def __init__(self, gate_up: nn.Module, down: nn.Module, glu: tuple[float, float] | None = None) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj = gate_up, down  # [2 I, H] (giving [T, I], or [T, 2 I]); [H, I]
        self.glu = glu

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        act = self.gate_up_proj(x)  # [T, I] (SiLU in the panels' epilogue), or [T, 2 I]
        if self.glu is not None:
            act = fused_ops.clamped_swiglu(act, *self.glu, fused_ops.use_c(act))  # [T, I]
        return self.down_proj(act)


class SharedExpert(nn.Module):
    """An expert every row runs, its output scaled by ``sigmoid(gate(x))`` (``gate``: a linear
    ``[1, H]``, one logit per row)."""

    def __init__(self, expert: Expert, gate: nn.Module) -> None:
        super().__init__()
        self.expert, self.gate = expert, gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        return self.expert(x) * sigmoid(self.gate(x))  # [T, H] * [T, 1]


class ExpertMLP(nn.Module):
    """The router (a linear ``[E, H]``), the top k experts of each row weighted by the softmax of the
    router's logits, renormalised over the k where the family says (as transformers' routers compute
    them; `route`), and the experts; the shared expert's output added where the family has one."""

    def __init__(
        self,
        router: nn.Module,
        experts: list[Expert],
        s: Sizes,
        renormalise: bool,
        shared: SharedExpert | None = None,
    ) -> None:
        super().__init__()
        self.router = router
        self.experts = nn.ModuleList(experts)
        self.shared = shared
        self.top_k, self.renormalise = s.top_k, renormalise
        self._routed: RoutedExperts | None = None  # see `_c_experts`

    def _c_experts(self, x: torch.Tensor) -> RoutedExperts | None:
        """The one C call for these experts where it serves ``x`` (`moe_kernel`): made once the loader
        has put the experts on the panels (linears are packed after the layers are built, never
        unpacked), else None (the torch loop)."""
        if self._routed is None and x.device.type == "cpu":
            glu = self.experts[0].glu
            if RoutedExperts.serves(self.experts, glu):
                self._routed = RoutedExperts(list(self.experts), self.top_k, self.renormalise, glu)
        routed = self._routed
        return routed if routed is not None and x.dtype == routed.dtype and x.device.type == "cpu" else None

    def one_call_layer(self, dtype: torch.dtype) -> MoeLayer | None:
        """This MLP for the one-call decode step under ``dtype`` activations: where the C call serves its
        experts (`_c_experts`) and its router and shared expert are panel linears of that dtype
        (`MoeLayer.serves`); else None (the step declines the model)."""
        routed = self._c_experts(torch.empty(0, dtype=dtype))  # (a CPU tensor of that dtype)
        if routed is None or not MoeLayer.serves(routed, self.router, self.shared):
            return None
        return MoeLayer(routed, self.router, self.shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        t, h, k = x.shape[0], x.shape[1], self.top_k
        logits = self.router(x)  # [T, E]
        routed = self._c_experts(x)
        if routed is not None and logits.dtype == x.dtype:  # the same choice, weights, grouping, GEMMs, sums
            y = routed.run(x, logits)
            if self.shared is not None:
                y += self.shared(x)
            return y
        weights, chosen = route(logits, k, self.renormalise)  # [T, k] each, highest first
        weights = weights.to(logits.dtype)  # as transformers' routers hand them to the experts
        slots = chosen.reshape(-1)  # [T k]: slot t * k + r is row t's rank-r expert
        order = torch.argsort(slots, stable=True)  # [T k]: slots grouped by expert, rows in order
        rows = order // k  # [T k]: each grouped slot's row
        counts = torch.bincount(slots, minlength=len(self.experts)).tolist()
        grouped = x.new_empty(t * k, h)  # [T k, H]: each grouped slot's expert output
        at = 0
        for expert, n in zip(self.experts, counts, strict=True):
            if n:
                grouped[at : at + n] = expert(x[rows[at : at + n]])  # [n, H]: its rows, one GEMM each
                at += n
        outs = torch.empty_like(grouped)
        outs[order] = grouped
        outs = outs.view(t, k, h)  # [T, k, H]: row t's rank-r expert output
        y = outs[:, 0] * weights[:, :1]  # [T, H]
        for r in range(1, k):  # rank order, each row on its own
            y += outs[:, r] * weights[:, r : r + 1]
        if self.shared is not None:  # after the routed experts' sum, as transformers adds it
            y += self.shared(x)
        return y


def route(logits: torch.Tensor, k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's top ``k`` experts (highest logit first, of tied logits the lower index first: a stable
    sort's order, which kernels/cpu_moe.c's choice follows, where torch.topk's order among ties is its
    own) and their softmax weights (float32, over every expert, or over the k where ``renormalise``):
    ``[T, k]`` each.

    Not torch's softmax: its sum's order follows the vector width (another on an AVX2 CPU than on an
    AVX-512 one), and torch's elementwise exp takes a tensor's last elements through the C library's
    expf, so an element's bits would follow the row count. Here the exponentials are `_exp`'s (float64
    multiplies and adds, each exact IEEE arithmetic on any CPU) and the sums a fixed pairwise tree
    (`_fixed_sum`), rounded to float32 once: the same bits for a row on every CPU and in any step."""
    chosen = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :k]  # [T, k]: softmax
    # keeps the logits' order
    x = logits.double()
    e = _exp(x - x.amax(dim=-1, keepdim=True))  # [T, E] in (0, 1], the top expert's 1
    top = e.gather(1, chosen)  # [T, k]
    return (top / _fixed_sum(top if renormalise else e)).float(), chosen


EXP_TERMS = 18  # Taylor terms of exp(r) for |r| <= ln 2 / 2: the next is below 1e-22


def _exp(x: torch.Tensor) -> torch.Tensor:  # float64 [...] <= 0 -> exp(x) [...]
    """``exp`` by range reduction (``x = n ln 2 + r``) and a Taylor polynomial in Horner form, all
    elementwise float64 arithmetic (no library exponential), then the exact power of two from its bits;
    below 2^-1022 (weights no float32 sum can tell from 0): 0."""
    n = torch.round(x / math.log(2))
    r = x - n * math.log(2)  # [...] in [-ln 2 / 2, ln 2 / 2]
    p = torch.ones_like(r)
    for i in range(EXP_TERMS, 0, -1):
        p = 1 + p * r / i
    power = ((n.clamp(min=-1022).to(torch.int64) + 1023) << 52).view(torch.float64)  # 2^n exactly
    return torch.where(n < -1022, 0.0, p * power)


def sigmoid(z: torch.Tensor) -> torch.Tensor:  # [...] -> [...] in z's dtype
    """``1 / (1 + exp(-z))``, not torch's sigmoid, whose last elements take another path than the
    vectorised body (as its exp's do: see `route`), so a row's bits would follow the row count: here
    `_exp` of ``-|z|`` in float64 and one division (each exact IEEE arithmetic), rounded once."""
    x = z.double()
    e = _exp(-x.abs())  # (0, 1]
    return torch.where(x >= 0, 1 / (1 + e), e / (1 + e)).to(z.dtype)


def _fixed_sum(v: torch.Tensor) -> torch.Tensor:  # [T, n] -> [T, 1]
    """Each row's sum by halving (column i plus column i + n/2, an odd last column carried): one order
    of additions whatever the CPU's vector width."""
    while v.shape[1] > 1:
        half = v.shape[1] // 2
        v = torch.cat([v[:, :half] + v[:, half : 2 * half], v[:, 2 * half :]], dim=1)
    return v


def unsupported_reason(family: Family, config) -> str | None:
    """Why these layers cannot run ``config``'s experts (None: they can)."""
    spec = family.experts
    if spec is None:
        return None
    if spec.scoring not in SCORINGS:
        return f"router scoring {spec.scoring!r} (pagedinfer's implementation has {', '.join(SCORINGS)} only)"
    return None
