"""The KV pool's memory: key and value tensors indexed by block id, one pair per layer or, with layer
groups, one pair per column shared by the groups' layers.

Layout per tensor: ``[num_blocks, block_size, num_kv_heads, head_dim]``, so a flat view
``[num_blocks * block_size, num_kv_heads, head_dim]`` is indexed directly by a token's slot
(``block * block_size + offset``). The torch path and the CUDA kernels share this layout.

Layer groups (`group_layers`): a model whose layers attend through different windows (a sliding
window on some, the whole context on others) keeps each group's K/V under its own block tables, so a
windowed group can give back the blocks its window has left. Every group has the same number of
layers ``c``; layer ``j`` of every group shares column ``j``'s tensors, and a block id belongs to one
group at a time, so one pool of ids serves every group and a block holds the K/V of ``c`` layers
(vLLM v1's hybrid layout). One group (no window, or one window for all layers) is the plain layout:
one pair of tensors per layer and a block holding every layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerShape:
    num_kv_heads: int
    head_dim: int  # of K
    head_dim_v: int  # of V (differs from head_dim in MLA models)
    window: int = 0  # the layer's sliding attention window in tokens (0: the whole context)


@dataclass(frozen=True)
class KVGroup:
    """Layers whose K/V share block tables: one attention window (0: the whole context)."""

    window: int
    layers: tuple[int, ...]


def group_layers(shapes: dict[int, LayerShape], max_model_len: int) -> tuple[KVGroup, ...]:
    """The layer groups of a model: one group when every layer has one window (a window reaching past
    ``max_model_len`` is none), or when layers of different windows differ in K/V shape (they cannot
    share columns: every block then holds every layer, nothing is released); else, per window, its
    layers cut into groups of ``c`` = the gcd of the windows' layer counts, global groups first."""
    layers = sorted(shapes)
    windows = {i: shapes[i].window if 0 < shapes[i].window < max_model_len else 0 for i in layers}
    by_window: dict[int, list[int]] = {}
    for i in layers:
        by_window.setdefault(windows[i], []).append(i)
    same_shape = len({(s.num_kv_heads, s.head_dim, s.head_dim_v) for s in shapes.values()}) == 1
    if len(by_window) == 1 or not same_shape:
        return (KVGroup(next(iter(by_window)) if len(by_window) == 1 else 0, tuple(layers)),)
    c = math.gcd(*(len(v) for v in by_window.values()))
    return tuple(
        KVGroup(w, tuple(ids[i : i + c]))
        for w in sorted(by_window)
        for ids in [by_window[w]]
        for i in range(0, len(ids), c)
    )


def bytes_per_token(shapes: dict[int, LayerShape], dtype: torch.dtype) -> int:
    """K and V bytes one token takes across all layers."""
    elem = torch.empty((), dtype=dtype).element_size()
    return sum(s.num_kv_heads * (s.head_dim + s.head_dim_v) * elem for s in shapes.values())


def bytes_per_slot(shapes: dict[int, LayerShape], groups: tuple[KVGroup, ...], dtype: torch.dtype) -> int:
    """K and V bytes one slot of one block holds: a token of one group's layers (every group alike)."""
    return bytes_per_token({i: shapes[i] for i in groups[0].layers}, dtype)


class KVCache:
    def __init__(
        self,
        shapes: dict[int, LayerShape],
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        groups: tuple[KVGroup, ...] | None = None,
        null_block: int | None = None,
    ) -> None:
        """``null_block``: a block id (< num_blocks) zeroed now, that block tables name for blocks a
        window has released: reads of it are masked out, and finite."""
        groups = groups or (KVGroup(0, tuple(sorted(shapes))),)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.groups = groups
        self.layer_group = {i: g for g, group in enumerate(groups) for i in group.layers}
        self.bytes_per_token = bytes_per_slot(shapes, groups, dtype)  # of one slot of one block
        self.bytes_per_block = self.bytes_per_token * block_size
        # Never read before written (attention reads only slots below each context length, and the
        # null block, zeroed), so torch.empty: untouched pages cost no RSS until blocks are used.
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        for column in range(len(groups[0].layers)):
            s = shapes[groups[0].layers[column]]
            k = torch.empty(num_blocks, block_size, s.num_kv_heads, s.head_dim, dtype=dtype, device=device)
            v = torch.empty(num_blocks, block_size, s.num_kv_heads, s.head_dim_v, dtype=dtype, device=device)
            if null_block is not None:
                k[null_block].zero_()
                v[null_block].zero_()
            for group in groups:  # [NB, bs, kvh, D] and [NB, bs, kvh, Dv], shared by the groups' layers
                self.k[group.layers[column]], self.v[group.layers[column]] = k, v

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: copy whole blocks src -> dst in every tensor."""
        if not pairs:
            return
        device = next(iter(self.k.values())).device
        src = torch.tensor([p[0] for p in pairs], device=device)
        dst = torch.tensor([p[1] for p in pairs], device=device)
        for layer in self.groups[0].layers:  # each column's tensors once
            self.k[layer].index_copy_(0, dst, self.k[layer].index_select(0, src))
            self.v[layer].index_copy_(0, dst, self.v[layer].index_select(0, src))
