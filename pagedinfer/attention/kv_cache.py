"""The KV pool's memory: one key and one value tensor per attention layer, all indexed by block id.

Layout per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]``, so a flat view
``[num_blocks * block_size, num_kv_heads, head_dim]`` is indexed directly by a token's slot
(``block * block_size + offset``). The torch path and the CUDA kernels share this layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerShape:
    num_kv_heads: int
    head_dim: int  # of K
    head_dim_v: int  # of V (differs from head_dim in MLA models)


def bytes_per_token(shapes: dict[int, LayerShape], dtype: torch.dtype) -> int:
    """K and V bytes one token takes across all layers."""
    elem = torch.empty((), dtype=dtype).element_size()
    return sum(s.num_kv_heads * (s.head_dim + s.head_dim_v) * elem for s in shapes.values())


class KVCache:
    def __init__(
        self,
        shapes: dict[int, LayerShape],
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.bytes_per_token = bytes_per_token(shapes, dtype)
        self.bytes_per_block = self.bytes_per_token * block_size
        # Never read before written (attention reads only slots below each context length), so
        # torch.empty: untouched pages cost no RSS until blocks are used.
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        for layer, s in shapes.items():
            self.k[layer] = torch.empty(
                num_blocks, block_size, s.num_kv_heads, s.head_dim, dtype=dtype, device=device
            )  # [NB, bs, kvh, D]
            self.v[layer] = torch.empty(
                num_blocks, block_size, s.num_kv_heads, s.head_dim_v, dtype=dtype, device=device
            )  # [NB, bs, kvh, Dv]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: copy whole blocks src -> dst in every layer."""
        if not pairs:
            return
        device = next(iter(self.k.values())).device
        src = torch.tensor([p[0] for p in pairs], device=device)
        dst = torch.tensor([p[1] for p in pairs], device=device)
        for layer in self.k:
            self.k[layer].index_copy_(0, dst, self.k[layer].index_select(0, src))
            self.v[layer].index_copy_(0, dst, self.v[layer].index_select(0, src))
