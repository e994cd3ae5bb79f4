"""A mixture-of-experts MLP on the panels: the router, and each expert a gated MLP of its own linears.

A step's rows are grouped by expert (each row's top-k choices, sorted by expert, stably: rows in step
order within an expert), and each expert's two GEMMs (gate-up paired, then down) run once over its
rows, through the same panels a dense layer's linears use, so its GEMM gives a row the same bits
whatever the other rows are. A row's output is then the weighted sum of its k expert outputs in
rank order (its highest-scored expert first), each row on its own: not an index-add in expert order,
whose sum for a row would depend on which other rows share the step. So the reproducibility contract
(docs/reproducibility.md) holds for these layers as for the dense ones.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedinfer.model.families.spec import Family, Sizes

SCORINGS = ("softmax",)  # the router scorings computed here (a family declaring another: transformers)


class Expert(nn.Module):
    """One expert: ``down(silu(gate(x)) * up(x))``, its gate and up rows fused (paired panels)."""

    def __init__(self, gate_up: nn.Module, down: nn.Module) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj = gate_up, down  # [2 I, H] (giving [T, I]); [H, I]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        return self.down_proj(self.gate_up_proj(x))


class ExpertMLP(nn.Module):
    """The router (a linear ``[E, H]``), softmax over the experts in float32, the top k, their scores
    renormalised where the family says (as transformers' routers compute them), and the experts."""

    def __init__(self, router: nn.Module, experts: list[Expert], s: Sizes, renormalise: bool) -> None:
        super().__init__()
        self.router = router
        self.experts = nn.ModuleList(experts)
        self.top_k, self.renormalise = s.top_k, renormalise

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        t, h, k = x.shape[0], x.shape[1], self.top_k
        logits = self.router(x)  # [T, E]
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
        weights, chosen = torch.topk(scores, k, dim=-1)  # [T, k] each, highest first
        if self.renormalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(logits.dtype)  # [T, k]
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
        return y


def unsupported_reason(family: Family, config) -> str | None:
    """Why these layers cannot run ``config``'s experts (None: they can)."""
    spec = family.experts
    if spec is None:
        return None
    if spec.scoring not in SCORINGS:
        return f"router scoring {spec.scoring!r} (pagedinfer's implementation has {', '.join(SCORINGS)} only)"
    dense = getattr(config, "mlp_only_layers", None) or getattr(config, "decoder_sparse_step", 1) != 1
    if dense:  # qwen3_moe's dense layers between the sparse ones: a layer shape not declared here
        return "dense MLP layers among its mixture-of-experts layers (mlp_only_layers / decoder_sparse_step)"
    return None
