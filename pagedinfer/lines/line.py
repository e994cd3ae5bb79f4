"""What one input line is once parsed: a request that passed every check that needs no model, or an error.

A line's key is how ``--resume`` and the final reorder recognise it, and what its derived seed comes
from. The rule (`line_key`), one for input lines and output records alike: the first line using a
``custom_id`` (OpenAI lines) or an ``id`` (plain lines) is keyed by it; every other line (no id, an
unusable id, or an id an earlier line already used) is keyed by its line number. So a repeated id
is an error record in its own position and can never mark the first line done.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from pagedinfer.sampling_params import BeamSearchParams, SamplingParams, is_int

COMPLETIONS_URL = "/v1/completions"
CHAT_URL = "/v1/chat/completions"


def line_key(custom_id: object, ident: object, line: int | None) -> str:
    """The key of a line (or record) with this custom_id or id on this line.

    An explicit id equal to the line's own number means the same as no id (``line:N``), so an
    explicit ``"id": 3`` elsewhere never collides with an unnamed line 3.
    """
    if custom_id is not None:
        return f"custom_id:{json.dumps(custom_id)}"
    if ident is None or (ident == line and is_int(ident)):
        return f"line:{line}"
    return f"id:{json.dumps(ident)}"


@dataclass
class OpenAIRequest:
    """What an OpenAI batch line needs to be answered in kind."""

    custom_id: str | None  # None: not usable as a key (absent, invalid or repeated)
    url: str  # COMPLETIONS_URL or CHAT_URL
    model: str | None = None
    logprobs_style: str | None = None  # "completions", "chat" or None (not asked)
    echo: bool = False  # completions: the prompt is put before each choice's text (and logprobs)
    prompt_logprobs: bool = False  # the body asked for them (vLLM's extension): answered where vLLM puts them

    @property
    def chat(self) -> bool:
        return self.url == CHAT_URL


@dataclass
class LineRequest:
    """A line that passed every check that needs no model."""

    line: int  # 1-based line number in the file
    key: str
    id: object  # plain lines: the `id` field or the line number; OpenAI lines: custom_id
    prompt: (
        dict  # the engine's prompt form: {"prompt": str}, {"messages": [...]} or {"prompt_token_ids": [...]}
    )
    params: SamplingParams | BeamSearchParams
    openai: OpenAIRequest | None = None
    # the adapter it runs with (None: the base model): a plain line's ``lora`` field, or an OpenAI
    # body's ``model`` when it names one of the run's adapters (vLLM's convention)
    lora: str | None = None

    @property
    def kind(self) -> str:
        """ "prompt", "messages" or "prompt_token_ids": which prompt form the line gave."""
        return next(iter(self.prompt))

    def failed(self, reason: str) -> LineError:
        """This line's error record, for a reason found later (by the model, or while running)."""
        echo = dict(self.prompt) if self.kind == "prompt" else {}
        return LineError(self.line, self.key, self.id, reason, self.openai, self.openai is not None, echo)


@dataclass
class LineError:
    """A line that cannot run; written to the output as an error record."""

    line: int
    key: str
    id: object
    reason: str
    openai: OpenAIRequest | None = None  # set when the line was recognisably an OpenAI request
    openai_file: bool = False  # answer in the OpenAI shape (an OpenAI line, or a line of an OpenAI file)
    echo: dict = field(default_factory=dict)  # the prompt as given, when it could be read

    @property
    def message(self) -> str:
        return f"line {self.line}: {self.reason}"


Item = LineRequest | LineError
