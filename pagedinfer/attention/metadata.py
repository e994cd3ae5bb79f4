"""What one engine step tells every attention layer: where each token's K/V goes and what it reads.

Built once per step by the model runner and shared by all layers of a group (the torch path and the CUDA
kernels read the same fields). Sequences are packed in one row: sequence ``s`` owns query tokens
``query_start_loc[s]:query_start_loc[s+1]``; its new tokens are its last ``q_len`` context positions.

A decode step replayed from a CUDA graph (`model.cuda_graphs`) gets metadata whose tensors are static
buffers: there ``max_context_len`` is an upper bound, not the step's longest context, and
``context_lens_host`` is None. A backend sizes its launches by the host fields and reads each
sequence's exact length from ``context_lens``, so it stays correct when the bound is larger.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset for each new token
    query_start_loc: torch.Tensor  # [S + 1] int32: packed-row offsets of each sequence's new tokens
    context_lens: torch.Tensor  # [S] int32: tokens with K/V after this step (cached + new)
    block_tables: torch.Tensor  # [S, max_blocks] int32: physical block of each logical block (pad 0)
    query_lens: list[int]  # per sequence, host copy
    context_lens_host: list[int] | None  # per sequence, host copy (None in a graph step)
    block_size: int
    max_query_len: int
    max_context_len: int  # the longest context; in a graph step an upper bound
    # with layer groups (`kv_cache.group_layers`): each group's metadata, this one first; the others
    # differ in their block tables and slots only (empty: one group)
    group_metas: list[AttentionMetadata] = field(default_factory=list)
