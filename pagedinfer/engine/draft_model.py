"""Speculative decoding's draft model (``speculative_config`` method ``draft_model``): a small decoder
with the target's vocabulary whose greedy tokens are the drafts.

Its K/V live in a paged pool of its own (a `KVCacheManager` without prefix caching, over a `KVCache`
of the draft's layers), with as many blocks per layer group as the target's pool: it holds as many
positions as the target's, whatever the two models' sizes. Each sequence that drafts has a line here:
a block table and the tokens whose K/V it holds. A proposal first keeps the longest prefix of those
that still equals the sequence's tokens (what verification accepted, or all of it after a
preemption) and gives back the blocks past it (`KVCacheManager.truncate`), then computes the rest of
the sequence (its whole prompt, the first time) and one position per drafted token after it, every
sequence drafting in the step in the same passes (`DraftModel.propose`). A sequence the gate does
not let draft computes nothing here: its line catches up when it next drafts, in that draft's first
pass (`gap`: that pass's rows for it, which the gate prices). Every pass is timed by its rows
(``times``: the gate's cost of a pass). The draft only proposes: the target verifies every token on
its exact path, so the draft's numerics, batch and pool never reach an output.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from time import perf_counter

import torch

from pagedinfer.attention.kv_cache import KVCache, group_layers
from pagedinfer.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from pagedinfer.core.sequence import Sequence
from pagedinfer.core.speculative import StepTimes
from pagedinfer.model.loader import LoadedModel, ModelLoadError
from pagedinfer.model.runner import ModelRunner


@dataclass
class DraftPoolStats:
    """The draft model's pool: its size, its use now and its peak since the last reset."""

    model: str
    num_blocks: int
    bytes_per_block: int
    used_blocks: int
    peak_blocks: int


@dataclass(eq=False)
class _Line:
    """One sequence's K/V in the draft's pool (what `KVCacheManager` and the runner read of a sequence)."""

    block_tables: list[list[int]] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # its tokens, the drafted ones last
    num_computed: int = 0  # leading ``token_ids`` whose K/V the pool holds
    num_verified: int = 0  # leading ``token_ids`` that were the sequence's own (not drafted here)
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


def _still_held(line: _Line, tokens: list[int]) -> int:
    """How many of ``line``'s computed positions hold ``tokens`` (the sequence's now), at most all but
    the last (its logits are the first draft's): the sequence's own tokens are compared at C speed,
    the drafted ones after them one by one (the verified prefix of the last draft)."""
    upto = min(line.num_computed, len(tokens) - 1)
    keep = min(line.num_verified, upto)
    if line.token_ids[:keep] != tokens[:keep]:  # not this sequence's tokens any more: compute again
        return 0
    while keep < upto and line.token_ids[keep] == tokens[keep]:
        keep += 1
    return keep


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
    """Greedy drafts from a second model, its K/V in its own paged pool (module docstring)."""

    def __init__(
        self, loaded: LoadedModel, blocks_per_group: int, block_size: int, kv_dtype: torch.dtype
    ) -> None:
        self.loaded = loaded
        groups = group_layers(loaded.layer_shapes, loaded.max_model_len)
        windows = tuple(g.window for g in groups)
        self.manager = KVCacheManager(blocks_per_group * len(groups), block_size, False, windows)
        null_block = self.manager.pool.null_block
        num_blocks = blocks_per_group * len(groups) + int(null_block is not None)
        self.kv = KVCache(
            loaded.layer_shapes, num_blocks, block_size, kv_dtype, loaded.device, groups, null_block
        )
        self.runner = ModelRunner(loaded.model, self.kv, loaded.device, False, loaded.impl)
        self._lines: OrderedDict[Sequence, _Line] = OrderedDict()  # least recently drafted first
        self.times = StepTimes()  # its passes' wall times by rows (seeded by the engine at start-up)

    @torch.inference_mode()
    def propose(self, wants: list[tuple[Sequence, int]]) -> list[list[int]]:
        """For each ``(seq, k)``, up to ``k`` greedy tokens after ``seq``'s tokens (its pending one
        last), all sequences in one pass per drafted position: the first computes each line's missing
        tokens, the next ones a token each. Fewer where the draft's context ends, or where its pool
        cannot hold a line even once the lines not drafting now are dropped."""
        lines = [self._line(seq) for seq, _ in wants]
        most = [min(k, self.loaded.max_model_len - len(seq.token_ids)) for seq, k in wants]
        drafted: list[list[int]] = [[] for _ in wants]
        busy = {id(line) for line in lines}
        for depth in range(max(most, default=0)):
            chunks, copies = [], []
            for line, tokens, k in zip(lines, drafted, most, strict=True):
                if len(tokens) == depth < k:  # still drafting (not stopped by its pool)
                    n = len(line.token_ids) - line.num_computed
                    blocks = self._allocate(line, n, busy)
                    if blocks is not None:
                        chunks.append(_Chunk(line, line.num_computed, n, tokens))
                        copies += blocks.copies
            if not chunks:
                break
            start = perf_counter()
            logits = self.runner.execute(chunks, copies)  # [len(chunks), V]
            tokens = logits.argmax(dim=-1).tolist()
            self.times.add(sum(c.num_tokens for c in chunks), perf_counter() - start)
            for chunk, token in zip(chunks, tokens, strict=True):
                chunk.seq.num_computed += chunk.num_tokens
                chunk.seq.token_ids.append(token)
                chunk.drafted.append(token)
        return drafted

    def gap(self, seq: Sequence) -> int:
        """The positions of ``seq`` its next draft computes before its first drafted token: its pending
        token, and those its line lacks (a rejected draft's place, the tokens since its last draft, or
        all of them for a sequence without a line)."""
        line = self._lines.get(seq)
        return len(seq.token_ids) - (_still_held(line, seq.token_ids) if line is not None else 0)

    def _line(self, seq: Sequence) -> _Line:
        """``seq``'s line, made the most recently drafted, cut back to the positions that still hold
        ``seq``'s tokens (the blocks past them given back), its tokens ``seq``'s."""
        line = self._lines.pop(seq, None) or _Line([[] for _ in self.manager.windows])
        self._lines[seq] = line
        tokens = seq.token_ids
        line.num_computed = _still_held(line, tokens)
        line.token_ids, line.num_verified = list(tokens), len(tokens)
        self.manager.truncate(line)
        return line

    def _allocate(self, line: _Line, n: int, busy: set[int]) -> KVCacheBlocks | None:
        """Slots for ``line``'s next ``n`` positions, dropping the least recently drafted lines not in
        ``busy`` (ids of those drafting now) while the pool cannot hold them (a dropped line computes
        its sequence again when it next drafts)."""
        while (blocks := self.manager.allocate(line, n)) is None:
            victim = next((s for s, other in self._lines.items() if id(other) not in busy), None)
            if victim is None:
                return None
            self.manager.free(self._lines.pop(victim))
        return blocks

    def forget(self, seq: Sequence) -> None:
        """``seq`` ended: its line's blocks return to the draft's pool."""
        if (line := self._lines.pop(seq, None)) is not None:
            self.manager.free(line)

    def make_stats(self) -> DraftPoolStats:
        s = self.manager.make_stats()
        return DraftPoolStats(
            self.loaded.name,
            self.manager.pool.num_blocks,
            self.kv.bytes_per_block,
            s.num_used_blocks,
            sum(s.group_peak_blocks),
        )

    def reset_stats(self) -> None:
        self.manager.reset_stats()
