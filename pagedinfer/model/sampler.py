"""Turn one step's logits into next tokens for every sampling sequence, vectorised across the batch.

First the logits processors shape the rows that use them (`pagedinfer.logits`: penalties, min_tokens,
logit_bias, bad_words, allowed_token_ids, grammars). Then greedy rows take the argmax, and sampled
rows are tempered, filtered (top-k, top-p, min-p) and drawn by inverting their CDF at one uniform
number from each completion's own generator (rows with a temperature alone in one C call on the CPU,
`fused_ops.sample`): the draw depends only on that completion's generator and
logits, never on its neighbours, and costs one scalar of randomness per row. Only rows with a
processor or logprobs take extra (tensor) work; the log-normaliser over the vocabulary is computed
only for rows that asked for logprobs, over the model's own logits (before any processor).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pagedinfer.logits.processor import LogitsPipeline, Row
from pagedinfer.model import fused_ops
from pagedinfer.outputs import Logprob


@dataclass
class SampleRow(Row):
    """What the sampler needs of one logits row: a processor row plus the completion's random source."""

    generator: torch.Generator | None = None  # None only for greedy rows


@dataclass
class NonFinite:
    """A logits row without a finite maximum: nothing is drawn from it (a NaN argmaxes to garbage)."""

    row: int
    found: str  # "NaN", "+Inf" or "no finite value" (every logit -inf)
    controls: str | None = None  # finite until these logit controls changed it; None: the model's own


@dataclass
class SampleResult:
    token_ids: list[int]  # -1 where no token was drawn (``no_token`` and ``nonfinite`` rows)
    logprobs: list[float | None]  # of each sampled token under the model's raw distribution, if asked
    top: list[dict[int, Logprob] | None]  # per row, when logprobs were asked for
    no_token: list[int] = field(default_factory=list)  # rows the processors left without any token
    nonfinite: list[NonFinite] = field(default_factory=list)  # rows with NaN or infinite logits


def found_words(best: float) -> str:
    """What a row whose maximum is ``best`` (not finite) holds, in a user's words."""
    if math.isnan(best):
        return "NaN"
    return "no finite value" if best == float("-inf") else "+Inf"


