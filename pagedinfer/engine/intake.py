"""Intake: a prompt and its parameters -> an `EngineRequest` the engine runs as given, or a `Rejected`.

The one place a request is tokenized and checked, for every caller (`LLM.generate`, ``pagedinfer
run``, the Ray replicas): a chat prompt is rendered with the tokenizer's chat template (generation
prompt added, in a child process within a time budget and a memory limit: `chat_render`) and
tokenized without adding special tokens again; a text too long for the context is refused before
tokenizing; token ids, given or tokenized, must be in the vocabulary (the embedding's rows); the
parameters must suit the engine (``max_logprobs``) and the model (its vocabulary, EOS and logits
processors); and the request must fit the model's context and the pool
(`RequestLimits.rejection_reason`); a LoRA adapter, named by a `LoRARequest` (read and checked the
first time) or by the name of one loaded already, must be
servable (`AdapterRegistry`), else the reason starts with ``lora:``. Whatever raises while preparing
one request rejects that request alone. `LLMEngine.add_request` checks nothing again.

Each engine holds one `Intake` (``engine.intake``), made from what it checks against: the tokenizer,
the vocabulary and EOS, the limits, the logits processors, the adapters, and the seeded stream of
base seeds for requests that give none. ``engine.intake.prepare(prompt, params, request_id, lora)`` is
the one entry point.

Prompt forms: a string, ``{"prompt": str}``, ``{"prompt_token_ids": [...]}`` (optionally with its
``"prompt"`` text) or ``{"messages": [{"role": ..., "content": ...}, ...]}``.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedinfer import chat_render
from pagedinfer.core.limits import RequestLimits
from pagedinfer.core.sequence import KeptCompletion
from pagedinfer.errors import first_line
from pagedinfer.logits.processor import LogitsPipeline
from pagedinfer.lora.adapter import AdapterError
from pagedinfer.lora.registry import AdapterRegistry, LoadedAdapter
from pagedinfer.lora.request import LoRARequest
from pagedinfer.sampling_params import BeamSearchParams, SamplingParams, is_int, unicode_error


@dataclass
class EngineRequest:
    """A request intake has tokenized and checked: the engine runs it as it is."""

    request_id: str
    prompt: str | None  # the text (a chat prompt: the rendered template), None for token ids alone
    prompt_token_ids: list[int]
    params: SamplingParams  # beam search: n = beam_width, greedy
    max_tokens: int  # params.max_tokens capped by the context (and by the engine's max_line_tokens)
    seed: int  # the base seed of its completions (drawn once here when params give none)
    beam: BeamSearchParams | None = None
    lora: LoadedAdapter | None = None  # its adapter (None: the base model)
    cap: str | None = None  # "max_line_tokens" when that cap is below its own limit
    # what an earlier run generated of it, by completion index (``--resume`` inside a line)
    kept: dict[int, KeptCompletion] | None = None


@dataclass
class Rejected:
    """A request that can never run, and why."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | BeamSearchParams
    reason: str


