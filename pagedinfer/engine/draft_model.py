"""Speculative decoding's draft model (``speculative_config`` method ``draft_model``): a small decoder
with the target's vocabulary whose greedy tokens are the drafts.

Its K/V live in the target's paged pool: a block id holds the target's layers and the draft's (the
draft's tensors have a row per block id beside the target's), so a sequence's draft K/V sit in its
own blocks, under its own block table (the first layer group's, which holds every position), and
the pool's reference counts, copy-on-write, freeing, prefix cache, admission and preemption serve
both models at once. The draft computes lazily: a block says how many of its leading slots hold the
draft's K/V (`BlockPool.draft_filled`), so a proposal computes a sequence's positions from the first
one no block holds (its whole prompt the first time, or nothing of a prompt its sibling completion
or an earlier request with the same prefix computed), then one position per drafted token after its
pending one, every sequence drafting in the step in the same passes (`DraftModel.propose`). The
drafted positions are written into the slots the target's step allocated for the same drafted
tokens; the target's rollback (`KVCacheManager.truncate`) cuts the draft's slots with its own, so
a rejected drafted token's K/V never counts as held. Every pass is timed by its rows (``times``:
the gate's cost of a pass). The draft only proposes: the target verifies every token on its exact
path, so the draft's numerics and batch never reach an output.
"""

from __future__ import annotations

from dataclasses import dataclass
from time import perf_counter

import torch

from pagedinfer.attention.kv_cache import KVCache, KVGroup, LayerShape, bytes_per_token
from pagedinfer.core.block_pool import BlockPool
from pagedinfer.core.sequence import Sequence
from pagedinfer.core.speculative import StepTimes
from pagedinfer.model.loader import LoadedModel, ModelLoadError
from pagedinfer.model.runner import ModelRunner


@dataclass
class DraftPoolStats:
    """The draft model's share of the target's pool: its K/V bytes per block and in all, and the
    positions its passes computed since the last reset."""

    model: str
    bytes_per_block: int  # of the draft's layers, in every block beside the target's
    kv_bytes: int  # bytes_per_block over every block of the pool
    computed_positions: int  # positions whose draft K/V its passes computed (drafted ones included)


@dataclass(eq=False)
class _Line:
    """What the runner reads of a sequence in a draft pass: its block table (the target's), its tokens
    with the drafted ones after them, and how many of them the draft's K/V covers."""

    block_tables: list[list[int]]
    token_ids: list[int]
    num_computed: int
    lora_slot: int = 0  # the draft runs no adapter


@dataclass
class _Chunk:
    """The runner's `ScheduledChunk`: ``num_tokens`` positions of ``seq`` from ``start``, the last one's
    logits returned (the next drafted token)."""

    seq: _Line
    start: int
    num_tokens: int
    drafted: list[int]  # the line's drafted tokens so far: its logits' token is appended
    num_logits: int = 1

    @property
    def step_token_ids(self) -> list[int]:
        return self.seq.token_ids[self.start : self.start + self.num_tokens]


def draft_bytes_per_block(loaded: LoadedModel, block_size: int, kv_dtype: torch.dtype) -> int:
    """The bytes a block holds of the draft's K/V: a token of every draft layer (they share one table)."""
    return bytes_per_token(loaded.layer_shapes, kv_dtype) * block_size


def check_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a draft whose vocabulary is not the target's (its token ids would mean other tokens): the
    embedding rows, and the tokenizers' token-to-id maps where both have one."""
    sizes = [m.model.get_input_embeddings().num_embeddings for m in (target, draft)]
    why = None
    if sizes[0] != sizes[1]:
        why = f"{sizes[1]:,} token ids against the target's {sizes[0]:,}"
    elif (target.tokenizer is None) != (draft.tokenizer is None):
        why = "one of them has no tokenizer"
    elif target.tokenizer is not None and target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
        why = "their tokenizers map tokens to different ids"
    if why is not None:
        raise ModelLoadError(
            f"speculative_config.model: the draft model {draft.name!r} does not share the vocabulary of "
            f"the target model {target.name!r} ({why}); a draft model needs the target's tokenizer"
        )


