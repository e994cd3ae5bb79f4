"""One engine step = one forward pass over every scheduled token, packed in a single row without padding.

The runner chooses each step's path and hands it to the model: transformers' modules (any family), or
pagedinfer's own layers one by one, or, for a step of our layers on the CPU kernels without adapter rows
whose sequences decode (one token each, or that and its drafted tokens: `decode_step.MAX_QUERY_ROWS`
rows at most), all of them in the one-call C step (`decode_step.OneCall`, where every piece has a C
kernel). Either path gives a row the same bits, so a step's drafted rows do not move the whole step off
the C step.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Protocol

import torch

from pagedinfer.attention import interface as attention
from pagedinfer.attention.kv_cache import KVCache
from pagedinfer.attention.metadata import AttentionMetadata
from pagedinfer.lora import context as lora_context
from pagedinfer.model.cuda_graphs import DecodeGraphs
from pagedinfer.model.decode_step import MAX_QUERY_ROWS, DecodeStep, OneCall
from pagedinfer.model.host_memory import keep_freed_memory


class _Tokens(Protocol):
    token_ids: list[int]
    block_tables: list[list[int]]  # per layer group
    lora_slot: int  # its request's adapter (0: the base model)


class ScheduledChunk(Protocol):
    """What the runner reads of one scheduled sequence (the scheduler's ``ScheduledSeq``)."""

    seq: _Tokens
    start: int  # first position computed this step
    num_tokens: int
    num_logits: int  # the logits of its last num_logits positions are returned (1: the sampled one)
    step_token_ids: list[int]  # the tokens at positions [start, start + num_tokens): drafted ones last


def _tables(batch: list[ScheduledChunk], group: int) -> torch.Tensor:
    """Layer group ``group``'s block tables of ``batch``, padded with block 0: ``[S, max_blocks]`` int32."""
    width = max(len(s.seq.block_tables[group]) for s in batch)
    return torch.tensor(
        [s.seq.block_tables[group] + [0] * (width - len(s.seq.block_tables[group])) for s in batch],
        dtype=torch.int32,
    )


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv: KVCache,
        device: torch.device,
        use_cuda_kernels: bool,
        impl: str,
    ) -> None:
        self.model = model
        self.kv = kv
        self.device = device
        self.use_cuda_kernels = use_cuda_kernels
        self.impl = impl  # whose layers ``model`` runs: "pagedinfer" (ours) or "transformers"
        # pure-decode steps through its static buffers (replayed graphs on CUDA); the engine sets it
        self.graphs: DecodeGraphs | None = None
        self.last_step_graphed = False  # whether the last execute went through ``graphs``
        if device.type == "cpu":
            keep_freed_memory()  # the steps' activations are reused, not faulted in anew each step

    def build_metadata(
        self, batch: list[ScheduledChunk]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Token ids, positions and the attention metadata of one step (few tensor ops, no per-token loop)."""
        bs = self.kv.block_size
        query_lens = [s.num_tokens for s in batch]
        context_lens = [s.start + s.num_tokens for s in batch]
        num_groups = len(batch[0].seq.block_tables)
        tables = [_tables(batch, g) for g in range(num_groups)]  # per group [S, max_blocks]
        if max(query_lens) == 1:  # decode only: one token per sequence, plain lists are cheapest
            ids = [s.seq.token_ids[s.start] for s in batch]
            starts = [s.start for s in batch]
            positions = torch.tensor(starts)  # [T = S]
            # the block-table lookup: position p of a sequence -> block table[p // bs], slot p % bs
            slot_mappings = [
                torch.tensor(
                    [s.seq.block_tables[g][p // bs] * bs + p % bs for s, p in zip(batch, starts, strict=True)]
                )
                for g in range(num_groups)
            ]  # per group [T] int64
            query_start_loc = torch.arange(len(batch) + 1, dtype=torch.int32)  # [S + 1]
        else:
            ids = []
            for s in batch:
                ids += s.step_token_ids
            q_lens = torch.tensor(query_lens)  # [S]
            seq_of_token = torch.repeat_interleave(torch.arange(len(batch)), q_lens)  # [T]
            starts = torch.tensor([s.start for s in batch])  # [S]
            query_start_loc = torch.zeros(len(batch) + 1, dtype=torch.int32)  # [S + 1]
            query_start_loc[1:] = torch.cumsum(q_lens, 0)
            offsets = torch.arange(len(ids)) - query_start_loc[:-1].to(torch.int64)[seq_of_token]  # [T]
            positions = starts[seq_of_token] + offsets  # [T]
            # the block-table lookup, vectorised: position p of a sequence -> block table[p // bs], slot p % bs
            slot_mappings = [
                t.to(torch.int64)[seq_of_token, positions // bs] * bs + positions % bs for t in tables
            ]  # per group [T]
        meta = AttentionMetadata(
            slot_mapping=slot_mappings[0].to(self.device),
            query_start_loc=query_start_loc.to(self.device),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=self.device),
            block_tables=tables[0].to(self.device),
            query_lens=query_lens,
            context_lens_host=context_lens,
            block_size=bs,
            max_query_len=max(query_lens),
            max_context_len=max(context_lens),
        )
        if num_groups > 1:  # the other groups differ in their tables and slots only
            meta.group_metas = [meta] + [
                dataclasses.replace(meta, slot_mapping=m.to(self.device), block_tables=t.to(self.device))
                for m, t in zip(slot_mappings[1:], tables[1:], strict=True)
            ]
        return torch.tensor(ids, device=self.device), positions.to(self.device), meta

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        if not self.use_cuda_kernels:
            self.kv.copy_blocks(copies)
            return
        from pagedinfer.attention import cuda_kernels

        groups: dict[tuple, list[int]] = {}  # one launch per group of same-shaped layers
        for layer, k in self.kv.k.items():
            groups.setdefault((k.shape, self.kv.v[layer].shape), []).append(layer)
        for layers in groups.values():
            ks, vs = [self.kv.k[i] for i in layers], [self.kv.v[i] for i in layers]
            cuda_kernels.copy_blocks(ks, vs, copies)

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledChunk], copies: list[tuple[int, int]]) -> torch.Tensor:
        """Run the step; return float32 logits ``[R, vocab]``: each scheduled seq's last ``num_logits``
        positions, in order (R = their sum: one row per sampling seq, a chunk's every row for prompt
        logprobs; never more than the step's tokens)."""
        self._copy_blocks(copies)  # copy-on-write before this step's writes land
        slots = [s.seq.lora_slot for s in batch]
        if any(slots):
            return self._execute_lora(batch, slots)
        self.last_step_graphed = self.graphs is not None and self.graphs.fits(batch)
        if self.last_step_graphed:
            logits = self.graphs.run(batch)  # [S, vocab]: every row, sampling or not
            if all(s.num_logits for s in batch):
                return logits
            return logits[
                torch.tensor([i for i, s in enumerate(batch) if s.num_logits], device=logits.device)
            ]
        return self._forward(batch)

    def _execute_lora(self, batch: list[ScheduledChunk], slots: list[int]) -> torch.Tensor:
        """A step with adapter rows: its sequences ordered by slot (each adapter's rows one range, its
        deltas two GEMMs per linear), eagerly; the logits rows put back in the batch's order."""
        order = sorted(range(len(batch)), key=slots.__getitem__)  # stable: arrival order within a slot
        ordered = [batch[i] for i in order]
        ctx = lora_context.LoRAContext(
            lora_context.ranges([slots[i] for i in order], [s.num_tokens for s in ordered]),
            lora_context.ranges([slots[i] for i in order], [s.num_logits for s in ordered]),
        )
        self.last_step_graphed = False
        lora_context.set_context(ctx)
        try:
            logits = self._forward(ordered, lora=True)  # [R, vocab] in the order of ``ordered``
        finally:
            lora_context.set_context(None)
        if order == sorted(order):
            return logits
        first, at = [0] * len(batch), 0  # each sequence's first row among ``logits``
        for i in order:
            first[i], at = at, at + batch[i].num_logits
        rows = [r for i, s in enumerate(batch) for r in range(first[i], first[i] + s.num_logits)]
        return logits[torch.tensor(rows, device=logits.device)]  # [R, vocab]

    def _forward(self, batch: list[ScheduledChunk], lora: bool = False) -> torch.Tensor:
        """One eager forward pass over ``batch`` packed in order: float32 logits ``[R, vocab]``
        (``lora``: some rows run an adapter)."""
        ids, positions, meta = self.build_metadata(batch)
        if meta.max_query_len == 1 and all(s.num_logits for s in batch):
            keep: torch.Tensor | int = 0  # every row samples: HF's "keep all"
        elif all(s.num_logits <= 1 for s in batch):
            ends = torch.cumsum(torch.tensor(meta.query_lens), 0) - 1  # [S]
            keep = ends[torch.tensor([s.num_logits == 1 for s in batch], dtype=torch.bool)].to(
                self.device
            )  # [R]
        else:  # some chunks return several rows (prompt logprobs)
            rows, end = [], -1
            for s in batch:
                end += s.num_tokens
                rows += range(end - s.num_logits + 1, end + 1)
            keep = torch.tensor(rows, device=self.device)  # [R]
        return self.run_model(ids, positions, meta, keep, lora)

    def run_model(
        self,
        ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        keep: int | torch.Tensor,  # HF's logits_to_keep: 0 every row, or row indices [R]
        lora: bool = False,
    ) -> torch.Tensor:
        """The model over one step's packed tokens, on the path `one_call` chooses: float32 logits
        ``[R, vocab]`` (the eager steps' and the graph path's one way in)."""
        one_call = self.one_call(meta, lora)
        path = {} if one_call is None else {"one_call": one_call}  # (transformers' modules take none)
        attention.set_context(attention.StepContext(meta, self.kv, self.use_cuda_kernels))
        try:
            out = self.model(
                input_ids=ids.unsqueeze(0),
                position_ids=positions.unsqueeze(0),
                use_cache=False,
                logits_to_keep=keep,
                **path,
            )
        finally:
            attention.set_context(None)
        return out.logits[0].float()  # [R, vocab]

    def one_call(self, meta: AttentionMetadata, lora: bool) -> OneCall | None:
        """The one-call C step for a step of our layers (dense, or with experts) on the CPU kernels
        without adapter rows (their deltas go in layer by layer) whose queries have at most
        `MAX_QUERY_ROWS` rows a sequence (decode rows and their drafts, or a short prompt chunk; a
        longer chunk's step goes layer by layer), where every piece has a C kernel (`DecodeStep.serves`:
        gpt-oss's sinks, for one, have none there); else None: our layers one by one, or transformers'."""
        if self.impl != "pagedinfer" or lora or self.use_cuda_kernels or meta.max_query_len > MAX_QUERY_ROWS:
            return None
        return None if self._decode_step is None else OneCall(self._decode_step, meta)

    @functools.cached_property
    def _decode_step(self) -> DecodeStep | None:
        """The C step over this runner's pool (built at the first step that may take it)."""
        return DecodeStep(self.model, self.kv) if DecodeStep.serves(self.model, self.kv) else None
