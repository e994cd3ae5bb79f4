"""Where LoRA deltas enter the running model: a `LoRASite` per linear, named by the checkpoint's modules.

Our layers hold fused linears, so a site covers several checkpoint modules, those the family's
declaration fuses in it (`families`): for a Llama the QKV site's parts are q_proj, k_proj, v_proj
(their column ranges), the gate-up site's gate_proj and up_proj (of the product before
``silu(gate) * up``); the layers call their sites after each GEMM. Under
transformers' modeling (any family) each ``nn.Linear`` (packed or not) is wrapped in a `LoRALinear`.
``lm_head`` is a site of the logits rows. Sites are made when an engine enables LoRA; until an adapter
is installed in one it adds nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedinfer.lora.site import LoRASite, Part
from pagedinfer.model.families.spec import HF_LAYER
from pagedinfer.model.packed_linear import PackedLinear

Sites = dict[str, tuple[LoRASite, Part]]  # checkpoint module name -> its site and part


@dataclass
class LayerSites:
    """One of our decoder layers' sites, in the order its GEMMs run."""

    qkv: LoRASite
    o: LoRASite
    gate_up: LoRASite | None = None  # None in a mixture-of-experts layer: its experts have no sites
    down: LoRASite | None = None


class LoRALinear(nn.Module):
    """A transformers linear plus its site's deltas: the base product for every row, then each adapter's rows."""

    def __init__(self, base: nn.Module, site: LoRASite) -> None:
        super().__init__()
        self.base = base
        self.site = site

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        y = self.base(x)
        self.site.apply(y.view(-1, y.shape[-1]), x.reshape(-1, x.shape[-1]))
        return y


def attach_sites(model: nn.Module, impl: str, device: torch.device) -> Sites:
    """Give ``model`` its LoRA sites (once); return them by checkpoint module name."""
    sites: Sites = {}

    def site(in_features: int, names_widths: list[tuple[str, int]], logits: bool = False) -> LoRASite:
        parts, at = [], 0
        for name, width in names_widths:
            parts.append(Part(name, at, width))
            at += width
        s = LoRASite(in_features, parts, device, logits)
        sites.update({p.name: (s, p) for p in parts})
        return s

    if impl == "pagedinfer":
        family, sizes = model.family, model.sizes
        for i, layer in enumerate(model.layers):
            layer.lora = LayerSites(  # each site's parts: the modules the family fuses in that linear
                **{
                    role: site(
                        getattr(layer, f"{role}_proj").in_features,
                        [(HF_LAYER.format(i) + m, sizes.shape(family.module(m).shape)[0]) for m in modules],
                    )
                    for role, modules in family.linears_at(model.config, i).items()
                }
            )
        head = model.lm_head
        model.lora_head = site(head.in_features, [("lm_head", head.out_features)], logits=True)
        return sites
    targets = [
        (parent, child_name, child, f"{prefix}.{child_name}" if prefix else child_name)
        for prefix, parent in model.named_modules()
        for child_name, child in parent.named_children()
        if isinstance(child, (nn.Linear, PackedLinear))
    ]
    for parent, child_name, child, name in targets:
        s = site(child.in_features, [(name, child.out_features)], logits=name == "lm_head")
        setattr(parent, child_name, LoRALinear(child, s))
    return sites