class DraftModel:
    """Greedy drafts from a second model, its K/V in the target's blocks (module docstring)."""

    def __init__(self, loaded: LoadedModel, pool: BlockPool, num_rows: int, kv_dtype: torch.dtype) -> None:
        """``pool``: the target's; ``num_rows``: the target's K/V tensors' rows (its block ids, the
        null and scratch blocks included), as many as the draft's get."""
        self.loaded = loaded
        self.pool = pool
        shapes: dict[int, LayerShape] = loaded.layer_shapes
        # one group: every block holds every draft layer (a windowed layer masks, releases nothing)
        groups = (KVGroup(0, tuple(sorted(shapes))),)
        self.kv = KVCache(shapes, num_rows, pool.block_size, kv_dtype, loaded.device, groups)
        self.runner = ModelRunner(loaded.model, self.kv, loaded.device, False, loaded.impl)
        self.times = StepTimes()  # its passes' wall times by rows (seeded by the engine at start-up)
        self.computed_positions = 0

    def _computed(self, seq: Sequence) -> int:
        """Leading positions of ``seq`` whose draft K/V its blocks hold (its pending one never)."""
        return min(self.pool.draft_computed(seq.block_tables[0]), len(seq.token_ids) - 1)

    @torch.inference_mode()
    def propose(self, wants: list[tuple[Sequence, int]]) -> list[list[int]]:
        """For each ``(seq, k)``, up to ``k`` greedy tokens after ``seq``'s tokens (its pending one
        last), all sequences in one pass per drafted position: the first computes each sequence's
        positions its blocks lack, the next ones a token each, into the slots the step allocated
        for its drafted tokens. Fewer where the draft's context ends."""
        lines = [_Line([seq.block_tables[0]], list(seq.token_ids), 0) for seq, _ in wants]
        most = [min(k, self.loaded.max_model_len - len(seq.token_ids)) for seq, k in wants]
        drafted: list[list[int]] = [[] for _ in wants]
        for depth in range(max(most, default=0)):
            chunks = []
            for (seq, _), line, tokens, k in zip(wants, lines, drafted, most, strict=True):
                if depth >= k:
                    continue
                if not depth:  # read after the lines before it held theirs: shared blocks count once
                    line.num_computed = self._computed(seq)
                end = len(line.token_ids)
                # held from now: a later line sharing these blocks (a sibling completion's prompt)
                # reads them in this pass, whose K/V writes precede its attention
                self.pool.hold_draft(line.block_tables[0], line.num_computed, end)
                chunks.append(_Chunk(line, line.num_computed, end - line.num_computed, tokens))
            if not chunks:
                break
            start = perf_counter()
            logits = self.runner.execute(chunks, [])  # [len(chunks), V]
            tokens = logits.argmax(dim=-1).tolist()
            rows = sum(c.num_tokens for c in chunks)
            self.times.add(rows, perf_counter() - start)
            self.computed_positions += rows
            for chunk, token in zip(chunks, tokens, strict=True):
                chunk.seq.num_computed += chunk.num_tokens
                chunk.seq.token_ids.append(token)
                chunk.drafted.append(token)
        return drafted

    def gap(self, seq: Sequence) -> int:
        """The positions of ``seq`` its next draft computes before its first drafted token: its pending
        token, and those its blocks lack (a rejected draft's place, the tokens since its last draft,
        or all of them where no block holds the draft's K/V)."""
        return len(seq.token_ids) - self._computed(seq)

    def make_stats(self) -> DraftPoolStats:
        per_block = self.kv.bytes_per_block
        return DraftPoolStats(
            self.loaded.name, per_block, per_block * self.pool.num_blocks, self.computed_positions
        )

    def reset_stats(self) -> None:
        self.computed_positions = 0
