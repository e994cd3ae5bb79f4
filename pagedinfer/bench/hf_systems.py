"""The transformers baselines: ``model.generate`` on padded batches, and continuous batching."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from pagedinfer.bench.job import Job, RunResult, SystemUnavailable


def _load(job: Job):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = getattr(torch, job.dtype)
    if job.load_format == "dummy":  # the same random weights pagedinfer draws (same seed and device)
        from pagedinfer.model.random_models import random_model

        config = AutoConfig.from_pretrained(job.model_dir)
        return random_model(config, 0, dtype, torch.device(job.device)).eval()
    return AutoModelForCausalLM.from_pretrained(job.model_dir, dtype=dtype).to(job.device).eval()


def _generation_config(job: Job, **kw):
    from transformers import GenerationConfig

    if job.beam is not None:
        mode = dict(
            do_sample=False,
            num_beams=job.beam.width,
            num_return_sequences=job.beam.width,
            length_penalty=job.beam.length_penalty,
            early_stopping=job.beam.early_stopping,
        )
    elif job.temperature > 0:
        mode = dict(
            do_sample=True, temperature=job.temperature, top_k=0, top_p=1.0, num_return_sequences=job.n
        )
    else:
        mode = dict(do_sample=False, num_return_sequences=job.n)
    return GenerationConfig(**mode, eos_token_id=None, pad_token_id=0, bos_token_id=None, **kw)


def _cache_bytes(cache) -> int:
    layers = getattr(cache, "layers", None) or []
    return sum(
        layer.keys.nbytes + layer.values.nbytes
        for layer in layers
        if getattr(layer, "keys", None) is not None
    )


class HFGenerateSystem:
    """``model.generate`` (default SDPA attention, a ``DynamicCache``, never stopping early) on
    left-padded batches of prompts sorted by length; a batch runs to its largest ``max_tokens`` and
    only each prompt's own ``max_tokens`` count as output. Beam search: ``num_beams`` =
    ``num_return_sequences`` = the width."""

    def __init__(self, job: Job) -> None:
        import torch

        self.job = job
        self.model = _load(job)
        cfg = self.model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        itemsize = torch.empty(0, dtype=self.model.dtype).element_size()
        self.per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * itemsize
        prompts = job.prompts
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        self.size = job.hf_batch_size or len(prompts)
        self.batches = [order[i : i + self.size] for i in range(0, len(order), self.size)]
        self._generate([0], 2, 0)  # warm-up

    def _generate(self, idx: list[int], new: int, seed: int, stopping_criteria=None):
        import torch

        prompts, rows = self.job.prompts, self.job.n
        width = max(len(prompts[i]) for i in idx)
        ids = torch.zeros(len(idx), width, dtype=torch.long)  # [B, width], left-padded
        mask = torch.zeros(len(idx), width, dtype=torch.long)  # [B, width]
        for row, i in enumerate(idx):
            ids[row, width - len(prompts[i]) :] = torch.tensor(prompts[i])
            mask[row, width - len(prompts[i]) :] = 1
        torch.manual_seed(seed)
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids.to(self.model.device),
                attention_mask=mask.to(self.model.device),
                stopping_criteria=stopping_criteria,
                generation_config=_generation_config(
                    self.job,
                    max_new_tokens=new,
                    return_dict_in_generate=True,
                    output_scores=self.job.beam is not None,
                ),
            )
        seqs = out.sequences[:, width:]  # [B * rows, new]
        cache = getattr(out, "cache", None) or out.past_key_values
        kv = _cache_bytes(cache) or len(idx) * rows * (width + new - 1) * self.per_token
        scores = out.sequences_scores.tolist() if self.job.beam is not None else None  # [B * rows]
        return seqs, scores, kv

    def run(self) -> RunResult:
        max_tokens, rows = self.job.max_tokens, self.job.n
        outputs: list = [None] * len(max_tokens)
        beam_scores: list = [None] * len(max_tokens)
        peak_kv = computed = 0
        for b, idx in enumerate(self.batches):
            seqs, scores, kv = self._generate(idx, max(max_tokens[i] for i in idx), self.job.seed + b)
            peak_kv = max(peak_kv, kv)
            computed += seqs.numel()
            for row, i in enumerate(idx):
                outputs[i] = [seqs[row * rows + j, : max_tokens[i]].tolist() for j in range(rows)]
                if scores is not None:
                    beam_scores[i] = scores[row * rows : (row + 1) * rows]
        return RunResult(
            outputs=outputs,
            peak_kv_bytes=peak_kv,
            scores=beam_scores if self.job.beam is not None else None,
            details={
                "generated_incl_discarded": computed,
                "forward_passes": sum(max(max_tokens[i] for i in idx) for idx in self.batches),
            },
        )

    def profile(self) -> dict:
        """The time split of a few decode steps of the first batch (an untimed run, stopped after)."""
        from transformers import StoppingCriteria, StoppingCriteriaList

        from pagedinfer.bench.gpu import PROFILE_STEPS, profiled_split

        class EveryStep(StoppingCriteria):  # called once per generated token; never stops generate itself
            def __init__(self, step) -> None:
                self.step = step

            def __call__(self, input_ids, scores, **kwargs):
                import torch

                self.step()
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        idx = self.batches[0]
        new = max(self.job.max_tokens[i] for i in idx)

        def run(step) -> None:
            self._generate(idx, new, self.job.seed, StoppingCriteriaList([EveryStep(step)]))

        return profiled_split(run, self.job.device, min(8, max(1, new // 2)), PROFILE_STEPS)

    def info(self) -> dict:
        return {
            "kv_note": "largest batch's DynamicCache tensors at the end of generate",
            "batches": [len(b) for b in self.batches],
            "batching": f"{len(self.batches)} left-padded batch(es) of <= {self.size} prompts sorted by "
            "length, each run to its largest max_tokens; only each prompt's own max_tokens counted",
            "attn_implementation": self.model.config._attn_implementation,
        }


@contextmanager
def recording_pools(pools: list[dict]) -> Iterator[None]:
    """Record every ``PagedAttentionCache`` transformers allocates inside the block (the pool it
    really uses, which ``generate_batch`` does not return); the class is restored on the way out."""
    from transformers.generation.continuous_batching import cache as cb_cache

    cls = cb_cache.PagedAttentionCache
    original_init = cls.__init__

    def recording_init(cache, *args, **kwargs):
        original_init(cache, *args, **kwargs)
        pools.append(
            {
                "cache_tensor_bytes": cache.cache_tensor.nbytes,
                "num_blocks": cache.num_blocks,
                "max_batch_tokens": cache.max_batch_tokens,
            }
        )

    cls.__init__ = recording_init
    try:
        yield
    finally:
        cls.__init__ = original_init


class HFGenerateBatchSystem:
    """transformers continuous batching with the same block size, pool and token budget as
    pagedinfer: ``model.generate_batch`` when every prompt has the same ``max_tokens``, else the same
    manager driven through ``continuous_batching_context_manager`` + ``add_request``."""

    def __init__(self, job: Job) -> None:
        try:
            from transformers.generation.configuration_utils import ContinuousBatchingConfig
        except ImportError:
            raise SystemUnavailable(
                "this transformers has no ContinuousBatchingConfig (transformers 5 has)"
            ) from None

        if job.beam is not None:
            raise SystemUnavailable("transformers' continuous batching has no beam search")
        self.job = job
        self.model = _load(job)
        self.cb_config = ContinuousBatchingConfig(
            page_size=job.block_size,
            num_blocks=job.num_blocks,
            max_batch_tokens=job.max_num_batched_tokens,
            max_requests_per_batch=job.hf_cb_max_requests or job.max_num_seqs,
            seed=job.seed,
        )
        self.uniform = len(set(job.max_tokens)) == 1
        self.pools: list[dict] = []
        with recording_pools(self.pools):  # warm-up
            self._generate(job.prompts[:2], [4] * min(2, len(job.prompts)))

    def _generate(self, inputs, limits: list[int]) -> list[list[list[int]]]:
        from transformers.generation.continuous_batching.utils import WorkloadHints

        n = self.job.n
        inputs = [list(p) for p in inputs]
        if len(set(limits)) == 1:
            res = self.model.generate_batch(
                inputs,
                generation_config=_generation_config(self.job, max_new_tokens=limits[0]),
                continuous_batching_config=self.cb_config,
            )
            flat = [r.generated_tokens for r in res.values()]  # n per prompt, in input order
            if len(flat) != len(inputs) * n:
                raise RuntimeError(f"generate_batch returned {len(flat)} of {len(inputs) * n} sequences")
            return [flat[i * n : (i + 1) * n] for i in range(len(inputs))]
        hints = WorkloadHints(
            max_prompt_length=max(map(len, inputs)),
            max_generated_length=max(limits),
            num_requests=len(inputs) * n,
        )
        results: dict[str, list] = {}
        with self.model.continuous_batching_context_manager(
            generation_config=_generation_config(self.job, max_new_tokens=max(limits)),
            continuous_batching_config=self.cb_config,
            block=True,
            timeout=5,
            workload_hints=hints,
        ) as manager:
            for i, (ids, m) in enumerate(zip(inputs, limits, strict=True)):
                manager.add_request(ids, request_id=f"p{i}", max_new_tokens=m, eos_token_id=-1)
            done = 0
            while done < len(inputs) * n:
                r = manager.get_result(timeout=1)
                if r is None:
                    if not manager.is_running():
                        raise RuntimeError("the continuous batching thread stopped early")
                    continue
                if r.is_finished():
                    results.setdefault(r.request_id.split("__child#")[0], []).append(r.generated_tokens)
                    done += 1
        return [results[f"p{i}"] for i in range(len(inputs))]

    def profile(self) -> dict:
        return {"error": "not profiled: continuous batching steps in its own thread, without a per-step hook"}

    def run(self) -> RunResult:
        self.pools.clear()
        with recording_pools(self.pools):
            outputs = self._generate(self.job.prompts, list(self.job.max_tokens))
        pool = self.pools[-1] if self.pools else {}
        size = pool.get("cache_tensor_bytes", 0)
        return RunResult(outputs=outputs, peak_kv_bytes=size, details={"kv_pool_bytes": size, "pool": pool})

    def info(self) -> dict:
        c = self.cb_config
        return {
            "kv_note": "its preallocated pool (the cache tensor, with its 2 trash sectors)",
            "api": "model.generate_batch"
            if self.uniform
            else "continuous_batching_context_manager + add_request(max_new_tokens=per prompt)",
            "config": {
                "page_size": c.page_size,
                "num_blocks": c.num_blocks,
                "max_batch_tokens": c.max_batch_tokens,
                "max_requests_per_batch": c.max_requests_per_batch,
            },
            "attn_implementation": self.model.config._attn_implementation,
        }