@torch.inference_mode()  # the step's logits are inference tensors, updated in place
def sample(logits: torch.Tensor, rows: list[SampleRow], pipeline: LogitsPipeline) -> SampleResult:
    """``logits [R, V]`` float32, one row per entry of ``rows``.

    ``logits`` may be modified in place: the caller hands over the step's own tensor. A row without
    a finite maximum after the processors (NaN, +inf, or every logit -inf where no processor masked
    it) draws nothing: the argmax and draw passes find it themselves. Only the rows a logit control
    could overflow (`LogitsProcessor.overflows`) take one more pass, before the processors, so that
    the cause can be named.
    """
    params = [r.params for r in rows]
    dev = logits.device
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    # [Rw, V] reported logprobs are the model's own, before every processor and temperature
    raw = logits[torch.tensor(want, device=dev)] if want else None
    # the rows a control could overflow, kept where they are finite before it: one of these that ends
    # non-finite was made so by the controls
    risky = pipeline.overflowing(rows)
    firsts = fused_ops.argmax(logits, torch.tensor(list(risky), device=dev)).tolist() if risky else []
    finite_before = {i: risky[i] for i, t in zip(risky, firsts, strict=True) if t >= 0}
    no_token = pipeline.apply(logits, rows)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    all_sampled = len(sampled) == len(rows)  # then no argmax and no row gather are needed
    # [R]: the greedy rows' argmax (-1: no finite maximum); sampled rows are filled in below
    tokens = (
        torch.empty(len(rows), dtype=torch.int64, device=dev) if all_sampled else fused_ops.argmax(logits)
    )
    # the tempered maxima of the rows the torch draw found without one (it may change ``logits``)
    best: dict[int, float] = {}
    if sampled:
        picks = torch.tensor(sampled, device=dev)  # [Rs]
        temperatures = [params[i].temperature for i in sampled]
        # drawn from each completion's host generator, so a seed gives the same numbers on every device
        gens = [rows[i].generator for i in sampled]
        uniform = torch.cat([torch.rand(1, generator=g, device=g.device) for g in gens]).to(dev)  # [Rs]
        filtered = any(_truncates(params[i]) or params[i].min_p > 0 for i in sampled)
        picked = None if filtered else fused_ops.sample(logits, picks, temperatures, uniform)  # [Rs]
        if picked is None:  # top-k / top-p / min-p, or off the C loop: the same draw as torch ops
            temps = torch.tensor(temperatures, device=dev).unsqueeze(1)  # [Rs, 1]
            tempered = logits.div_(temps) if all_sampled else logits[picks] / temps  # [Rs, V]
            probs, top = _filtered_probs(tempered, [params[i] for i in sampled])  # [Rs, V], [Rs]
            cdf = probs.cumsum_(dim=-1)  # [Rs, V]
            picked = torch.searchsorted(cdf, (uniform * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
            picked.clamp_(max=cdf.shape[1] - 1)
            bad = ~torch.isfinite(top)  # [Rs]
            for j in bad.nonzero().flatten().tolist():
                best[sampled[j]] = float(top[j])
            picked.masked_fill_(bad, -1)
        tokens[picks] = picked
    token_ids = tokens.tolist()
    blank = set(no_token)
    nonfinite = []
    for i, t in enumerate(token_ids):
        if t < 0 and i not in blank:
            m = best[i] if i in best else float(logits[i].amax())  # finite: it overflowed at its temperature
            nonfinite.append(NonFinite(i, found_words(m), None if math.isfinite(m) else finite_before.get(i)))
    chosen: list[float | None] = [None] * len(rows)
    top_entries: list[dict[int, Logprob] | None] = [None] * len(rows)
    if want:
        picked = tokens[want].clamp(min=0)  # [Rw]: a row that drew nothing fails; any id serves
        entries = logprob_entries(raw, picked, [params[i].logprobs for i in want])
        failed = blank | {n.row for n in nonfinite}
        for j, (i, entry) in enumerate(zip(want, entries, strict=True)):
            if i in failed:
                continue
            if entry is None:  # the model's own row is not finite (a processor may have hidden it)
                nonfinite.append(NonFinite(i, found_words(float(raw[j].amax()))))
                continue
            top_entries[i] = entry
            chosen[i] = entry[int(picked[j])].logprob
    return SampleResult(token_ids, chosen, top_entries, no_token, nonfinite)


def logprob_entries(
    logits: torch.Tensor, tokens: torch.Tensor, ks: list[int]
) -> list[dict[int, Logprob] | None]:
    """Per row of ``logits [R, V]``: the log-probability and rank of ``tokens[r]`` and the ``ks[r]`` most
    likely tokens (vLLM's logprobs entries), under the rows' own distributions; None for a row whose
    distribution is not finite (a NaN, +inf, or every logit -inf: its normaliser says so)."""
    norm = torch.logsumexp(logits, dim=-1, keepdim=True)  # [R, 1]
    logprobs = logits - norm  # [R, V]
    finite = torch.isfinite(norm).flatten().tolist()
    picked = logprobs.gather(1, tokens.unsqueeze(1))  # [R, 1]
    values, ids = logprobs.topk(max(max(ks), 1), dim=-1)  # [R, k]
    ranks = (logprobs > picked).sum(dim=1) + 1  # [R]
    out: list[dict[int, Logprob] | None] = []
    for r, k in enumerate(ks):
        if not finite[r]:
            out.append(None)
            continue
        entry = {int(tokens[r]): Logprob(float(picked[r]), int(ranks[r]))}
        for j in range(k):
            entry.setdefault(int(ids[r, j]), Logprob(float(values[r, j]), j + 1))
        out.append(entry)
    return out


def softmax(logits: torch.Tensor) -> torch.Tensor:  # [R, V] -> [R, V]
    """Each row's probabilities, exp(x - max) / sum, from ops whose bits do not depend on the CPU's
    vector width (torch's own softmax and log_softmax sum at that width: AVX2 and AVX-512 builds round
    them differently; its exp, sum and logsumexp are the same on both, exp and logsumexp's log being
    MKL's, which pagedinfer's import holds to one code path for every CPU: MKL_CBWR)."""
    e = (logits - logits.amax(dim=-1, keepdim=True)).exp_()
    return e / e.sum(dim=-1, keepdim=True)


def _truncates(params) -> bool:
    """Whether top-k or top-p cuts this row's distribution (its sorted logits are needed)."""
    return bool(params.top_k) or params.top_p < 1.0


def _filtered_probs(logits: torch.Tensor, params: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Unnormalised probabilities after top-k, top-p and min-p, computed in place in ``logits``, and
    each row's maximum ``[R]`` (not finite: the row has a NaN, +inf or no finite logit).

    Each filter applies per row; rows without them pay only ``exp(logit - max)``. The CDF
    inversion scales its uniform number by each row's total, so no normalising pass is needed.
    """
    if any(_truncates(p) for p in params):
        vocab, dev = logits.shape[-1], logits.device
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # [R, V]
        top_k = torch.tensor([p.top_k or vocab for p in params], device=dev).unsqueeze(1)  # [R, 1]
        drop = torch.arange(vocab, device=dev).unsqueeze(0) >= top_k  # [R, V]
        sorted_probs = softmax(sorted_logits.masked_fill(drop, float("-inf")))  # [R, V]
        top_p = torch.tensor([p.top_p for p in params], device=dev).unsqueeze(1)  # [R, 1]
        drop |= (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p  # keep the token crossing top_p
        logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    top = logits.amax(dim=-1, keepdim=True)  # [R, 1]
    probs = logits.sub_(top).exp_()  # [R, V]
    min_p = torch.tensor([p.min_p for p in params], device=logits.device).unsqueeze(1)  # [R, 1]
    if bool((min_p > 0).any()):
        probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs, top.squeeze(1)


@torch.inference_mode()
def beam_candidates(
    logits: torch.Tensor,
    cumulative: list[float],
    k: int,
    shape: Callable[[torch.Tensor], object] | None = None,
) -> list[tuple[int, int, float]] | NonFinite:
    """The ``k`` best (beam, token, cumulative log-probability) continuations of ``logits [B, V]``.

    Computed in float32 like transformers' beam search, so the same candidates win. ``shape`` (a
    grammar) sets excluded tokens' log-probabilities to -inf in place, as transformers' logits
    processors act on the scores; such tokens are never candidates. A beam whose row is not finite
    (a NaN or +inf logit, or none finite) gives NaN scores, which the top-k puts first: then the
    search has no candidates, only that beam's `NonFinite`.
    """
    vocab = logits.shape[1]
    scores = logits.float()  # [B, V] log-probabilities, as logprob_entries normalises them
    scores = scores - torch.logsumexp(scores, dim=-1, keepdim=True)
    if shape is not None:
        shape(scores)
    scores += torch.tensor(cumulative, dtype=torch.float32, device=logits.device).unsqueeze(1)
    values, flat = scores.flatten().topk(min(k, scores.numel()))  # [k]
    if bool(values.isnan().any()):
        beam = int(flat[int(values.isnan().nonzero()[0])]) // vocab
        return NonFinite(beam, found_words(float(logits[beam].amax())))
    return [
        (i // vocab, i % vocab, v)
        for i, v in zip(flat.tolist(), values.tolist(), strict=True)
        if v != float("-inf")
    ]
