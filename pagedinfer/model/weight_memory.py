"""How many bytes a loaded model's weights hold, and how many bits each linear weight takes.

The memory report states them beside the KV cache: a Q4_1 GGUF's 135M weights are 93 MB in panels
(about 5 bits per weight), the same model dequantized 538 MB (32). Every tensor is counted once
(tied or shared storage too): parameters, buffers, and the panels, scales and biases of packed
linears and panel embeddings, which are plain attributes rather than parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedinfer.model.packed_linear import PackedLinear, PanelEmbedding


@dataclass(frozen=True)
class WeightMemory:
    bytes: int  # every weight tensor the model holds, each storage once
    linear_bits_per_weight: float  # the linears' (lm_head included) storage per weight, scales included


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    """Tensors a module holds outside its parameters and buffers."""
    if isinstance(module, PackedLinear):
        segs = module.segments or []
        held = [module.packed, module.bias] + [t for s in segs for t in (s.panels, s.bias, s.scale)]
        return [t for t in held if t is not None]
    if isinstance(module, PanelEmbedding):
        return [t for t in (module.table.panels, module.table.scale) if t is not None]
    return []


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of a tensor's storage (oneDNN's opaque packed weights: their own size)."""
    try:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # an opaque (mkldnn) tensor
        return id(t), t.numel() * t.element_size()


def weight_memory(model: nn.Module) -> WeightMemory:
    seen: dict[int, int] = {}
    for m in model.modules():
        for t in [*m.parameters(recurse=False), *m.buffers(recurse=False), *_tensors(m)]:
            addr, size = _storage(t)
            seen[addr] = max(seen.get(addr, 0), size)
    bits = weights = 0
    for m in model.modules():
        if isinstance(m, PackedLinear):
            segs = m.segments or []
            held = [m.packed, *(s.panels for s in segs), *(s.scale for s in segs)]
            bits += 8 * sum(t.numel() * t.element_size() for t in held if t is not None)
            weights += m.in_features * m.out_features
        elif isinstance(m, nn.Linear):
            bits += 8 * m.weight.numel() * m.weight.element_size()
            weights += m.weight.numel()
    return WeightMemory(sum(seen.values()), bits / weights if weights else 0.0)
