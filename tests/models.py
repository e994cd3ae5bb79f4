"""Tiny random-weight models of many families, saved with save_pretrained so the real loading code runs."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers as tf

from pagedinfer.model.random_models import save_random_model

COMMON = dict(vocab_size=256, bos_token_id=None, eos_token_id=None, pad_token_id=0, tie_word_embeddings=False)
DECODER = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.2,  # sharp logits: greedy choices never hinge on float noise
)
LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0, 1.1, 1.2, 1.4, 1.6, 2.0, 2.5, 3.0],
    "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0],
}
D64 = {**DECODER, "hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1}


def _gemma3_scaled(global_layer: int, query_pre_attn_scalar: int) -> tf.Gemma3TextConfig:
    """A 4-layer Gemma 3 with a window of 8 on every layer but ``global_layer``, linear RoPE scaling on
    that one, a logit softcap and the given query scalar."""
    return tf.Gemma3TextConfig(
        **COMMON,
        **{**DECODER, "num_hidden_layers": 4},
        head_dim=16,
        sliding_window=8,
        layer_types=["full_attention" if i == global_layer else "sliding_attention" for i in range(4)],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        },
        query_pre_attn_scalar=query_pre_attn_scalar,
        final_logit_softcapping=3.0,
    )


CONFIGS = {
    "llama": lambda: tf.LlamaConfig(**COMMON, **DECODER),
    "qwen2": lambda: tf.Qwen2Config(**COMMON, **DECODER),
    "qwen3": lambda: tf.Qwen3Config(**COMMON, **DECODER, head_dim=16),
    "mistral": lambda: tf.MistralConfig(**COMMON, **DECODER, sliding_window=8),
    # Mistral's layer with a window per layer type: no family of ours (tests/test_families.py declares one)
    "ministral": lambda: tf.MinistralConfig(**COMMON, **DECODER, head_dim=16, sliding_window=8),
    "gemma2": lambda: tf.Gemma2Config(
        **COMMON,
        **DECODER,
        head_dim=16,
        sliding_window=8,
        query_pre_attn_scalar=16,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=10.0,
    ),
    "phi3": lambda: tf.Phi3Config(**COMMON, **DECODER),
    "phi3_window": lambda: tf.Phi3Config(**COMMON, **DECODER, sliding_window=8),  # (Phi-3-mini-4k's: 2047)
    # LongRoPE over every position our layers serve (short factors); "_switch": long factors past 12
    "phi3_longrope": lambda: tf.Phi3Config(**COMMON, **DECODER, rope_scaling=LONGROPE),
    "phi3_longrope_switch": lambda: tf.Phi3Config(
        **COMMON, **DECODER, rope_scaling=LONGROPE, original_max_position_embeddings=12
    ),
    "olmo2": lambda: tf.Olmo2Config(**COMMON, **DECODER),
    # Granite's four multipliers away from 1 (its defaults), so a layer that skipped one would differ
    "granite": lambda: tf.GraniteConfig(
        **COMMON,
        **DECODER,
        embedding_multiplier=3.0,
        attention_multiplier=0.3,
        residual_multiplier=0.45,
        logits_scaling=2.5,
    ),
    # Qwen2's window on the layers from max_window_layers on (layer 1): two layer groups on our own layers
    "qwen2_window": lambda: tf.Qwen2Config(
        **COMMON, **DECODER, use_sliding_window=True, sliding_window=8, max_window_layers=1
    ),
    # a window of 16 on 3 of its 4 layers (Gemma 3's pattern, shortened), 512 positions: long windowed runs
    "gemma3_text": lambda: tf.Gemma3TextConfig(
        **COMMON,
        **{**DECODER, "num_hidden_layers": 4, "max_position_embeddings": 512},
        head_dim=16,
        sliding_window=16,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
    ),
    # Gemma 3's traits away from their neutral values: linear RoPE scaling on the global layer, a
    # query_pre_attn_scalar other than head_dim, a logit softcap (its norms drawn: `DRAWN_NORMS`)
    "gemma3_scaled": lambda: _gemma3_scaled(global_layer=1, query_pre_attn_scalar=24),
    # Gemma 3 as llama.cpp's files can state it: query_pre_attn_scalar = head_dim (llama.cpp scales by
    # key_length), windowed layers by its pattern 3 (layer 2 global), linear RoPE scaling on the global
    # one, a softcap (its norms drawn wide: `DRAWN_NORMS`, multipliers 1 + weight on both sides of 0.5)
    "gemma3_gguf": lambda: _gemma3_scaled(global_layer=2, query_pre_attn_scalar=16),
    # head size 64: a shape the CUDA kernels serve (the others' 16 takes the torch path there)
    "llama_d64": lambda: tf.LlamaConfig(**COMMON, **D64),
    # the same with 1200 positions: a CUDA graph step's context bound spans 3 decode-kernel partitions
    "llama_d64_long": lambda: tf.LlamaConfig(**COMMON, **{**D64, "max_position_embeddings": 1200}),
    # the windowed Qwen2 at head size 64: layer groups on the CUDA kernels
    "qwen2_window_d64": lambda: tf.Qwen2Config(
        **COMMON, **D64, use_sliding_window=True, sliding_window=8, max_window_layers=1
    ),
    "gpt2": lambda: tf.GPT2Config(
        vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=256, bos_token_id=None, eos_token_id=None
    ),
    "opt": lambda: tf.OPTConfig(
        vocab_size=256,
        hidden_size=64,
        ffn_dim=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        word_embed_proj_dim=64,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=1,
        init_std=0.2,
    ),
    # mixtures of experts: 8 experts of 32 rows, 2 per token (8 x 256 in the GGUF-type tests' ``in``)
    "qwen3_moe": lambda: tf.Qwen3MoeConfig(
        **COMMON,
        **DECODER,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
    ),
    # a shared expert of 48 rows beside the routed ones; q, k and v biased; top-k not renormalised
    "qwen2_moe": lambda: tf.Qwen2MoeConfig(
        **COMMON,
        **DECODER,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
    ),
    "mixtral": lambda: tf.MixtralConfig(
        **COMMON, **{**DECODER, "intermediate_size": 32}, num_local_experts=8, num_experts_per_tok=2
    ),
    "olmoe": lambda: tf.OlmoeConfig(
        **COMMON, **{**DECODER, "intermediate_size": 32}, num_experts=8, num_experts_per_tok=2
    ),
    "gpt_oss": lambda: tf.GptOssConfig(
        **COMMON,
        **{**DECODER, "num_hidden_layers": 2},
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
    ),
}


# models whose norm weights are drawn as well (Gemma's multiply by 1 + weight; transformers sets 0)
DRAWN_NORMS = {"gemma3_scaled": 0.3, "gemma3_gguf": 0.6}


def save_model(family: str, root: Path, seed: int = 0) -> Path:
    """Build ``family`` with fixed random weights and save it (config, safetensors) under ``root``."""
    path = root / family
    if not (path / "config.json").exists():
        save_random_model(CONFIGS[family](), path, seed, norm_std=DRAWN_NORMS.get(family, 0.0))
    return path


def hf_greedy(path: Path, prompt: list[int], max_new_tokens: int, **processors) -> list[int]:
    """The reference: transformers' own ``generate`` with greedy decoding, one prompt at a time
    (``processors``: its logits processors' arguments, e.g. ``bad_words_ids``)."""
    return _generate_greedy(str(path), lambda: _hf_model(str(path)), prompt, max_new_tokens, **processors)


# greedy references by (model key, prompt, length, processors): the models behind a key are fixed for the
# session (`_HF_CACHE`), so each reference is generated once however many tests ask for it; processors
# given as functions are not memoized (their repr names an address a later function may reuse)
_GREEDY_CACHE: dict[tuple, list[int]] = {}


def _generate_greedy(key: str, model, prompt: list[int], max_new_tokens: int, **processors) -> list[int]:
    """``model().generate`` greedy on one prompt, EOS ignored: the new tokens (a fresh list)."""
    if any(callable(v) for v in processors.values()):
        return _generate(model(), prompt, max_new_tokens, **processors)
    memo = (key, tuple(prompt), max_new_tokens, repr(sorted(processors.items())))
    if memo not in _GREEDY_CACHE:
        _GREEDY_CACHE[memo] = _generate(model(), prompt, max_new_tokens, **processors)
    return list(_GREEDY_CACHE[memo])


def _generate(model, prompt: list[int], max_new_tokens: int, **processors) -> list[int]:
    ids = torch.tensor([prompt])  # [1, P]
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        **processors,
    )
    return out[0, len(prompt) :].tolist()


