"""The adapters' low-rank deltas on one base linear, added after the base GEMM ran for every row.

A site is one linear of the running model: a plain projection, or a fused one (our QKV and
gate-up linears) whose projections are column ranges of its output (`Part`). For each adapter
slot that targets it, the site keeps ``A^T`` of its projections side by side (``[in, R]``, R the sum of
their ranks) and ``B^T`` times the scaling placed in their columns (``[R, out]``, zero elsewhere), so one
adapter's rows cost two GEMMs per site, whatever it targets: ``y[rows] += (x[rows] @ A^T) @ B^T``.
No weight is merged: the base weights stay shared by every row of the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedinfer.lora import context
from pagedinfer.lora.adapter import LoRAWeights


@dataclass(frozen=True)
class Part:
    """A projection of the base checkpoint (its module name) and where its outputs sit in the site's."""

    name: str  # e.g. model.layers.0.self_attn.k_proj
    start: int  # first output column in the site's output
    width: int  # its out_features


class LoRASite:
    def __init__(
        self,
        in_features: int,
        parts: list[Part],
        dtype: torch.dtype,
        device: torch.device,
        logits: bool = False,
    ) -> None:
        self.in_features = in_features
        self.out_features = sum(p.width for p in parts)
        self.parts = parts
        self.dtype, self.device = dtype, device
        self.logits = logits  # an lm_head: it sees the logits rows, not every token
        self.weights: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # slot -> (A^T [in, R], B^T [R, out])

    def install(self, slot: int, found: dict[str, LoRAWeights], scaling: float) -> None:
        """Slot ``slot``'s matrices for the parts it targets (``found``: part name -> A, B)."""
        targeted = [(p, found[p.name]) for p in self.parts if p.name in found]
        if not targeted:
            return
        rank = sum(w.a.shape[0] for _, w in targeted)
        a_t = torch.empty(self.in_features, rank, dtype=self.dtype)  # [in, R]
        b_t = torch.zeros(rank, self.out_features, dtype=self.dtype)  # [R, out]
        at = 0
        for part, w in targeted:
            r = w.a.shape[0]
            a_t[:, at : at + r] = w.a.t()
            b_t[at : at + r, part.start : part.start + part.width] = w.b.t() * scaling
            at += r
        self.weights[slot] = (a_t.to(self.device), b_t.to(self.device))

    def uninstall(self, slot: int) -> None:
        """Drop slot ``slot``'s matrices (another adapter takes the slot)."""
        self.weights.pop(slot, None)

    def active(self) -> bool:
        """Whether a row of the running step has an adapter that targets this site."""
        ctx = context.current_context()
        return ctx is not None and any(s in self.weights for s, _, _ in self._ranges(ctx))

    def _ranges(self, ctx: context.LoRAContext) -> context.Ranges:
        return ctx.logits if self.logits else ctx.tokens

    def apply(self, y: torch.Tensor, x: torch.Tensor) -> None:
        """``y`` (``[N, out]``, the base output, contiguous) += each adapter's delta on its rows of ``x`` ``[N, in]``."""
        ctx = context.current_context()
        if ctx is None:
            return
        for slot, lo, hi in self._ranges(ctx):
            w = self.weights.get(slot)
            if w is not None:
                y[lo:hi].addmm_(x[lo:hi] @ w[0], w[1])  # [n, R] then [n, out]
