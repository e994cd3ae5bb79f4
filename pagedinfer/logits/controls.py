"""The logit controls of `SamplingParams`: allowed_token_ids, bad_words, min_tokens, logit_bias and the
repetition / presence / frequency penalties, each a stateless `LogitsProcessor` (what it needs is in
the row's tokens).

Semantics are vLLM's: ``bad_words`` are tokenized with and without a leading space and a word's last
token is banned when the generated tokens end with the rest of it; ``logit_bias`` is added to the
logits (OpenAI's -100..100); the penalties are vLLM's (repetition over prompt + output, presence and
frequency over the output); below ``min_tokens`` neither EOS nor a stop token can be drawn.
"""

from __future__ import annotations

import functools

import torch

from pagedinfer.logits.processor import LogitsProcessor, Row
from pagedinfer.sampling_params import SamplingParams

NEG_INF = float("-inf")


def _outside(ids, vocab: int) -> int | None:
    return next((t for t in ids if t >= vocab), None)


class AllowedTokens(LogitsProcessor):
    """Only ``allowed_token_ids`` can be drawn."""

    name, masks = "allowed_token_ids", True

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def wants(self, params: SamplingParams) -> bool:
        return params.allowed_token_ids is not None

    def validate(self, params: SamplingParams) -> str | None:
        if (t := _outside(params.allowed_token_ids, self.vocab_size)) is not None:
            return f"allowed_token_ids holds {t}, outside the model's vocabulary of {self.vocab_size} tokens"
        return None

    def apply(self, logits: torch.Tensor, index: list[int], rows: list[Row]) -> None:
        for i, r in zip(index, rows, strict=True):
            ids = torch.tensor(r.params.allowed_token_ids, device=logits.device)  # [A]
            kept = logits[i, ids]  # [A]
            logits[i].fill_(NEG_INF)
            logits[i, ids] = kept


class BadWords(LogitsProcessor):
    """A bad word's last token is banned where the output ends with the word's other tokens."""

    name, masks = "bad_words", True

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size

    def wants(self, params: SamplingParams) -> bool:
        return bool(params.bad_words)

    def validate(self, params: SamplingParams) -> str | None:
        if self.tokenizer is None:
            return "bad_words needs the model's tokenizer (this model has none)"
        for word, ids in zip(params.bad_words, self.token_ids(tuple(params.bad_words)), strict=False):
            if (t := _outside(ids, self.vocab_size)) is not None:
                return f"bad_words {word!r} tokenizes to {t}, outside the model's vocabulary"
        return None

    @functools.lru_cache(maxsize=1024)  # noqa: B019 - one per engine, bounded
    def token_ids(self, words: tuple[str, ...]) -> list[list[int]]:
        """vLLM's tokenization: each word alone, and after a space when that gives a different first
        token and as many tokens (the word in the middle of a text)."""
        out: list[list[int]] = []
        for word in words:
            alone = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            out.append(alone)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if spaced and alone and spaced[0] != alone[0] and len(spaced) == len(alone):
                out.append(spaced)
        return [ids for ids in out if ids]

    def apply(self, logits: torch.Tensor, index: list[int], rows: list[Row]) -> None:
        for i, r in zip(index, rows, strict=True):
            out = r.output_ids
            banned = [
                ids[-1]
                for ids in self.token_ids(tuple(r.params.bad_words))
                if len(ids) - 1 <= len(out) and (len(ids) == 1 or out[len(out) - len(ids) + 1 :] == ids[:-1])
            ]
            if banned:
                logits[i, banned] = NEG_INF


class MinTokens(LogitsProcessor):
    """Below ``min_tokens`` generated tokens, EOS (unless ignored) and the stop tokens cannot be drawn."""

    name, masks = "min_tokens", True

    def __init__(self, eos_ids: set[int] | frozenset[int], vocab_size: int) -> None:
        self.eos_ids = eos_ids
        self.vocab_size = vocab_size

    def wants(self, params: SamplingParams) -> bool:
        return bool(params.min_tokens)

    def apply(self, logits: torch.Tensor, index: list[int], rows: list[Row]) -> None:
        for i, r in zip(index, rows, strict=True):
            p = r.params
            if len(r.token_ids) - r.num_prompt_tokens < p.min_tokens:
                banned = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_ids)
                ids = [t for t in banned if t < self.vocab_size]
                if ids:
                    logits[i, ids] = NEG_INF


class LogitBias(LogitsProcessor):
    """OpenAI's ``logit_bias``: each value added to its token's logit, all rows in one scatter-add."""

    name = "logit_bias"  # at most 100 in size: a finite float32 logit plus it stays finite

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def wants(self, params: SamplingParams) -> bool:
        return bool(params.logit_bias)

    def validate(self, params: SamplingParams) -> str | None:
        if (t := _outside(params.logit_bias, self.vocab_size)) is not None:
            return f"logit_bias names token {t}, outside the model's vocabulary of {self.vocab_size} tokens"
        return None

    def apply(self, logits: torch.Tensor, index: list[int], rows: list[Row]) -> None:
        where = [(i, t, b) for i, r in zip(index, rows, strict=True) for t, b in r.params.logit_bias.items()]
        dev = logits.device
        row_ids = torch.tensor([w[0] for w in where], device=dev)  # [B]
        token_ids = torch.tensor([w[1] for w in where], device=dev)  # [B]
        bias = torch.tensor([w[2] for w in where], dtype=logits.dtype, device=dev)  # [B]
        logits.index_put_((row_ids, token_ids), bias, accumulate=True)


class Penalties(LogitsProcessor):
    """vLLM's penalties: repetition over prompt + output, presence and frequency over the output."""

    name = "penalties"

    def wants(self, params: SamplingParams) -> bool:
        return params.penalized

    def overflows(self, params: SamplingParams) -> str | None:
        """``repetition_penalty`` is only bounded below by 0: far below 1 it divides a positive logit
        past float32 (far above, a negative one to -inf). The presence and frequency penalties
        subtract at most 2 per occurrence: no finite logit overflows."""
        p = params.repetition_penalty
        return None if p == 1.0 else f"repetition_penalty={p}"

    def apply(self, logits: torch.Tensor, index: list[int], rows: list[Row]) -> None:
        for i, r in zip(index, rows, strict=True):
            p = r.params
            row = logits[i]
            out_ids = torch.tensor(r.output_ids, dtype=torch.int64, device=row.device)
            counts = torch.bincount(out_ids, minlength=row.shape[0])[: row.shape[0]].to(row.dtype)  # [V]
            if p.repetition_penalty != 1.0:
                seen = counts > 0
                prompt = torch.tensor(
                    r.token_ids[: r.num_prompt_tokens], dtype=torch.int64, device=row.device
                )
                seen[prompt] = True
                penalised = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
                row.copy_(torch.where(seen, penalised, row))
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