_HF_CACHE: dict[str, torch.nn.Module] = {}


def _hf_model(path: str) -> torch.nn.Module:
    if path not in _HF_CACHE:
        _HF_CACHE[path] = tf.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager"
        ).eval()
    return _HF_CACHE[path]


CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog.",
    "안녕하세요 반갑습니다. 오늘 날씨가 좋네요.",
    "emoji time 😀🎉 and more text to learn merges from.",
]


def save_text_model(root: Path, seed: int = 0, positions: int | None = None) -> Path:
    """A tiny Llama with a byte-level BPE tokenizer trained here (EOS is ``<eos>``); ``positions``: its
    context (default `DECODER`'s)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = root / ("text-llama" if positions is None else f"text-llama-{positions}")
    if (path / "config.json").exists():
        return path
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<pad>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")
    fast.save_pretrained(path)
    decoder = DECODER if positions is None else {**DECODER, "max_position_embeddings": positions}
    config = tf.LlamaConfig(
        **{**COMMON, "vocab_size": len(fast), "eos_token_id": fast.eos_token_id}, **decoder
    )
    save_random_model(config, path, seed)
    return path


def submit(engine, prompt, params, order: int | None = None):
    """Prepare ``prompt`` through intake (as every caller does) and queue it; returns the core Request."""
    order = engine.stats.requests if order is None else order
    return engine.add_request(engine.intake.prepare(prompt, params, str(order)), order)


ALL_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_lora(
    base: Path, root: Path, name: str, rank: int, seed: int, targets: list[str] | None = None, **config
) -> Path:
    """A random PEFT LoRA adapter of ``base`` (B nonzero: its delta matters), saved with save_pretrained."""
    from peft import LoraConfig, get_peft_model

    path = root / name
    if (path / "adapter_config.json").exists():
        return path
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    lora = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=targets or ALL_LINEARS,
        init_lora_weights=False,
        **config,
    )
    peft_model = get_peft_model(model, lora)
    with torch.no_grad():  # PEFT's random init is small next to these sharp bases: make the delta count
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.mul_(3.0)
    peft_model.save_pretrained(str(path))
    return path


def peft_greedy(base: Path, adapter: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The LoRA reference: PEFT's unmerged adapter on transformers' model, greedy ``generate``."""
    from peft import PeftModel

    key = f"{base}+{adapter}"

    def model() -> torch.nn.Module:
        if key not in _HF_CACHE:
            hf = tf.AutoModelForCausalLM.from_pretrained(
                str(base), dtype=torch.float32, attn_implementation="eager"
            )
            _HF_CACHE[key] = PeftModel.from_pretrained(hf, str(adapter)).eval()
        return _HF_CACHE[key]

    return _generate_greedy(key, model, prompt, max_new_tokens)


