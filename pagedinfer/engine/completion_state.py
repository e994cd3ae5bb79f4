"""What each completion starts with: its seeded random source, its incremental detokenizer and its
logits processors' state (a grammar matcher, ...). The scheduler asks when it first admits a request
(`core.sequence.CompletionStates`); made then, not at intake, so a waiting request holds none."""

from __future__ import annotations

import torch

from pagedinfer.core.sequence import Request
from pagedinfer.engine.detokenizer import IncrementalDetokenizer
from pagedinfer.logits.processor import LogitsPipeline, LogitsState
from pagedinfer.seeding import completion_seed


class CompletionStates:
    def __init__(self, tokenizer, logits: LogitsPipeline) -> None:
        """``tokenizer``: the model's (None: token ids only, no text)."""
        self.tokenizer = tokenizer
        self.logits = logits

    def __call__(
        self, req: Request, index: int
    ) -> tuple[torch.Generator, IncrementalDetokenizer | None, LogitsState | None]:
        """Completion ``index`` of ``req``: its random source (seeded from the request's base seed, the
        index and the prompt, past the numbers its kept tokens drew: `Request.kept_draws`), its
        detokenizer and its processors' states."""
        tok, p = self.tokenizer, req.params
        gen = torch.Generator()
        gen.manual_seed(completion_seed(req.seed, index, req.prompt_token_ids))
        for _ in range(req.kept_draws(index)):  # the sampler draws one number per token, one at a time
            torch.rand(1, generator=gen)
        state = self.logits.new_state(p) if p.shapes_logits else None
        if tok is None:
            return gen, None, state
        detok = IncrementalDetokenizer(
            tok.backend_tokenizer,
            req.prompt_token_ids,
            p.skip_special_tokens,
            p.stop,
            p.include_stop_str_in_output,
        )
        return gen, detok, state
