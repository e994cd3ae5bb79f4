"""What one engine step tells every attention layer: where each token's K/V goes and what it reads.

Built once per step by the model runner and shared by all layers (the torch path and the CUDA
kernels read the same fields). Sequences are packed in one row: sequence ``s`` owns query tokens
``query_start_loc[s]:query_start_loc[s+1]``; its new tokens are its last ``q_len`` context positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset for each new token
    query_start_loc: torch.Tensor  # [S + 1] int32: packed-row offsets of each sequence's new tokens
    context_lens: torch.Tensor  # [S] int32: tokens with K/V after this step (cached + new)
    block_tables: torch.Tensor  # [S, max_blocks] int32: physical block of each logical block (pad 0)
    query_lens: list[int]  # per sequence, host copy
    context_lens_host: list[int]  # per sequence, host copy
    block_size: int
    max_query_len: int
    max_context_len: int
