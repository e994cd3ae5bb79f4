"""Turn one step's logits into next tokens for every sampling sequence, vectorised across the batch.

Greedy rows take the argmax. Sampled rows are tempered, filtered (top-k, top-p, min-p) and drawn
by inverting their CDF at one uniform number from each sample's own generator: the draw depends
only on that sample's generator and logits, never on its neighbours, and costs one scalar of
randomness per row. Only rows with penalties, min_tokens or logprobs take extra (tensor) work;
the log-normaliser over the vocabulary is computed only for rows that asked for logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedinfer.model import fused_ops
from pagedinfer.outputs import Logprob
from pagedinfer.sampling_params import SamplingParams


@dataclass
class SampleRow:
    """What the sampler needs of one logits row: its settings, its random source, its tokens so far."""

    params: SamplingParams
    generator: torch.Generator | None  # None only for greedy rows
    token_ids: list[int]  # prompt + generated tokens (penalties, min_tokens)
    num_prompt_tokens: int


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float | None]  # of each sampled token under the model's raw distribution, if asked
    top: list[dict[int, Logprob] | None]  # per row, when logprobs were asked for


@torch.inference_mode()  # the step's logits are inference tensors, updated in place
def sample(logits: torch.Tensor, rows: list[SampleRow], eos_ids: set[int]) -> SampleResult:
    """``logits [R, V]`` float32, one row per entry of ``rows``.

    ``logits`` may be modified in place: the caller hands over the step's own tensor.
    """
    params = [r.params for r in rows]
    dev = logits.device
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    # [Rw, V] reported logprobs are the model's own, before penalties and temperature
    raw = logits[torch.tensor(want, device=dev)] if want else None
    if any(p.penalized or p.min_tokens for p in params):
        _apply_penalties(logits, rows)
        _suppress_early_stop(logits, rows, eos_ids)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    all_sampled = len(sampled) == len(rows)  # then no argmax and no row gather are needed
    # [R]: the greedy rows' argmax; sampled rows are filled in below
    tokens = (
        torch.empty(len(rows), dtype=torch.int64, device=dev) if all_sampled else fused_ops.argmax(logits)
    )
    if sampled:
        picks = torch.tensor(sampled, device=dev)  # [Rs]
        temps = torch.tensor([params[i].temperature for i in sampled], device=dev).unsqueeze(1)  # [Rs, 1]
        tempered = logits.div_(temps) if all_sampled else logits[picks] / temps  # [Rs, V]
        probs = _filtered_probs(tempered, [params[i] for i in sampled])  # [Rs, V]
        cdf = probs.cumsum_(dim=-1)  # [Rs, V]
        # drawn from each sample's host generator, so a seed gives the same numbers on every device
        gens = [rows[i].generator for i in sampled]
        uniform = torch.cat([torch.rand(1, generator=g, device=g.device) for g in gens]).to(dev)  # [Rs]
        picked = torch.searchsorted(cdf, (uniform * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
        tokens[picks] = picked.clamp_(max=cdf.shape[1] - 1)
    chosen: list[float | None] = [None] * len(rows)
    top: list[dict[int, Logprob] | None] = [None] * len(rows)
    if want:
        k = max(params[i].logprobs for i in want)
        logprobs = raw - torch.logsumexp(raw, dim=-1, keepdim=True)  # [Rw, V]
        picked_lp = logprobs.gather(1, tokens[want].unsqueeze(1))  # [Rw, 1]
        values, ids = logprobs.topk(max(k, 1), dim=-1)  # [Rw, k]
        ranks = (logprobs > picked_lp).sum(dim=1) + 1  # [Rw]
        for j, i in enumerate(want):
            chosen[i] = float(picked_lp[j])
            entry = {int(tokens[i]): Logprob(chosen[i], int(ranks[j]))}
            for r in range(params[i].logprobs):
                entry.setdefault(int(ids[j, r]), Logprob(float(values[j, r]), r + 1))
            top[i] = entry
    return SampleResult(tokens.tolist(), chosen, top)


def _filtered_probs(logits: torch.Tensor, params: list) -> torch.Tensor:
    """Unnormalised probabilities after top-k, top-p and min-p, computed in place in ``logits``.

    Each filter applies per row; rows without them pay only ``exp(logit - max)``. The CDF
    inversion scales its uniform number by each row's total, so no normalising pass is needed.
    """
    if any(p.top_k or p.top_p < 1.0 for p in params):
        vocab, dev = logits.shape[-1], logits.device
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # [R, V]
        top_k = torch.tensor([p.top_k or vocab for p in params], device=dev).unsqueeze(1)  # [R, 1]
        drop = torch.arange(vocab, device=dev).unsqueeze(0) >= top_k  # [R, V]
        sorted_probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        top_p = torch.tensor([p.top_p for p in params], device=dev).unsqueeze(1)  # [R, 1]
        drop |= (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p  # keep the token crossing top_p
        logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()  # [R, V]
    min_p = torch.tensor([p.min_p for p in params], device=logits.device).unsqueeze(1)  # [R, 1]
    if bool((min_p > 0).any()):
        probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs


def _apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    """vLLM's penalties: repetition over prompt + output, presence and frequency over the output."""
    for i, r in enumerate(rows):
        p = r.params
        if not p.penalized:
            continue
        row = logits[i]
        out_ids = torch.tensor(r.token_ids[r.num_prompt_tokens :], dtype=torch.int64, device=row.device)
        counts = torch.bincount(out_ids, minlength=row.shape[0])[: row.shape[0]].to(row.dtype)  # [V]
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            seen[torch.tensor(r.token_ids[: r.num_prompt_tokens], dtype=torch.int64, device=row.device)] = (
                True
            )
            penalised = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row.copy_(torch.where(seen, penalised, row))
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


def _suppress_early_stop(logits: torch.Tensor, rows: list[SampleRow], eos_ids: set[int]) -> None:
    """Below min_tokens, EOS and stop tokens cannot be drawn."""
    for i, r in enumerate(rows):
        p = r.params
        if p.min_tokens and len(r.token_ids) - r.num_prompt_tokens < p.min_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else eos_ids)
            ids = [t for t in banned if t < logits.shape[1]]
            if ids:
                logits[i, ids] = float("-inf")


@torch.inference_mode()
def beam_candidates(logits: torch.Tensor, cumulative: list[float], k: int) -> list[tuple[int, int, float]]:
    """The ``k`` best (beam, token, cumulative log-probability) continuations of ``logits [B, V]``.

    Computed in float32 like transformers' beam search, so the same candidates win.
    """
    vocab = logits.shape[1]
    scores = torch.log_softmax(logits.float(), dim=-1)  # [B, V]
    scores += torch.tensor(cumulative, dtype=torch.float32, device=logits.device).unsqueeze(1)
    values, flat = scores.flatten().topk(min(k, scores.numel()))  # [k]
    return [(i // vocab, i % vocab, v) for i, v in zip(flat.tolist(), values.tolist(), strict=True)]
