"""The offline Python API in the shape vLLM users know: ``LLM(model).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

from tqdm.auto import tqdm

from pagedinfer.config import EngineConfig
from pagedinfer.engine.llm_engine import LLMEngine
from pagedinfer.engine.stats import EngineStats
from pagedinfer.model.loader import load_model
from pagedinfer.outputs import BeamSearchOutput, RequestOutput
from pagedinfer.sampling_params import BeamSearchParams, SamplingParams

Prompt = str | dict


class LLM:
    """Load a model and its KV pool once; generate for any number of prompt batches.

    ``model``: a local Hugging Face model directory or a hub id (default: the embedded demo model).
    The pool holds ``num_blocks`` blocks of ``block_size`` tokens, or as many as fit in
    ``kv_cache_memory`` bytes (``'512MiB'`` works too), or a default (2 GiB on the CPU, 85% of free
    GPU memory), never more than ``max_num_seqs`` sequences of ``max_model_len`` tokens can use.
    ``enable_prefix_caching``: prompts that start with the same full blocks of tokens reuse their
    K/V across requests (and across ``generate`` calls) instead of computing them again.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        block_size: int = EngineConfig.block_size,
        num_blocks: int | None = None,
        kv_cache_memory: int | str | None = None,
        max_num_seqs: int = EngineConfig.max_num_seqs,
        max_num_batched_tokens: int = EngineConfig.max_num_batched_tokens,
        max_model_len: int | None = None,
        device: str = "auto",
        dtype: str = "auto",
        seed: int = EngineConfig.seed,
        use_cuda_kernels: bool | None = None,
        enable_prefix_caching: bool = True,
    ) -> None:
        config = EngineConfig(
            block_size=block_size,
            num_blocks=num_blocks,
            kv_cache_memory=kv_cache_memory,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            seed=seed,
            enable_prefix_caching=enable_prefix_caching,
        )
        loaded = load_model(model, device=device, dtype=dtype)
        self.engine = LLMEngine(loaded, config, use_cuda_kernels=use_cuda_kernels)

    @property
    def tokenizer(self):
        return self.engine.loaded.tokenizer

    @property
    def stats(self) -> EngineStats:
        """Memory and scheduling statistics of the last ``generate`` call."""
        return self.engine.stats

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One `RequestOutput` per prompt, in input order."""
        results: list[RequestOutput | None] = [None] * (
            1 if isinstance(prompts, (str, dict)) else len(prompts)
        )
        for index, output in self.generate_iter(prompts, sampling_params, use_tqdm=use_tqdm):
            results[index] = output
        return results  # type: ignore[return-value]

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
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams
        | BeamSearchParams
        | Sequence[SamplingParams | BeamSearchParams]
        | None = None,
        use_tqdm: bool = False,
        request_ids: Sequence[str] | None = None,
        on_step: Callable[[LLMEngine], None] | None = None,
    ) -> Iterator[tuple[int, RequestOutput]]:
        """Yield ``(input index, output)`` as each request finishes (failed ones first).

        A prompt given `BeamSearchParams` yields a `BeamSearchOutput`, the others a `RequestOutput`.

        ``on_step`` is called after every engine step (live progress: ``engine.pool.num_used``...).
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, (SamplingParams, BeamSearchParams)):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(sampling_params)} sampling_params")
        engine = self.engine
        engine.reset_stats()
        start = time.perf_counter()
        requests = []
        for i, (prompt, params) in enumerate(zip(prompts, sampling_params, strict=True)):
            rid = request_ids[i] if request_ids is not None else None
            requests.append(engine.add_request(prompt, params, request_id=rid, order=i))
        bar = tqdm(
            total=sum(r.params.n for r in requests), desc="completions", unit="seq", disable=not use_tqdm
        )
        try:
            for req in requests:
                if req.error:
                    bar.update(req.params.n)
                    yield req.order, engine.output(req)
            while engine.has_unfinished:
                done = engine.step()
                engine.stats.wall_time_s = time.perf_counter() - start
                if on_step is not None:
                    on_step(engine)
                if use_tqdm:
                    bar.set_postfix_str(
                        f"KV {engine.pool.num_used}/{engine.pool.num_blocks} blocks", refresh=False
                    )
                for req in done:
                    bar.update(req.params.n)
                    yield req.order, engine.output(req)
        finally:
            bar.close()
            engine.stats.wall_time_s = time.perf_counter() - start
            engine.abort_all()  # a caller that stops early (Ctrl-C) leaves no blocks behind
