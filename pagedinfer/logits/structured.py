"""Structured outputs: every completion of a request follows a JSON schema, a regex, a choice or a grammar.

Grammars are compiled by llguidance (Earley parser over a lazily built lexer; no dependencies, the
library vLLM's ``guidance`` backend and llama.cpp use): JSON schemas, ``json_object``, regexes, choices,
and Lark (EBNF) or llama.cpp GBNF grammars. Against xgrammar on the CPU (scripts/bench_grammar_libs.py,
docs/bench.md): xgrammar's masks cost less per step, but llguidance compiles a schema much faster and
brings no dependency (xgrammar pulls triton), and its masks, a small part of a batched step, are
computed while the forward pass runs.

* `GrammarCompiler`: one compiled matcher per distinct constraint (`StructuredOutputsParams.key`) in
  a bounded LRU cache; every sequence starts from a copy of it. Compiled in `engine.intake.prepare`
  (so an invalid or unsupported schema is that request's error, naming the problem), reused when the
  request's completions start.
* `MatcherState`: one sequence's matcher, told every appended token, forked with a beam. When its
  grammar is complete the sequence stops (finish reason ``stop``); ``max_tokens`` reached before that
  gives ``length``, as OpenAI does.
* `GrammarProcessor`: before the forward pass, one bitmask row per constrained sequence is filled
  by llguidance's thread pool in a worker thread (the GIL is released), overlapping the forward pass;
  the sampler then sets every disallowed token's logit to -inf. EOS is allowed only where the grammar
  can end. A model without an EOS token gets a virtual one past its vocabulary (never drawn). A JSON
  constraint's sequences also follow their objects' keys (`logits.json_keys`): a token that would
  repeat a key of its object is masked too, which no grammar can say.

JSON's whitespace is bounded by default (`sampling_params.BOUNDED_JSON_WHITESPACE`): unbounded, a weak
model at a high temperature spends its tokens on blank space between JSON tokens and never finishes.
"""

from __future__ import annotations

import copy
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch

from pagedinfer.logits.finite_schema import endless_ref
from pagedinfer.logits.json_keys import JsonKeys, KeyGuard
from pagedinfer.logits.processor import LogitsProcessor, Row
from pagedinfer.sampling_params import BOUNDED_JSON_WHITESPACE, SamplingParams, StructuredOutputsParams

CACHE_SIZE = 256  # distinct compiled constraints kept
ERROR_CHARS = 300  # a grammar error is cut to this much in a request's error


@dataclass
class StructuredCounters:
    """Figures of structured outputs since the last `GrammarCompiler.reset_stats`."""

    compiles: int = 0  # constraints compiled (cache misses)
    cache_hits: int = 0  # requests (or completions) that found their constraint compiled
    compile_s: float = 0.0
    masks: int = 0  # bitmask rows filled
    mask_s: float = 0.0  # llguidance filling them (in the worker, overlapping the forward pass)
    mask_wait_s: float = 0.0  # the sampler waiting for them after the forward pass
    apply_s: float = 0.0  # setting the disallowed logits to -inf


class GrammarError(ValueError):
    """A constraint that does not compile; the message names the field and the problem."""


