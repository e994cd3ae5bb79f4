"""Decode steps replayed from CUDA graphs: one graph per batch-size bucket, captured once at startup.

On a GPU a small or medium model's decode step is mostly launch overhead (transformers' Python per
module, one kernel launch per op); replaying a captured graph launches the whole forward pass at
once (vLLM's answer). A graph replays fixed addresses and shapes, so a pure-decode step is copied
into static buffers sized for its bucket (1, 2, 4, ... up to ``max_num_seqs``): token ids,
positions, context lengths, and each layer group's slot mapping and block tables padded to a fixed
width (one group for most models; windowed and global layers have one each). Rows past the
step's sequences up to the bucket are padding: token 0 at position 0, writing its K/V into a
scratch block that no sequence owns (the pool's tensors hold one block more than the pool) and
attending to that one slot.

The attention metadata of such a step carries no host value that changes between replays:
``max_context_len`` is the fixed bound ``max_context`` (a kernel sizes its grid by it and reads each
sequence's length from ``context_lens`` on the device), ``context_lens_host`` is None. Steps with a
longer context than the bound, with more sequences than the largest bucket, or with any prompt
chunk run eagerly.

``capture=False`` runs the same buffers, padding and metadata eagerly, step by step: the CPU tests
use it to check everything but the capture itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from pagedinfer.attention.kv_cache import KVCache
from pagedinfer.attention.metadata import AttentionMetadata

# the model over one step: (ids [T], positions [T], metadata, logits_to_keep) -> float32 logits [R, vocab]
StepForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, int], torch.Tensor]

GRAPH_MAX_CONTEXT = 8192  # longer contexts run eagerly (vLLM's former max_seq_len_to_capture)


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, ... below ``max_num_seqs``, then ``max_num_seqs`` itself."""
    return [1 << i for i in range(max_num_seqs.bit_length()) if 1 << i < max_num_seqs] + [max_num_seqs]


class DecodeGraphs:
    """Static buffers for decode steps of up to ``max_num_seqs`` sequences, and their graphs."""

    @torch.inference_mode()
    def __init__(
        self,
        forward: StepForward,
        kv: KVCache,
        device: torch.device,
        max_num_seqs: int,
        max_context: int,
        scratch_block: int,
    ) -> None:
        self.forward = forward  # the model runner's (`ModelRunner.run_model`): it picks the step's path
        self.kv = kv
        self.buckets = batch_buckets(max_num_seqs)
        self.max_context = max_context
        self.scratch_block = scratch_block
        bs = kv.block_size
        self.width = -(-max_context // bs)  # block-table entries a context of max_context needs
        b = self.buckets[-1]
        self.ids = torch.zeros(b, dtype=torch.int64, device=device)  # [B]
        self.positions = torch.zeros(b, dtype=torch.int64, device=device)  # [B]
        g = len(kv.groups)
        self.slots = torch.full((g, b), scratch_block * bs, dtype=torch.int64, device=device)  # [G, B]
        self.context_lens = torch.ones(b, dtype=torch.int32, device=device)  # [B]
        self.block_tables = torch.full(
            (g, b, self.width), scratch_block, dtype=torch.int32, device=device
        )  # [G, B, W]
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=device)  # [B + 1], never changes
        self.metas = {n: self._meta(n) for n in self.buckets}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # bucket -> the graph's output [bucket, vocab]
        self.capture_s = 0.0

    def _meta(self, b: int) -> AttentionMetadata:
        """Views of the buffers' first ``b`` rows: what bucket ``b``'s graph reads on every replay."""
        metas = [
            AttentionMetadata(
                slot_mapping=self.slots[g, :b],
                query_start_loc=self.query_start_loc[: b + 1],
                context_lens=self.context_lens[:b],
                block_tables=self.block_tables[g, :b],
                query_lens=[1] * b,
                context_lens_host=None,
                block_size=self.kv.block_size,
                max_query_len=1,
                max_context_len=self.max_context,
            )
            for g in range(len(self.slots))
        ]
        if len(metas) > 1:  # the first group's, with every group's beside it (`ModelRunner.build_metadata`)
            metas[0].group_metas = metas
        return metas[0]

    def fits(self, batch: Sequence) -> bool:
        """A pure-decode step (one token per sequence) within the buckets and the context bound."""
        return (
            len(batch) <= self.buckets[-1]
            and all(s.num_tokens == 1 for s in batch)
            and max(s.start for s in batch) < self.max_context
            and max(len(t) for s in batch for t in s.seq.block_tables) <= self.width
        )

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def _load(self, batch: Sequence) -> int:
        """Copy the step's inputs into the buffers' first rows, pad up to the bucket; return the bucket."""
        bs, scratch = self.kv.block_size, self.scratch_block
        b, groups = self.bucket(len(batch)), range(len(self.slots))
        width = max(len(t) for s in batch for t in s.seq.block_tables)
        rows = [
            (
                s.seq.token_ids[s.start],
                s.start,
                s.start + 1,
                *(s.seq.block_tables[g][s.start // bs] * bs + s.start % bs for g in groups),
            )
            for s in batch
        ]
        # padding: the scratch block's first slot in every group
        rows += [(0, 0, 1, *[scratch * bs] * len(groups))] * (b - len(batch))
        tables = [
            [s.seq.block_tables[g] + [scratch] * (width - len(s.seq.block_tables[g])) for s in batch]
            + [[scratch] * width] * (b - len(batch))
            for g in groups
        ]  # [G, b, width]
        host = torch.tensor(rows, dtype=torch.int64).to(
            self.ids.device
        )  # [b, 3 + G]: id, position, context, each group's slot
        self.ids[:b].copy_(host[:, 0])
        self.positions[:b].copy_(host[:, 1])
        self.context_lens[:b].copy_(host[:, 2])
        self.slots[:, :b].copy_(host[:, 3:].T)
        # entries past ``width`` keep older values: no kernel reads past a row's context length
        self.block_tables[:, :b, :width].copy_(torch.tensor(tables, dtype=torch.int32))  # [G, b, width]
        return b

    def _forward(self, b: int) -> torch.Tensor:
        """The model over the buffers' first ``b`` rows: float32 logits ``[b, vocab]``."""
        return self.forward(self.ids[:b], self.positions[:b], self.metas[b], 0)

    @torch.inference_mode()
    def run(self, batch: Sequence) -> torch.Tensor:
        """Logits ``[len(batch), vocab]`` of a step that `fits` (a graph's output: valid until the next step)."""
        b = self._load(batch)
        if b in self.graphs:
            self.graphs[b].replay()
            logits = self.logits[b]
        else:
            logits = self._forward(b)
        return logits[: len(batch)]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket's graph (largest first, so the smaller ones reuse its memory pool).

        Each bucket first runs once eagerly on a side stream, with padding rows only: kernels compile
        and libraries set up their workspaces outside the graph."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.buckets):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._forward(b)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[b] = self._forward(b)
            self.graphs[b] = graph
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - start
