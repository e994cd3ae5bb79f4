"""The adapters' low-rank deltas on one base linear, added after the base GEMM ran for every row.

A site is one linear of the running model: a plain projection, or a fused one (our QKV and
gate-up linears) whose projections are column ranges of its output (`Part`). For each adapter
slot that targets it, the site keeps ``A^T`` of its projections side by side (``[in, R]``, R the sum of
their ranks) and ``B^T`` placed in their columns (``[R, out]``, zero elsewhere), in float32, so one
adapter's rows cost two products per site, whatever it targets: ``y[rows] += scaling * (x[rows] A^T)
B^T`` (`delta`: a C kernel whose rows do not depend on each other). No weight is merged: the base
weights stay shared by every row of the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedinfer.lora import context
from pagedinfer.lora.adapter import LoRAWeights
from pagedinfer.lora.delta import DeltaWeights, add_delta, padded


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
        device: torch.device,
        logits: bool = False,
    ) -> None:
        self.in_features = in_features
        self.out_features = sum(p.width for p in parts)
        self.parts = parts
        self.device = device
        self.logits = logits  # an lm_head: it sees the logits rows, not every token
        self.weights: dict[int, DeltaWeights] = {}  # slot -> its A^T and B^T

    def install(self, slot: int, found: dict[str, LoRAWeights], scaling: float) -> None:
        """Slot ``slot``'s matrices for the parts it targets (``found``: part name -> A, B)."""
        targeted = [(p, found[p.name]) for p in self.parts if p.name in found]
        if not targeted:
            return
        rank = sum(w.a.shape[0] for _, w in targeted)
        a_t = torch.zeros(self.in_features, padded(rank))  # [in, R padded], float32
        b_t = torch.zeros(rank, padded(self.out_features))  # [R, out padded], float32
        at = 0
        for part, w in targeted:  # the adapter's values as they are (float16 / bfloat16 ones exactly)
            r = w.a.shape[0]
            a_t[:, at : at + r] = w.a.t()
            b_t[at : at + r, part.start : part.start + part.width] = w.b.t()
            at += r
        self.weights[slot] = DeltaWeights(
            a_t.to(self.device), b_t.to(self.device), rank, self.out_features, scaling
        )

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
                add_delta(y, x, lo, hi, w)