@dataclass
class Intake:
    """What requests are checked against, for one engine; `prepare` turns each into an `EngineRequest`
    or a `Rejected`."""

    tokenizer: Any  # the model's (None: prompts as token ids only)
    model_name: str
    vocab_size: int
    eos_token_ids: set[int] | frozenset[int]
    limits: RequestLimits
    logits: LogitsPipeline  # checks the parameters that shape logits (and compiles their grammars)
    adapters: AdapterRegistry | None  # the LoRA adapters (None: LoRA is not enabled)
    max_logprobs: int
    max_line_tokens: int | None
    seed: int  # starts the stream of base seeds drawn for requests that give none
    _seeds: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._seeds = random.Random(self.seed)

    @functools.cached_property
    def max_prompt_chars(self) -> int:
        """A text longer than this cannot fit the context: no token spans more characters than the
        tokenizer's longest vocabulary entry (a generous bound, so a huge line is refused without
        tokenizing it)."""
        tok = self.tokenizer
        longest = max((len(t) for t in tok.get_vocab()), default=1) if tok is not None else 1
        return self.limits.max_model_len * max(longest, 1)

    def prepare(
        self,
        prompt: str | dict,
        params: SamplingParams | BeamSearchParams,
        request_id: str,
        lora: LoRARequest | str | None = None,
        interrupt: Callable[[], None] | None = None,
    ) -> EngineRequest | Rejected:
        """Tokenize ``prompt`` and check it, ``params`` and ``lora`` (an adapter, or a loaded adapter's
        name) against the model and the pool, once. ``interrupt`` is called often while a chat
        template renders: what it raises abandons the render and propagates (make it a BaseException,
        which no ``except Exception`` here takes for the request's failure)."""
        text, ids, adapter = None, [], None
        limits = self.limits
        try:
            if not isinstance(params, (SamplingParams, BeamSearchParams)):  # else "tokenizing failed: ..."
                raise ValueError(
                    f"sampling_params must be a SamplingParams or BeamSearchParams, not {type(params).__name__}"
                )
            adapter = None if lora is None else self._adapter(lora)
            vocab = self.vocab_size
            # the prompt's text and token ids, whatever its form (kept only once they pass); a chat
            # prompt's rendered template carries its special tokens: none are added again
            chat = isinstance(prompt, dict) and "messages" in prompt
            given_ids = isinstance(prompt, dict) and not chat and "prompt_token_ids" in prompt
            if chat:
                rendered = self._render_chat(prompt["messages"], interrupt)
            elif isinstance(prompt, dict):
                if not given_ids and "prompt" not in prompt:
                    raise ValueError("a prompt dict needs 'prompt', 'prompt_token_ids' or 'messages'")
                rendered = prompt.get("prompt")
            else:
                rendered = prompt
            if given_ids:
                given = prompt["prompt_token_ids"]
                if not isinstance(given, list) or not all(is_int(t) and 0 <= t < vocab for t in given):
                    raise ValueError(f"prompt_token_ids must be a list of integers in [0, {vocab})")
                if rendered is not None and (not isinstance(rendered, str) or unicode_error(rendered)):
                    raise ValueError("the prompt text must be a valid Unicode string")
                text, ids = rendered, list(given)
            else:
                if not isinstance(rendered, str):
                    raise ValueError(f"a prompt must be a string or a dict, not {type(rendered).__name__}")
                if (why := unicode_error(rendered)) is not None:
                    raise ValueError(f"the prompt {why}")
                tok = self.tokenizer
                if tok is None:
                    raise ValueError(
                        f"model {self.model_name} has no tokenizer: give prompts as prompt_token_ids"
                    )
                if len(rendered) > self.max_prompt_chars:
                    raise ValueError(
                        f"the prompt has {len(rendered):,} characters: more than "
                        f"{limits.context_words('of')} can hold (checked before tokenizing)"
                    )
                text, ids = rendered, tok(rendered, add_special_tokens=not chat)["input_ids"]
                if (bad := next((t for t in ids if not 0 <= t < vocab), None)) is not None:  # a tokenizer
                    # larger than the embedding (the loader notes it): the row lookup must never see it
                    raise ValueError(
                        f"the prompt tokenizes to id {bad} ({tok.convert_ids_to_tokens(bad)!r}), outside the "
                        f"model's vocabulary of {vocab} tokens (its embedding's rows)"
                    )
            beam = params if isinstance(params, BeamSearchParams) else None
            sampling = params if beam is None else beam.sampling_params()
            context = limits.max_model_len
            max_tokens = min(params.max_tokens or context, context - len(ids))
            line_cap = self.max_line_tokens  # before the pool check: a capped request needs fewer blocks
            cap = "max_line_tokens" if line_cap is not None and line_cap < max_tokens else None
            max_tokens = line_cap if cap else max_tokens
            # what the params cannot check alone: against the model's vocabulary and EOS, its processors
            # (a grammar is compiled here, cached for the completions), the context and the pool
            if (
                beam is not None
                and beam.structured_outputs is not None
                and (beam.ignore_eos or not self.eos_token_ids)
            ):
                raise ValueError(
                    "structured_outputs in beam search needs the model's EOS (and no ignore_eos): beams end there"
                )
            limit = self.max_logprobs
            for name, k in (("logprobs", sampling.logprobs), ("prompt_logprobs", sampling.prompt_logprobs)):
                if k is not None and 0 <= limit < k:
                    raise ValueError(
                        f"{name}={k} exceeds max_logprobs={limit} (raise it with --max-logprobs or "
                        "LLM(max_logprobs=...); -1: no limit)"
                    )
                if k is not None and k > vocab:
                    raise ValueError(f"{name}={k} exceeds the model's vocabulary of {vocab} tokens")
            if any(t >= vocab for t in sampling.stop_token_ids):
                raise ValueError(f"stop_token_ids must be below the model's vocabulary size {vocab}")
            # the pipeline is asked only when a processor applies
            shaped = self.logits.validate(sampling) if sampling.shapes_logits else None
            reason = shaped or limits.rejection_reason(len(ids), sampling.n, max_tokens, beam is not None)
        except ValueError as e:
            reason = first_line(e)
        except Exception as e:  # noqa: BLE001 - a tokenizer failing on one prompt must not end the others
            reason = f"tokenizing failed: {type(e).__name__}: {first_line(e, '')}".rstrip(": ")
        if reason:
            return Rejected(request_id, text, ids, params, reason)
        params = sampling
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(62)
        return EngineRequest(request_id, text, ids, params, max_tokens, seed, beam, adapter, cap)

    def _adapter(self, lora: LoRARequest | str) -> LoadedAdapter:
        """The adapter, read and checked once; raises ValueError starting with ``lora:``."""
        if self.adapters is None:
            raise ValueError(
                "lora: this engine has no LoRA enabled (LLM(enable_lora=True), or pagedinfer run --lora)"
            )
        try:
            if isinstance(lora, LoRARequest):
                return self.adapters.add(lora)
            return self.adapters.get(lora)
        except AdapterError as e:
            raise ValueError(f"lora: {e}") from None

    def _render_chat(self, messages: list[dict], interrupt: Callable[[], None] | None) -> str:
        tok = self.tokenizer
        if tok is None:
            raise ValueError(f"model {self.model_name} has no tokenizer, so chat messages cannot be rendered")
        if not getattr(tok, "chat_template", None):
            raise ValueError(f"the tokenizer of model {self.model_name} has no chat template")
        limit = self.max_prompt_chars
        try:
            return chat_render.render(
                tok.get_chat_template(), messages, tok.special_tokens_map, limit, interrupt
            )
        except chat_render.RenderedTooLong:
            raise ValueError(
                f"the rendered chat prompt has more than {limit:,} characters: more than "
                f"{self.limits.context_words('of')} can hold (checked before tokenizing)"
            ) from None