def grammar_text(so: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint (not checked yet: the matcher compiles it)."""
    import llguidance

    kind = so.kind
    if kind in ("json", "json_object"):
        schema = so.json if kind == "json" else {"type": "object"}
        if kind == "json" and (ref := endless_ref(schema)) is not None:
            raise GrammarError(
                f"structured_outputs.json: $ref {ref!r} has no finite instance: each one must contain"
                " another (a reference cycle with no optional way out)"
            )
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=json_options(so, schema))
        except ValueError as e:
            raise GrammarError(f"structured_outputs.{kind}: {_headline(e)}") from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(so.regex)
    if kind == "choice":
        return llguidance.grammar_from("choice", so.choice)
    try:
        return llguidance.grammar_from("grammar", so.grammar)  # Lark, or GBNF converted to Lark
    except ValueError as e:
        raise GrammarError(f"structured_outputs.grammar: {_headline(e)}") from None


def json_options(so: StructuredOutputsParams, schema: dict) -> dict:
    """llguidance's JSON options for ``so``: they are its defaults, so a schema's own ``x-guidance``
    settings win (llguidance's order, vLLM's too); the bounded whitespace applies only where neither
    the request nor the schema chose."""
    if so.disable_any_whitespace:
        return {"whitespace_flexible": False}
    if so.whitespace_pattern is not None:
        return {"whitespace_pattern": so.whitespace_pattern}
    own = schema.get("x-guidance")
    if isinstance(own, dict) and ("whitespace_flexible" in own or "whitespace_pattern" in own):
        return {}
    return {"whitespace_pattern": BOUNDED_JSON_WHITESPACE}


def _reason(error: str) -> str:
    """llguidance's error in the user's terms, on one line (its parser-state dump left out)."""
    text = _headline(error)
    if text.startswith("NoExtensionBias"):  # no token can extend the output, and it cannot end
        return "the grammar accepts no output: its rules only lead back to themselves"
    if "Too many items" in text and "ff_tokens" in text:  # the forced continuation never ends
        return "the grammar has no finite output from here: it forces endless text (a rule that must repeat)"
    if "Too many items" in text:
        return "the grammar is too ambiguous to follow here (llguidance's parser ran past its item limit)"
    return text


def _probe(matcher) -> str | None:
    """The error a copy of a new matcher meets taking its forced start and computing its first mask:
    where a grammar with no finite output shows (no token allowed, or endless forced text)."""
    probe = matcher.deep_copy()
    forced = probe.compute_ff_tokens()
    if forced:
        probe.consume_tokens(forced)
    if not probe.is_error():
        probe.compute_bitmask()
    return probe.get_error() if probe.is_error() else None


def _headline(e: object) -> str:
    """The error's first line; when that line only announces a report (`regex parse error:`),
    llguidance's reason (its `error: ...` line further down) is added, else the reason is lost."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    text = lines[0] if lines else type(e).__name__
    if text.endswith(":"):
        reasons = [line.removeprefix("error:").strip() for line in lines[1:] if line.startswith("error:")]
        text = f"{text} {reasons[0]}" if reasons else text
    return text if len(text) <= ERROR_CHARS else text[:ERROR_CHARS] + "…"


class GrammarCompiler:
    """Compiles constraints for one model's tokenizer; keeps the last `CACHE_SIZE` distinct ones."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: set[int] | frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self.counters = StructuredCounters()
        self._cache: OrderedDict[str, object] = OrderedDict()  # key -> a matcher that never moves
        self._ll_tokenizer = None
        self._key_guard: KeyGuard | None = None

    def make_stats(self) -> StructuredCounters:
        """The figures since the last `reset_stats` (a copy)."""
        return replace(self.counters)

    def reset_stats(self) -> None:
        self.counters = StructuredCounters()

    @property
    def ll_tokenizer(self):
        """llguidance's view of the tokenizer (about a second to build: once per engine)."""
        if self._ll_tokenizer is None:
            import llguidance

            if self.eos_ids:
                n_vocab, eos = self.vocab_size, self.eos_ids
            else:  # a virtual EOS past the logits: never drawn, it only lets a grammar end
                n_vocab, eos = self.vocab_size + 1, self.vocab_size
            # what llguidance.hf.from_tokenizer does with a fast tokenizer, without importing transformers
            # for its type check: the backend's JSON without padding or truncation
            backend = copy.copy(self.tokenizer.backend_tokenizer)
            backend.no_padding()
            backend.no_truncation()
            self._ll_tokenizer = llguidance.LLTokenizer(backend.to_str(), n_vocab=n_vocab, eos_token=eos)
        return self._ll_tokenizer

    @property
    def key_guard(self) -> KeyGuard:
        """The vocabulary's view for JSON keys (made on the first JSON constraint)."""
        if self._key_guard is None:
            ll = self.ll_tokenizer
            self._key_guard = KeyGuard(
                self.vocab_size, lambda t: b"" if ll.is_special_token(t) else ll.decode_bytes([t])
            )
        return self._key_guard

    def template(self, so: StructuredOutputsParams, request: bool = True):
        """The compiled matcher of ``so`` (from the cache, else compiled now). Raises GrammarError.

        ``request``: a request's lookup (counted as a hit); a completion's start looks up quietly.
        """
        key = so.key
        found = self._cache.get(key)
        if found is not None:
            self._cache.move_to_end(key)
            self.counters.cache_hits += request
            return found
        import llguidance

        start = time.perf_counter()
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar_text(so), log_level=0)
        self.counters.compile_s += time.perf_counter() - start
        self.counters.compiles += 1
        error = matcher.get_error() if matcher.is_error() else _probe(matcher)
        if error is not None:
            raise GrammarError(f"structured_outputs.{so.kind}: {_reason(error)}")
        self._cache[key] = matcher
        if len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return matcher


