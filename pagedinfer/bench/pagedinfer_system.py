"""The system under test: ``LLM(...).generate`` (or ``LLM.beam_search``) on the job's prompts."""

from __future__ import annotations

from pagedinfer.bench.job import Job, RunResult, SystemUnavailable

# figures read from ``llm.stats`` after the timed run (absent ones, from an older engine, are skipped)
STAT_FIELDS = (
    "steps",
    "peak_blocks_used",
    "bytes_per_block",
    "preemptions",
    "prompt_tokens_requested",
    "prompt_tokens_computed",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "graph_steps",
)


class PagedinferSystem:
    def __init__(self, job: Job) -> None:
        from pagedinfer import LLM

        self.job = job
        extra = {} if job.prefix_caching is None else {"enable_prefix_caching": job.prefix_caching}
        try:
            self.llm = LLM(
                job.model_dir,
                block_size=job.block_size,
                num_blocks=job.num_blocks,
                max_num_seqs=job.max_num_seqs,
                max_num_batched_tokens=job.max_num_batched_tokens,
                max_model_len=job.max_model_len,
                device=job.device,
                dtype=job.dtype,
                load_format=job.load_format,
                **extra,
            )
        except TypeError as e:
            if "enable_prefix_caching" not in str(e):
                raise
            raise SystemUnavailable(
                "this pagedinfer has no prefix caching (LLM(enable_prefix_caching=...) is refused)"
            ) from None
        self.prompts = [{"prompt_token_ids": list(p)} for p in job.prompts]
        self._call(self.prompts[:2], [4] * min(2, len(self.prompts)))  # warm-up

    def _call(self, prompts: list[dict], max_tokens: list[int]) -> tuple[list, list | None]:
        """Token ids per prompt per completion (or beam), and the beams' scores."""
        job = self.job
        if job.beam is not None:
            try:
                from pagedinfer import BeamSearchParams
            except ImportError:
                raise SystemUnavailable(
                    "this pagedinfer has no beam search (`from pagedinfer import BeamSearchParams` fails)"
                ) from None
            if len(set(max_tokens)) != 1:
                raise ValueError("beam search workloads take one max_tokens for every prompt")
            params = BeamSearchParams(
                beam_width=job.beam.width,
                max_tokens=max_tokens[0],
                length_penalty=job.beam.length_penalty,
                early_stopping=job.beam.early_stopping,
            )
            outs = self.llm.beam_search(prompts, params)
            tokens = [[list(s.token_ids) for s in o.sequences] for o in outs]
            return tokens, [[float(s.score) for s in o.sequences] for o in outs]
        outs = self.llm.generate(prompts, self._params(max_tokens), use_tqdm=False)
        return [[list(c.token_ids) for c in o.outputs] for o in outs], None

    def _params(self, max_tokens: list[int]) -> list:
        from pagedinfer import SamplingParams

        job = self.job
        return [
            SamplingParams(n=job.n, temperature=job.temperature, max_tokens=m, ignore_eos=True, seed=job.seed)
            for m in max_tokens
        ]

    def profile(self) -> dict:
        """The time split of a few engine steps once the first wave of prompts is prefilled (an
        untimed second run, stopped after the window)."""
        from pagedinfer.bench.gpu import PROFILE_STEPS, profiled_split

        job = self.job
        wave = job.prompts[: max(1, job.max_num_seqs // job.n)]  # the prompts running at first
        wait = -(-sum(map(len, wave)) // job.max_num_batched_tokens) + 4  # their prefill steps, and a few
        wait = min(wait, max(1, min(job.max_tokens) // 2))

        def run(step) -> None:
            params = self._params(list(job.max_tokens))
            for _ in self.llm.generate_iter(self.prompts, params, on_step=lambda engine: step()):
                pass

        return profiled_split(run, job.device, wait, PROFILE_STEPS)

    def run(self) -> RunResult:
        if hasattr(self.llm, "reset_prefix_cache"):
            self.llm.reset_prefix_cache()  # no hits from the warm-up or an earlier repeat
        tokens, scores = self._call(self.prompts, list(self.job.max_tokens))
        stats = self.llm.stats
        figures = {k: getattr(stats, k) for k in STAT_FIELDS if hasattr(stats, k)}
        full = stats.to_dict()
        full.get("usage", {}).pop("blocks_used_per_step", None)
        return RunResult(
            outputs=tokens,
            peak_kv_bytes=stats.peak_blocks_used * stats.bytes_per_block,
            scores=scores,
            details={
                "stats": figures,
                "stats_full": full,
                "kv_pool_bytes": stats.num_blocks * stats.bytes_per_block,
                "forward_passes": stats.steps,
            },
        )

    def info(self) -> dict:
        return {
            "cuda_graphs": self.llm.stats.cuda_graphs,
            "graph_capture_s": self.llm.stats.graph_capture_s,
            "kv_note": "peak blocks used x bytes per block",
            "prefix_caching": "engine default"
            if self.job.prefix_caching is None
            else self.job.prefix_caching,
        }
