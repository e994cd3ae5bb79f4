"""The offline Python API in the shape vLLM users know: ``LLM(model).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import dataclasses
import inspect
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence

from tqdm.auto import tqdm

from pagedinfer.config import LLMConfig, llm_settings
from pagedinfer.engine.intake import EngineRequest, Rejected
from pagedinfer.engine.llm_engine import LLMEngine, StartedRequest
from pagedinfer.engine.loop import GenerationLoop
from pagedinfer.engine.stats import EngineStats
from pagedinfer.lora.request import LoRARequest
from pagedinfer.model.loader import load_model
from pagedinfer.model.tokenizer_snapshot import Tokenizer as SnapshotTokenizer
from pagedinfer.outputs import BeamSearchOutput, RequestOutput
from pagedinfer.sampling_params import BeamSearchParams, SamplingParams

Prompt = str | dict


class LLM:
    """Load a model and its KV pool once; generate for any number of prompt batches.

    ``model``: a local Hugging Face model directory, a hub id or a ``.gguf`` file (default: the embedded
    demo model).
    The pool holds ``num_blocks`` blocks of ``block_size`` tokens, or as many as fit in
    ``kv_cache_memory`` bytes (``'512MiB'`` works too), or a default (2 GiB on the CPU; on CUDA
    ``gpu_memory_utilization`` of the free GPU memory, 0.85 by default), never more than ``max_num_seqs``
    sequences of ``max_model_len`` tokens can use.
    ``model_impl``: ``auto`` (pagedinfer's own Llama-family modeling on the CPU, else transformers'),
    ``pagedinfer`` or ``transformers``.
    ``enable_prefix_caching``: prompts that start with the same full blocks of tokens reuse their
    K/V across requests (and across ``generate`` calls) instead of computing them again.
    ``schedule_policy``: which waiting request is admitted first: ``lpm`` (the one with the longest
    cached prefix, so that requests sharing a prefix run while it is cached; arrival order among
    equals, none overtaken more than ``max_num_seqs`` times) or ``fcfs`` (arrival order).
    ``enforce_eager``: on CUDA, run decode steps eagerly instead of replaying the CUDA graphs
    captured at startup (one per batch-size bucket); the CPU has no graphs.
    ``load_format``: ``auto`` (the checkpoint's weights) or ``dummy`` (random weights drawn on the
    device from the model's config alone: benchmarks of a model's shape).
    ``quantization``: ``None``, or (CPU, a float checkpoint) ``int8``: every linear's weight in int8
    with one float32 scale per output channel; ``int4``, ``int4-zp``, ``int4-g128``, ``int4-g128-zp``:
    4-bit weights with a float32 scale per group of 32 (or 128) inputs, symmetric or with zero
    points; activations in float32, or bfloat16 with ``dtype="bfloat16"``; a
    quarter or an eighth of the weight bytes per step; outputs close to, not equal to, the unquantized
    model's. A ``.gguf`` model keeps its tensors' types without it (under float32 activations, or
    bfloat16 ones with ``dtype="bfloat16"``).
    ``kv_cache_dtype`` (vLLM's name): ``auto`` (the model's dtype), or ``bfloat16`` / ``float16`` under
    float32 activations: the pool holds twice the tokens per byte and decode attention reads half the
    bytes; keys and values are rounded as they are written, so outputs are close to, not equal to,
    a float32 pool's. (``float32`` names the float32 pool of a float32 model.)
    ``chat_template``: a Jinja chat template (its text) that replaces the tokenizer's for chat prompts.
    ``enable_lora`` (vLLM's names): prompts may run with PEFT LoRA adapters (``lora_request`` of
    `generate`), different adapters in one batch, each of rank at most ``max_lora_rank``: requests of at
    most ``max_loras`` distinct adapters run at once (the others wait; adapters are swapped in and
    out), and at most ``max_cpu_loras`` adapters' weights stay in memory (default ``max_loras``; the
    others are read again when needed).
    ``max_line_tokens`` and ``line_timeout`` bound every request of every call, whatever its own
    ``max_tokens``: a completion ends with finish_reason ``"length"`` at ``max_line_tokens`` tokens,
    or at its next token once ``line_timeout`` seconds have passed since its request was admitted;
    its `CompletionOutput.capped_by` then names the bound. Outputs a timeout ends depend on the
    machine's speed.
    ``max_logprobs`` (vLLM's name and default, 20): the most ``logprobs`` or ``prompt_logprobs`` a
    request may ask (a request above it fails with its error); -1: no limit.
    ``speculative_config`` (vLLM's name; default None, off): ``{"method": "ngram",
    "num_speculative_tokens": k, "prompt_lookup_min": a, "prompt_lookup_max": b,
    "suffix_decoding_max_cached_requests": c}``: drafted tokens (a grammar's forced ones, or copied
    from the line's own prompt and output, its sibling completions and the last ``c`` completions
    finished in the run), verified in the step; outputs are byte-identical to a run without it
    (docs/speculative.md). ``{"method": "draft_model", "model": path, "num_speculative_tokens": k}``
    (``model`` alone implies the method, as in vLLM): the drafts are a small second model's greedy
    tokens; a model whose vocabulary is not the target's is refused (`ModelLoadError`).
    """

    def __init__(self, model: str | None = None, **options) -> None:
        """``options``: the settings `config.ModelConfig` and `config.EngineConfig` declare (the
        signature lists them, with their defaults)."""
        config = LLMConfig.of(model, **options)
        m = config.model_config
        loader = {k: v for k, v in dataclasses.asdict(m).items() if k not in ("model", "use_cuda_kernels")}
        self.engine = LLMEngine(
            load_model(m.model, **loader), config.engine_config, use_cuda_kernels=m.use_cuda_kernels
        )

    @classmethod
    def from_config(cls, config: LLMConfig) -> LLM:
        """An `LLM` of a checked config (`LLMConfig.of`): what a Ray replica is sent."""
        return cls(**config.options())

    @property
    def tokenizer(self):
        """The model's Hugging Face tokenizer (None for a model directory without tokenizer files). Where
        the engine runs on its snapshot (`tokenizer_snapshot`), transformers loads it at the first ask."""
        tok = self.engine.loaded.tokenizer
        return tok.hf() if isinstance(tok, SnapshotTokenizer) else tok

    def get_tokenizer(self):
        """`tokenizer`, under vLLM's name (``LLM.get_tokenizer()``), so vLLM scripts run unchanged."""
        return self.tokenizer

    @property
    def stats(self) -> EngineStats:
        """Memory and scheduling statistics of the last ``generate`` call."""
        return self.engine.stats

    @property
    def device(self):
        """The torch device the model runs on."""
        return self.engine.loaded.device

    @property
    def context_length(self) -> int:
        """The model's own context length (``max_model_len`` above it runs capped to it)."""
        return self.engine.loaded.max_model_len

    @property
    def vocab_size(self) -> int:
        """The number of token ids the model takes and scores."""
        return self.engine.vocab_size

    @property
    def kv_blocks(self) -> tuple[int, int]:
        """(blocks in use, blocks in the pool) of the KV cache, now."""
        return self.engine.pool.num_used, self.engine.pool.num_blocks

    def started_requests(self) -> list[StartedRequest]:
        """The unfinished requests admitted so far, longest running first (what a stop interrupts)."""
        return self.engine.started_requests()

    def system_fingerprint(self, adapter: str | None = None) -> str:
        """What decides this LLM's outputs, as one hash (docs/reproducibility.md): the base model's, or
        with a loaded adapter's files."""
        return self.engine.system_fingerprint(adapter)

    def add_lora(self, request: LoRARequest) -> None:
        """Read and check an adapter now, against the model and ``max_lora_rank`` (else it is read
        when a request first names it); requests may then name it by ``request.lora_name``."""
        self.engine.add_lora(request)

    def enable_trace(self) -> None:
        """Record every engine step's pool and block tables from now on (`trace`)."""
        self.engine.enable_trace()

    def trace(self) -> dict:
        """The steps recorded since `enable_trace`, with the pool's shape: ``block_size``,
        ``num_blocks`` and ``steps`` (what ``pagedinfer blocks`` draws)."""
        pool = self.engine.pool
        return {
            "block_size": pool.block_size,
            "num_blocks": pool.num_blocks,
            "steps": self.engine.trace or [],
        }

    def prepare(
        self,
        prompt: Prompt,
        params: SamplingParams | BeamSearchParams,
        request_id: str,
        lora: LoRARequest | str | None = None,
        interrupt: Callable[[], None] | None = None,
    ) -> EngineRequest | Rejected:
        """One request tokenized and checked against the model and the pool, once (`engine.intake`):
        what `loop`'s `GenerationLoop` runs as it is, or why it can never run. ``interrupt`` is called
        while a chat template renders (what it raises propagates)."""
        return self.engine.intake.prepare(prompt, params, request_id, lora, interrupt)

    def loop(
        self,
        before_step: Callable[[], None] | None = None,
        on_step: Callable[[LLMEngine], None] | None = None,
    ) -> GenerationLoop:
        """The generation loop of this LLM's engine (`engine.loop`): prepared requests in, outputs out."""
        return GenerationLoop(self.engine, before_step, on_step)

    def reset_prefix_cache(self) -> None:
        """Forget the cached prompt blocks of earlier calls (a benchmark's warm-up, say)."""
        self.engine.pool.reset_prefix_cache()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One `RequestOutput` per prompt, in input order.

        A prompt that cannot run (too long, invalid for the model, a tokenizer error, an adapter that
        does not fit) gets its ``error`` set; the others complete. ``lora_request``: one adapter for
        every prompt, or a list, one per prompt (None: the base model).
        """
        prompts = _as_prompts(prompts)
        if not hasattr(prompts, "__len__"):  # a generator: the results are indexed by input position
            prompts = list(prompts)
        results: list[RequestOutput | None] = [None] * len(prompts)
        outputs = self.generate_iter(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)
        for index, output in outputs:
            results[index] = output
        return results  # type: ignore[return-value]

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """vLLM's name: answer one conversation (a list of ``{"role", "content"}`` messages) or a list
        of them, each rendered with the tokenizer's chat template (generation prompt added) and run
        as a ``{"messages": ...}`` prompt of `generate` (a chat line of ``pagedinfer run``)."""
        if not isinstance(messages, (list, tuple)):  # iterated, None or a string would fail obscurely
            raise TypeError(
                "messages must be a conversation (a list of {'role': ..., 'content': ...} dicts) or a list "
                f"of them, not {type(messages).__name__}"
            )
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([{"messages": list(m)} for m in conversations], sampling_params, use_tqdm)

    def beam_search(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: BeamSearchParams | Sequence[BeamSearchParams],
        use_tqdm: bool = True,
    ) -> list[BeamSearchOutput]:
        """``beam_width`` beams per prompt, best first, inside the engine: the beams of a prompt share
        their blocks (a surviving beam's children fork its block table, a pruned beam frees its
        blocks at once). Equals transformers ``generate(num_beams=beam_width, do_sample=False,
        num_return_sequences=beam_width, length_penalty=..., early_stopping=...)``.
        """
        return self.generate(prompts, params, use_tqdm=use_tqdm)  # type: ignore[arg-type, return-value]

    def generate_iter(
        self,
        prompts: Prompt | Iterable[Prompt],
        sampling_params: SamplingParams
        | BeamSearchParams
        | Iterable[SamplingParams | BeamSearchParams]
        | None = None,
        use_tqdm: bool = False,
        request_ids: Iterable[str] | None = None,
        on_step: Callable[[LLMEngine], None] | None = None,
        lora_request: LoRARequest | Iterable[LoRARequest | None] | None = None,
    ) -> Iterator[tuple[int, RequestOutput]]:
        """Yield ``(input index, output)`` as each request finishes.

        ``prompts`` (and per-prompt ``sampling_params`` / ``request_ids``) may be any iterables, even
        generators: they are read lazily (see `stream`). A prompt given `BeamSearchParams` yields a
        `BeamSearchOutput`, the others a `RequestOutput`. ``on_step`` is called after every engine
        step (live progress: ``engine.pool.num_used``...).
        """
        prompts = _as_prompts(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, (SamplingParams, BeamSearchParams)):
            sampling_params = itertools.repeat(sampling_params)
        elif isinstance(sampling_params, (dict, str)):  # iterated, a dict would give its keys as params
            raise TypeError(
                f"sampling_params must be a SamplingParams (or BeamSearchParams) or a list of them, not a "
                f"{type(sampling_params).__name__} (SamplingParams(**fields) builds one from a dict)"
            )
        elif (
            hasattr(sampling_params, "__len__")
            and hasattr(prompts, "__len__")
            and len(sampling_params) != len(prompts)
        ):
            raise ValueError(f"got {len(prompts)} prompts but {len(sampling_params)} sampling_params")
        ids = itertools.repeat(None) if request_ids is None else request_ids
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_request = itertools.repeat(lora_request)
        requests = _zip_requests(prompts, sampling_params, ids, lora_request)
        total = len(prompts) if hasattr(prompts, "__len__") else None
        bar = tqdm(total=total, desc="requests", unit="req", disable=not use_tqdm)

        def progress(engine: LLMEngine) -> None:
            bar.set_postfix_str(f"KV {engine.pool.num_used}/{engine.pool.num_blocks} blocks", refresh=False)
            if on_step is not None:
                on_step(engine)

        try:
            for index, output in self.stream(requests, on_step=progress if use_tqdm else on_step):
                bar.update(1)
                yield index, output
        finally:
            bar.close()

    def stream(
        self,
        requests: Iterable[
            tuple[Prompt, SamplingParams | BeamSearchParams, str | None]
            | tuple[Prompt, SamplingParams | BeamSearchParams, str | None, LoRARequest | str | None]
        ],
        on_step: Callable[[LLMEngine], None] | None = None,
        before_step: Callable[[], None] | None = None,
        max_pending: int | None = None,
    ) -> Iterator[tuple[int, RequestOutput | BeamSearchOutput]]:
        """Run ``(prompt, params, request id)`` triples (or with a fourth: the adapter, a `LoRARequest` or a
        loaded adapter's name), read lazily; yield ``(index, output)`` as each finishes.

        Each request is prepared (tokenized and checked, ``engine.intake.prepare``) only when the engine
        has room: at most ``max_pending`` unfinished requests are in the engine at once (default:
        twice ``max_num_seqs``, enough to keep every batch full), so memory does not grow with the
        number of requests; a request is released once yielded. One that cannot run (too long,
        invalid for the model, a tokenizer error) is yielded at once with ``error`` set; the others go
        on (`engine.loop.GenerationLoop`). ``before_step`` runs before every engine step (the CLI
        makes the lines it wrote durable there), ``on_step`` after it.
        """
        feed = (
            (index, self.prepare(r[0], r[1], str(index) if r[2] is None else r[2], *r[3:]))
            for index, r in enumerate(requests)
        )
        yield from self.loop(before_step, on_step).stream(feed, max_pending)


def _as_prompts(prompts: object) -> Iterable:
    """One prompt as a list of one, or the prompts as given; anything else is a TypeError that says
    what prompts are, raised before anything runs (``len(None)`` would name neither)."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Iterable):
        raise TypeError(
            "prompts must be a prompt (a string, or a dict with 'prompt', 'prompt_token_ids' or "
            f"'messages') or a list of them, not {type(prompts).__name__}"
        )
    return prompts


def _zip_requests(prompts: Iterable, params: Iterable, ids: Iterable, loras: Iterable) -> Iterator[tuple]:
    """(prompt, params, id, adapter) tuples; an error if the others run out before ``prompts``."""
    params, ids, loras = iter(params), iter(ids), iter(loras)
    for count, prompt in enumerate(prompts):
        p, rid, lora = next(params, _END), next(ids, _END), next(loras, _END)
        if p is _END or rid is _END or lora is _END:
            what = "sampling_params" if p is _END else "request_ids" if rid is _END else "lora_request"
            raise ValueError(f"more prompts than {what} (only {count})")
        yield prompt, p, rid, lora


_END = object()


def _signature() -> inspect.Signature:
    """``LLM(model=None, *, ...)``: every setting, as declared (`config.llm_settings`)."""
    model, *options = llm_settings()
    positional, keyword = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY
    return inspect.Signature(
        [
            inspect.Parameter("self", positional),
            inspect.Parameter(model.name, positional, default=model.default, annotation=model.type),
            *[inspect.Parameter(s.name, keyword, default=s.default, annotation=s.type) for s in options],
        ],
        return_annotation=None,
    )


LLM.__init__.__signature__ = _signature()