class MatcherState:
    """One sequence's place in its grammar (and, under a JSON constraint, in its objects' keys)."""

    def __init__(self, matcher, keys: JsonKeys | None = None, guard: KeyGuard | None = None) -> None:
        self.matcher = matcher
        self.keys, self.guard = keys, guard

    def accept(self, token: int) -> None:
        # a matcher that errs (a grammar it cannot follow) may still take the token: never a success
        if not self.matcher.consume_token(token) or self.matcher.is_error():
            raise ValueError(
                f"structured_outputs: token {token} is not allowed here ({_reason(self.matcher.get_error())})"
            )
        if self.keys is not None and (key := self.keys.feed(self.guard.token_bytes[token])) is not None:
            raise ValueError(f"structured_outputs: token {token} repeats the key {key!r} of its object")

    def fork(self) -> MatcherState:
        keys = None if self.keys is None else self.keys.copy()
        return MatcherState(self.matcher.deep_copy(), keys, self.guard)

    def forced_tokens(self) -> list[int]:
        """The tokens of the text the grammar forces next (llguidance's fast-forward tokens, the
        matcher unmoved): a draft that is verified like any other, so a tokenization the model would
        not pick costs a rejected row, never a changed token."""
        return [] if self.matcher.is_stopped() else self.matcher.compute_ff_tokens()

    @property
    def finished(self) -> bool:
        """Nothing can follow (the grammar is complete, or only EOS may come)."""
        return self.matcher.is_stopped()


@dataclass
class _Masks:
    states: list[MatcherState]  # the rows' states, in row order
    bitmask: torch.Tensor  # [len(states), ceil(V' / 32)] int32, bit t of row i: token t allowed
    done: Future


class GrammarProcessor(LogitsProcessor):
    """Masks every token the row's grammar does not allow at this point."""

    name, masks = "structured_outputs", True

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._executor = None  # llguidance's thread pool, made on first use
        self._worker: ThreadPoolExecutor | None = None
        self._pending: _Masks | None = None
        self._shifts = torch.arange(32, dtype=torch.int32)  # [32]

    def wants(self, params: SamplingParams) -> bool:
        return params.structured_outputs is not None

    def validate(self, params: SamplingParams) -> str | None:
        if self.compiler.tokenizer is None:
            return "structured_outputs needs the model's tokenizer (this model has none)"
        try:
            self.compiler.template(params.structured_outputs)
        except GrammarError as e:
            return str(e)
        return None

    def new_state(self, params: SamplingParams) -> MatcherState:
        so = params.structured_outputs
        matcher = self.compiler.template(so, request=False).deep_copy()
        if so.kind not in ("json", "json_object"):
            return MatcherState(matcher)
        return MatcherState(matcher, JsonKeys(), self.compiler.key_guard)

    def prepare(self, rows: list[Row]) -> None:
        """Start filling the step's bitmask rows in the worker thread (it overlaps the forward pass)."""
        states = [r.state.get(self.name) for r in rows if self.wants(r.params) and r.state is not None]
        self._pending = self._start(states) if states else None

    def _start(self, states: list[MatcherState]) -> _Masks:
        import llguidance
        import llguidance.torch

        if self._executor is None:
            self._executor = llguidance.LLExecutor()
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")
        width = (self.compiler.ll_tokenizer.vocab_size + 31) // 32
        bitmask = torch.empty(len(states), width, dtype=torch.int32)  # [S, W]
        pairs = [(s.matcher, i) for i, s in enumerate(states)]
        counters = self.compiler.counters

        def fill() -> None:
            start = time.perf_counter()
            llguidance.torch.fill_next_token_bitmask_par(self._executor, pairs, bitmask)
            counters.mask_s += time.perf_counter() - start
            counters.masks += len(pairs)

        return _Masks(states, bitmask, self._worker.submit(fill))

    def apply(self, logits: torch.Tensor, index: list[int], rows: list[Row]) -> None:
        states = [r.state.get(self.name) for r in rows]
        masks = self._pending
        where = {id(s): j for j, s in enumerate(masks.states)} if masks is not None else {}
        if not all(id(s) in where for s in states):  # not prepared for these rows (a retried step)
            masks = self._start(states)
            where = {id(s): j for j, s in enumerate(states)}
        counters = self.compiler.counters
        start = time.perf_counter()
        masks.done.result()
        counters.mask_wait_s += time.perf_counter() - start
        start = time.perf_counter()
        picks = [where[id(s)] for s in states]
        bitmask = masks.bitmask if picks == list(range(len(masks.states))) else masks.bitmask[picks]
        apply_bitmask(logits, index, bitmask, self._shifts)
        for i, s, row in zip(index, states, bitmask, strict=True):
            if s.keys is not None and (banned := s.guard.banned(s.keys, row)):
                logits[i, banned] = float("-inf")
        counters.apply_s += time.perf_counter() - start


def apply_bitmask(
    logits: torch.Tensor, index: list[int], bitmask: torch.Tensor, shifts: torch.Tensor
) -> None:
    """``logits[index[i], t] = -inf`` wherever bit ``t`` of ``bitmask[i]`` is 0."""
    vocab = logits.shape[1]
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [S, W, 32]
    allowed = bits.view(len(index), -1)[:, :vocab].to(device=logits.device, dtype=torch.bool)  # [S, V]
    rows = torch.tensor(index, device=logits.device)  # [S]
    logits[rows] = logits[rows].masked_fill_(~allowed, float("-inf"))