def count_one_call_steps(monkeypatch) -> list[int]:
    """Every linear packed in the panel kernel (however small), and a list that grows by one per
    one-call C decode step taken: the tests of quantized panels check the step really ran."""
    from pagedinfer.model import decode_step, packed_linear

    monkeypatch.setattr(packed_linear, "MIN_WEIGHTS", 0)  # the float32 run packs every linear too
    monkeypatch.setenv("PAGEDINFER_CPU_GEMM", "panels")
    steps: list[int] = []
    real = decode_step.DecodeStep.run
    monkeypatch.setattr(decode_step.DecodeStep, "run", lambda self, *a: steps.append(1) or real(self, *a))
    return steps


def step_and_layer_path_agree(
    monkeypatch, steps: list[int], make_llm, prompt_ids: list[list[int]], max_tokens: int
):
    """Seeded n=3 sampling with logprobs through ``make_llm()``'s engine: tokens and log-probabilities
    exactly equal with the one-call C decode step (``steps``, from `count_one_call_steps`: it must run)
    and layer by layer (``PAGEDINFER_DECODE_STEP=0``: it must not)."""
    from pagedinfer import SamplingParams

    params = SamplingParams(n=3, temperature=0.9, max_tokens=max_tokens, seed=11, logprobs=2, ignore_eos=True)

    def run():
        outs = make_llm().generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
        return [
            [(c.token_ids, [{t: lp.logprob for t, lp in d.items()} for d in c.logprobs]) for c in o.outputs]
            for o in outs
        ]

    with_step = run()
    assert steps
    steps.clear()
    monkeypatch.setenv("PAGEDINFER_DECODE_STEP", "0")
    assert run() == with_step
    assert not steps


def refused_then_run(run, step, residual, ropes, meta, bad: list, refusals: list[str]):
    """The C decode step ``run`` (``DecodeStep.run`` itself) of ``step``, first on each metadata of
    ``bad``: each refused before any layer (`IndexOutOfRange`, its message appended to ``refusals``),
    the pool's K bit for bit as it was (unwritten slots may hold NaNs: bits, not values, compared);
    then on ``meta`` as given, its result returned. A probe wrapped around ``DecodeStep.run``."""
    import pytest

    from pagedinfer.kernels.abi import IndexOutOfRange

    before = [step.kv.k[i].view(torch.int32).clone() for i in step.kv.k]
    for wrong in bad:
        with pytest.raises(IndexOutOfRange) as refused:
            run(step, residual.clone(), ropes, wrong)
        refusals.append(str(refused.value))
    assert all(torch.equal(a, step.kv.k[i].view(torch.int32)) for a, i in zip(before, step.kv.k, strict=True))
    return run(step, residual, ropes, meta)
