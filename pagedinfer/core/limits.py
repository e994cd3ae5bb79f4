"""What a request must fit to ever run here: the context, the batch and the pool.

Checked once per request, before it is queued (`engine.intake`): a request that passes can always
be scheduled, alone if need be, so the scheduler never refuses one.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_MODEL_LEN_WORDS = "--max-model-len (API: max_model_len)"  # the setting, as both audiences know it


@dataclass(frozen=True)
class RequestLimits:
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    num_blocks: int
    block_size: int
    # ``max_model_len`` was set below the model's own context, so a too-long prompt's error names that
    # setting (the one to raise), not the model
    context_set_by_option: bool = False
    num_groups: int = 1  # layer groups (`attention.kv_cache.group_layers`), each with its own blocks

    def rejection_reason(self, n_prompt: int, n: int, max_tokens: int, beam: bool = False) -> str | None:
        """Why a request of ``n_prompt`` tokens and ``n`` completions (or beams) can never run here, or None."""
        if n_prompt == 0:
            return "the prompt is empty"
        if n_prompt >= self.max_model_len:
            return f"the prompt has {n_prompt} tokens; {self.context_words('is')} (one more is needed to generate)"
        if n > self.max_num_seqs:
            return f"n={n} completions exceed max_num_seqs={self.max_num_seqs}"
        if beam and n > self.max_num_batched_tokens:
            return f"beam_width={n} exceeds max_num_batched_tokens={self.max_num_batched_tokens}"
        worst = self.worst_case_blocks(n_prompt, max_tokens, n)
        if worst > self.num_blocks:
            return (
                f"the request may need {worst} KV blocks ({n_prompt} prompt tokens, n={n}, "
                f"max_tokens={max_tokens}, block size {self.block_size}) but the pool has "
                f"{self.num_blocks}; raise the pool size or lower n / max_tokens"
            )
        return None

    def context_words(self, link: str) -> str:
        """``the model's context {link} N tokens``, or ``the context {link} N tokens by --max-model-len
        (API: max_model_len)`` when that setting lowered it: the words say what to raise."""
        if self.context_set_by_option:
            return f"the context {link} {self.max_model_len} tokens by {MAX_MODEL_LEN_WORDS}"
        return f"the model's context {link} {self.max_model_len} tokens"

    def worst_case_blocks(self, n_prompt: int, max_tokens: int, n: int) -> int:
        """Blocks a request holds at its longest: shared full prompt blocks + each completion's own, in
        every layer group (a windowed group's holds fewer once its prompt is computed, but a prompt
        computed in one chunk holds them all)."""
        shared = n_prompt // self.block_size
        per_completion = -(-(n_prompt + max_tokens - 1) // self.block_size) - shared
        return (shared + n * per_completion) * self.num_groups
