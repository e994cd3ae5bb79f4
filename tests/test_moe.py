"""Mixture-of-experts families on our own layers (qwen3_moe, qwen2_moe with its shared expert,
mixtral, olmoe, gpt_oss with its sinks, biases, stacked experts and clamped SwiGLU; qwen3_moe's and
qwen2_moe's dense layers among the sparse ones): greedy-identical to transformers, with and without
preemption; every weight type the dense layers take (float32, bfloat16, int8 / int4 panels, GGUF
blocks as stored, llama.cpp's 3-D expert tensors split per expert, gpt-oss's MXFP4 experts as
stored); a row's output the same bits whatever rows share its step; decode steps in the one-call C
step (gpt_oss's, with its sinks, layer by layer) with the bits of the layer-by-layer path."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import pytest
import torch
import transformers as tf
from conftest import ENGINE
from gguf_models import save_gguf
from models import (
    COMMON,
    CONFIGS,
    _hf_model,
    count_one_call_steps,
    hf_greedy,
    peft_greedy,
    save_lora,
    step_and_layer_path_agree,
)
from safetensors.torch import load_file, save_file
from test_quantization import dequantized_copy, dequantized_weight

from pagedinfer import LLM, SamplingParams
from pagedinfer.engine.row_cost import Probe
from pagedinfer.model import families, fused_ops, gguf, llama, moe, moe_kernel, packed_linear
from pagedinfer.model.loader import ModelLoadError
from pagedinfer.model.random_models import save_random_model

GGUF_MOE = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"]  # the families whose GGUF files our layers read
MOE = [*GGUF_MOE, "gpt_oss"]
LENGTHS = (1, 9, 23, 30)  # within a block of 4, and across several
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(2, 256) for _ in range(n)] for n in LENGTHS]


@functools.cache
def reference(path: Path, prompt: tuple[int, ...]) -> list[int]:
    """transformers' greedy tokens (each pool size's run compares with the same)."""
    return hf_greedy(path, list(prompt), MAX_TOKENS)


def greedy(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("name", MOE)
@pytest.mark.parametrize("num_blocks", [256, 12], ids=["roomy-pool", "preempting-pool"])
def test_greedy_matches_transformers(tiny_model, prompts, monkeypatch, name, num_blocks):
    """Our layers by the family's declaration, token-identical to transformers' generate, decode steps
    through the one-call C step (gpt_oss's layer by layer: the step has no sinks); a pool of 12 blocks
    (48 slots for 4 sequences of up to 40 tokens) preempts."""
    path = tiny_model(name)
    steps = count_one_call_steps(monkeypatch)
    llm = LLM(str(path), block_size=4, num_blocks=num_blocks, **ENGINE)
    assert llm.engine.loaded.impl == "pagedinfer" and llm.engine.loaded.model.family.name == name
    assert isinstance(llm.engine.loaded.model.layers[0].mlp, moe.ExpertMLP)
    got = greedy(llm, prompts)
    for prompt, tokens in zip(prompts, got, strict=True):
        assert tokens == reference(path, tuple(prompt)), f"prompt of {len(prompt)}"
    assert (llm.stats.preemptions > 0) == (num_blocks == 12)
    assert bool(steps) == (name != "gpt_oss") and llm.engine.pool.num_used == 0


def test_olmoe_clips_q_k_and_v_where_its_config_says(model_root, prompts):
    """OLMoE's clip_qkv (0.5, below most normed q and k values here) clamps q, k and v after the q/k
    norms, before RoPE, as transformers does: greedy-identical to its generate."""
    path = model_root / "olmoe-clipped"
    if not (path / "config.json").exists():
        save_random_model(tf.OlmoeConfig(**{**CONFIGS["olmoe"]().to_dict(), "clip_qkv": 0.5}), path, 0)
    llm = LLM(str(path), block_size=4, num_blocks=64, **ENGINE)
    assert llm.engine.loaded.impl == "pagedinfer" and llm.engine.loaded.model.layers[0].clip_qkv == 0.5
    for prompt, tokens in zip(prompts, greedy(llm, prompts), strict=True):
        assert tokens == reference(path, tuple(prompt)), f"prompt of {len(prompt)}"


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe", "gpt_oss"])
def test_a_rows_output_does_not_depend_on_the_other_rows(tiny_model, name):
    """The expert MLP over 40 rows, and over each row alone and in other groups: the same bits (each
    expert's GEMM gives a row the same bits at any row count; a row's top-k outputs summed in rank
    order, not in the order other rows bring the experts in; qwen2_moe's shared expert scaled by a
    sigmoid computed row by row, where torch's gives a lone row other bits than a batch's for some;
    gpt_oss's clamped SwiGLU a C chain over each row)."""
    llm = LLM(str(tiny_model(name)), **ENGINE)
    mlp = llm.engine.loaded.model.layers[0].mlp
    assert (mlp.shared is not None) == (name == "qwen2_moe")
    assert all(isinstance(e.gate_up_proj, packed_linear.PackedLinear) for e in mlp.experts)
    torch.manual_seed(0)
    x = torch.randn(40, 64) * (8 if name == "gpt_oss" else 1)  # gate and up past its limit of 7 too
    with torch.inference_mode():
        batch = mlp(x)
        assert all(torch.equal(mlp(x[i : i + 1]), batch[i : i + 1]) for i in range(40))
        assert torch.equal(mlp(x.flip(0)), batch.flip(0))
        assert torch.equal(mlp(x[7:19]), batch[7:19])


def test_the_runner_takes_the_one_call_step_for_a_mixture_of_experts_but_gpt_oss(tiny_model):
    """A decode-only step of our layers takes the one-call C step, dense or with experts; gpt_oss's goes
    layer by layer (its attention sinks are not the step's)."""

    class Seq:
        token_ids, block_tables, lora_slot = [3, 14, 15], [[0]], 0  # one layer group

    class Chunk:
        seq, start, num_tokens, num_logits, step_token_ids = Seq(), 2, 1, 1, [15]

    for name, one_call in (("qwen3", True), ("qwen3_moe", True), ("gpt_oss", False)):
        llm = LLM(str(tiny_model(name)), block_size=4, num_blocks=16, model_impl="pagedinfer", **ENGINE)
        runner = llm.engine.runner
        _, _, meta = runner.build_metadata([Chunk()])
        assert (runner.one_call(meta, lora=False) is not None) == one_call, name


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("name", ["int8", "int4"])
def test_quantized_run_equals_float32_run_of_the_dequantized_checkpoint(tiny_model, tmp_path, family, name):
    """--quantization covers the router and every expert (gpt-oss's split from its stacks, biases
    kept in float32): seeded n=2 sampling with logprobs equals the float32 run of the checkpoint with
    those weights dequantized."""
    path = tiny_model(family)
    deq = dequantized_copy(path, tmp_path / "dequantized", name)
    file = deq / "model.safetensors"
    tensors = load_file(file)
    for key, t in tensors.items():  # a stack [E, in, rows]: each expert's [rows, in] by its rows
        if t.dim() == 3:
            tensors[key] = torch.stack([dequantized_weight(w.t().float(), name).t() for w in t]).contiguous()
    save_file(tensors, str(file), metadata={"format": "pt"})
    params = SamplingParams(n=2, temperature=0.9, seed=5, max_tokens=10, logprobs=2, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (4, 9, 17)]

    def run(model: Path, **kw) -> tuple[list, LLM]:
        llm = LLM(str(model), block_size=4, num_blocks=128, **ENGINE, **kw)
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [[(c.token_ids, c.logprobs) for c in o.outputs] for o in outs], llm

    quantized, llm = run(path, quantization=name)
    mlp = llm.engine.loaded.model.layers[1].mlp
    kind = "I8" if name == "int8" else "I4"
    assert mlp.router.kinds == [kind] and {k for e in mlp.experts for k in e.down_proj.kinds} == {kind}
    assert quantized == run(deq)[0]


@pytest.mark.parametrize("name", MOE)
def test_bfloat16_logprobs_match_float32_transformers(tiny_model, prompts, name):
    """bfloat16 panels for the router and the experts: each generated token's log-probability near
    float32 transformers' (teacher-forced), as tests/test_half_precision.py checks the dense layers.
    A router's near-tie can pick another expert under bfloat16 rounding, which moves that token by
    up to a nat or so, and the tokens after it that attend to its K/V by less (transformers' own
    bfloat16 run moved one of these tokens by 1.15 nats): so the median token within 0.05 nats, every
    one within 1.5; a wrong expert, weight or row is nats off on most tokens."""
    path = tiny_model(name)
    llm = LLM(str(path), device="cpu", dtype="bfloat16", block_size=4, num_blocks=64)
    assert llm.engine.loaded.model.layers[0].mlp.experts[0].gate_up_proj.kinds == ["BF16"]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ref = _hf_model(str(path))
    diffs = []
    for prompt, out in zip(prompts, outs, strict=True):
        tokens = out.outputs[0].token_ids
        with torch.no_grad():
            logp = ref(torch.tensor([prompt + tokens])).logits[0].log_softmax(-1)  # [P + N, V]
        want = logp[len(prompt) - 1 : -1].gather(1, torch.tensor(tokens)[:, None])[:, 0]  # [N]
        got = torch.tensor([out.outputs[0].logprobs[i][t].logprob for i, t in enumerate(tokens)])  # [N]
        diffs.append((got - want).abs())
    diffs = torch.cat(diffs)  # [40]
    assert float(diffs.median()) < 0.05 and float(diffs.max()) < 1.5, diffs.tolist()


# -- GGUF ----------------------------------------------------------------------------------------


@pytest.fixture
def gguf_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDINFER_GGUF_CACHE", str(tmp_path / "cache"))


@pytest.mark.parametrize("name", GGUF_MOE)
def test_a_float32_gguf_reads_back_the_checkpoint_and_runs_as_it(
    tiny_model, model_root, gguf_cache, prompts, name
):
    """llama.cpp's layout (3-D ffn_*_exps tensors, ffn_gate_inp; a Mixtral as a llama file with an
    expert count, its Q/K rows permuted; an OLMoE file, which transformers' GGUF reader has no config
    mapping for, read through llama's keys; qwen2moe's shared expert, its gate's one row a vector):
    read back to the checkpoint's own tensors bit for bit, the config's experts from the metadata, and
    greedy-identical to the safetensors run."""
    path = tiny_model(name)
    out = save_gguf(path, model_root / f"{name}-moe.gguf")
    ckpt = gguf.open_checkpoint(out)
    config = tf.AutoConfig.from_pretrained(ckpt.folder)
    want_config = tf.AutoConfig.from_pretrained(path)
    assert config.model_type == name and config.num_experts_per_tok == 2
    count = families.find(config).experts.count
    assert getattr(config, count) == getattr(want_config, count) == 8
    if name == "qwen3_moe":  # llama.cpp's qwen3moe renormalises the top-k weights
        assert config.moe_intermediate_size == 32 and config.norm_topk_prob
    if name == "qwen2_moe":  # its qwen2moe does not; the shared expert's size from its own key
        assert config.moe_intermediate_size == 32 and config.shared_expert_intermediate_size == 48
        assert not config.norm_topk_prob and ckpt.tensors["blk.0.ffn_gate_inp_shexp.weight"].shape == [64]
    sd, dequantized = gguf.state_dict(ckpt, config, families.find(config), keep_blocks=False)
    want = load_file(path / "model.safetensors")
    assert sorted(sd) == sorted(want) and not dequantized
    assert all(torch.equal(sd[k], want[k]) for k in want)
    llm = LLM(str(out), block_size=4, num_blocks=256, **ENGINE)
    assert llm.engine.loaded.impl == "pagedinfer"
    assert greedy(llm, prompts) == greedy(LLM(str(path), block_size=4, num_blocks=256, **ENGINE), prompts)


# K-quants need rows of 256 inputs: hidden 256 and experts of 256 rows (the down projection's inputs)
K_SHAPE = dict(
    hidden_size=256,
    intermediate_size=256,
    moe_intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_experts=4,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    max_position_embeddings=256,
    initializer_range=0.2,
)


K_CONFIGS = {
    "qwen3_moe": lambda: tf.Qwen3MoeConfig(**{**COMMON, "vocab_size": 512}, **K_SHAPE),
    # the shared expert's matrices in the type too (its gate's one row a float32 vector, as llama.cpp's)
    "qwen2_moe": lambda: tf.Qwen2MoeConfig(
        **{**COMMON, "vocab_size": 512}, **K_SHAPE, shared_expert_intermediate_size=256
    ),
}


@pytest.mark.parametrize(
    "family, kind",
    [
        *(("qwen3_moe", k) for k in ("Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K")),
        ("qwen2_moe", "Q4_0"),
        ("qwen2_moe", "Q4_K"),
    ],
)
def test_a_gguf_run_equals_the_float32_run_of_its_dequantized_weights(gguf_dir, gguf_cache, family, kind):
    """Every matrix in ``kind``, each expert a panel of the file's blocks: seeded sampling with
    logprobs equals ``--dtype float32`` on the same file (gguf-py's dequantization in float32 panels)."""
    model = gguf_dir / f"{family}-256"
    if not (model / "config.json").exists():
        save_random_model(K_CONFIGS[family](), model, 0)
    path = gguf_dir / f"{family}-256-{kind}.gguf"
    if not path.exists():
        save_gguf(model, path, lambda name: kind)
    params = SamplingParams(n=2, temperature=0.9, seed=5, max_tokens=8, logprobs=2, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (4, 9, 17)]

    def run(dtype: str) -> tuple[list, LLM]:
        llm = LLM(str(path), block_size=4, num_blocks=128, device="cpu", dtype=dtype)
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [[(c.token_ids, c.logprobs) for c in o.outputs] for o in outs], llm

    got, llm = run("auto")
    mlp = llm.engine.loaded.model.layers[0].mlp
    assert mlp.router.kinds == [kind] and {k for e in mlp.experts for k in e.gate_up_proj.kinds} == {kind}
    assert all(e.gate_up_proj.paired for e in mlp.experts)
    if family == "qwen2_moe":
        assert mlp.shared.expert.gate_up_proj.kinds == [kind] and mlp.shared.gate.kinds == ["F32"]
    matrices = 18 if family == "qwen3_moe" else 24  # and per layer the shared expert's gate, up, down
    assert (
        llm.engine.loaded.dtype_reason
        == f"float32 activations; weights as stored in the GGUF ({kind} x{matrices})"
    )
    want, ref = run("float32")
    assert ref.engine.loaded.model.layers[0].mlp.router.kinds == ["F32"]
    assert got == want


# -- dense layers among the sparse ones --------------------------------------------------------

DENSE_SHAPE = dict(  # three layers, experts of 32 rows (the dense MLP's 64)
    **COMMON,
    hidden_size=64,
    intermediate_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=256,
    initializer_range=0.2,
)
DENSE_LAYERS = {  # name -> (config, which layers have the experts)
    "qwen3_moe-mlp-only-1": (
        lambda: tf.Qwen3MoeConfig(**DENSE_SHAPE, head_dim=16, mlp_only_layers=[1]),
        [True, False, True],
    ),
    "qwen3_moe-sparse-step-2": (
        lambda: tf.Qwen3MoeConfig(**DENSE_SHAPE, head_dim=16, decoder_sparse_step=2),
        [False, True, False],
    ),
    "qwen2_moe-mlp-only-0": (
        lambda: tf.Qwen2MoeConfig(**DENSE_SHAPE, shared_expert_intermediate_size=48, mlp_only_layers=[0]),
        [False, True, True],
    ),
}


@pytest.mark.parametrize("name", DENSE_LAYERS)
@pytest.mark.parametrize("num_blocks", [256, 12], ids=["roomy-pool", "preempting-pool"])
def test_dense_layers_among_the_experts(model_root, prompts, name, num_blocks):
    """mlp_only_layers and decoder_sparse_step make some layers dense, as transformers builds them:
    our layers serve the model (not transformers'), each layer with the experts or the family's dense
    MLP as the config says, greedy-identical to transformers' generate, with and without preemption."""
    config, sparse = DENSE_LAYERS[name]
    path = model_root / name
    if not (path / "config.json").exists():
        save_random_model(config(), path, 0)
    llm = LLM(str(path), block_size=4, num_blocks=num_blocks, **ENGINE)
    assert llm.engine.loaded.impl == "pagedinfer"
    layers = llm.engine.loaded.model.layers
    assert [isinstance(layer.mlp, moe.ExpertMLP) for layer in layers] == sparse
    assert all(hasattr(layer, "gate_up_proj") != s for layer, s in zip(layers, sparse, strict=True))
    for prompt, tokens in zip(prompts, greedy(llm, prompts), strict=True):
        assert tokens == reference(path, tuple(prompt)), f"prompt of {len(prompt)}"
    assert (llm.stats.preemptions > 0) == (num_blocks == 12)


def test_the_count_of_sparse_layers_is_the_rules():
    """`Experts.sparse_layers` (the weights check's count, without a pass over the layers) agrees with
    `Experts.sparse` layer by layer, for every dense-layer configuration here and a few more."""
    spec = families.QWEN3_MOE.experts
    configs = [config() for config, _ in DENSE_LAYERS.values()]
    configs += [
        tf.Qwen3MoeConfig(**{**DENSE_SHAPE, "num_hidden_layers": 7}, decoder_sparse_step=3, mlp_only_layers=m)
        for m in ([], [2], [0, 2, 5, 9])
    ]
    for config in configs:
        for layers in range(1, 9):
            assert spec.sparse_layers(config, layers) == sum(spec.sparse(config, i) for i in range(layers))


def test_a_dense_layer_missing_its_mlp_is_refused_naming_it(model_root, tmp_path):
    """A dense layer's MLP tensors are checked like any other (and a sparse layer's experts are not
    asked of it): one missing is named."""
    from cli_helpers import with_weights

    name = "qwen3_moe-mlp-only-1"
    path = model_root / name
    if not (path / "config.json").exists():
        save_random_model(DENSE_LAYERS[name][0](), path, 0)
    short = with_weights(path, tmp_path / "short", lambda sd: sd.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ModelLoadError) as err:
        LLM(str(short), model_impl="pagedinfer", **ENGINE)
    assert str(err.value) == (
        f"{short / 'model.safetensors'}: the weights have no tensor 'model.layers.1.mlp.up_proj.weight', "
        "which the config implies"
    )


def test_lora_on_a_dense_layers_mlp(model_root, tmp_path):
    """An adapter on gate_proj, up_proj and down_proj of the dense layer 1 of a qwen3_moe: that layer's
    gate-up and down sites take it (the sparse layers' experts have none), greedy-identical to
    transformers' generate on the checkpoint with the adapter's deltas merged into those weights (PEFT
    takes "gate_proj" of a qwen3_moe for the experts' fused parameters, so it is no reference here)."""
    import json

    from cli_helpers import with_weights
    from safetensors.torch import save_file

    from pagedinfer import LoRARequest

    name = "qwen3_moe-mlp-only-1"
    base = model_root / name
    if not (base / "config.json").exists():
        save_random_model(DENSE_LAYERS[name][0](), base, 0)
    torch.manual_seed(4)
    rank, alpha = 4, 8
    deltas = {  # module -> (A [r, in], B [out, r]): each of them 64 by 64 (the dense MLP's intermediate_size)
        f"model.layers.1.mlp.{m}": (torch.randn(rank, 64) * 0.3, torch.randn(64, rank) * 0.3)
        for m in ("gate_proj", "up_proj", "down_proj")
    }
    adapter = tmp_path / "dense-mlp"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(deltas)})
    )
    save_file(
        {
            f"base_model.model.{m}.lora_{p}.weight": t
            for m, ab in deltas.items()
            for p, t in zip("AB", ab, strict=True)
        },
        adapter / "adapter_model.safetensors",
    )

    def merge(sd: dict) -> None:
        for m, (a, b) in deltas.items():
            sd[f"{m}.weight"] = sd[f"{m}.weight"] + alpha / rank * b @ a

    merged = with_weights(base, tmp_path / "merged", merge)
    llm = LLM(str(base), block_size=4, num_blocks=256, enable_lora=True, max_loras=1, **ENGINE)
    layers = llm.engine.loaded.model.layers
    assert [layer.lora.gate_up is not None for layer in layers] == [False, True, False]
    prompts = [[5, 9, 200, 3, 17, 41, 8, 99, 12], [250, 1, 33]]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        GREEDY,
        use_tqdm=False,
        lora_request=LoRARequest("dense-mlp", 1, str(adapter)),
    )
    got = [out.outputs[0].token_ids for out in outs]
    assert got == [hf_greedy(merged, p, MAX_TOKENS) for p in prompts]
    assert got != greedy(llm, prompts)  # the adapter matters


def test_a_checkpoint_missing_an_expert_is_refused_naming_it(tiny_model, tmp_path):
    """Each expert's tensors are checked against the config like any other: one missing is named."""
    from cli_helpers import with_weights

    path = with_weights(
        tiny_model("mixtral"),
        tmp_path / "mixtral-short",
        lambda sd: sd.pop("model.layers.1.block_sparse_moe.experts.7.w3.weight"),
    )
    with pytest.raises(ModelLoadError) as err:
        LLM(str(path), model_impl="pagedinfer", **ENGINE)
    assert str(err.value) == (
        f"{path / 'model.safetensors'}: the weights have no tensor "
        "'model.layers.1.block_sparse_moe.experts.7.w3.weight', which the config implies"
    )


def test_lora_on_the_attention_of_a_mixture_of_experts(tiny_model, model_root, tmp_path):
    """An adapter on q_proj and v_proj of a qwen3_moe: greedy-identical to PEFT's on transformers'
    model; one naming an expert's linear (which has no LoRA site) refused by name."""
    from safetensors.torch import save_file

    from pagedinfer import LoRARequest
    from pagedinfer.lora.adapter import AdapterError

    base = tiny_model("qwen3_moe")
    adapter = save_lora(base, model_root / "moe-loras", "attn", 8, seed=3, targets=["q_proj", "v_proj"])
    llm = LLM(str(base), block_size=4, num_blocks=256, enable_lora=True, max_loras=1, **ENGINE)
    assert llm.engine.loaded.impl == "pagedinfer"
    prompts = [[5, 9, 200, 3, 17, 41, 8, 99, 12], [250, 1, 33]]
    request = LoRARequest("attn", 1, str(adapter))
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, lora_request=request
    )
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == peft_greedy(base, adapter, prompt, MAX_TOKENS)
    expert = tmp_path / "expert-adapter"
    expert.mkdir()
    (expert / "adapter_config.json").write_bytes((adapter / "adapter_config.json").read_bytes())
    tensors = load_file(adapter / "adapter_model.safetensors")
    renamed = {
        k.replace("layers.0.self_attn.q_proj", "layers.0.mlp.experts.0.gate_proj"): v
        for k, v in tensors.items()
    }
    save_file(renamed, expert / "adapter_model.safetensors")
    with pytest.raises(AdapterError) as err:
        llm.engine.add_lora(LoRARequest("expert", 2, str(expert)))
    assert str(err.value) == (
        "adapter 'expert' targets model.layers.0.mlp.experts.0.gate_proj, which this model has no linear "
        "layer for (LoRA serves the linear layers)"
    )


@pytest.mark.parametrize(
    "name, writer, key, field",
    [
        (
            "qwen3_moe",
            "add_expert_feed_forward_length",
            "qwen3moe.expert_feed_forward_length",
            "moe_intermediate_size",
        ),
        (
            "qwen2_moe",
            "add_expert_shared_feed_forward_length",
            "qwen2moe.expert_shared_feed_forward_length",
            "shared_expert_intermediate_size",
        ),
    ],
)
def test_a_gguf_without_its_expert_size_is_refused_naming_the_key(
    tiny_model, tmp_path, monkeypatch, gguf_cache, name, writer, key, field
):
    """A qwen3moe file lacking expert_feed_forward_length, or a qwen2moe file lacking
    expert_shared_feed_forward_length (which transformers' GGUF reader would leave at their defaults:
    768, 5632): refused in one line naming the key, not run with experts of the wrong size."""
    import gguf as gguf_py

    monkeypatch.setattr(gguf_py.GGUFWriter, writer, lambda self, n: None)
    out = save_gguf(tiny_model(name), tmp_path / "no-expert-size.gguf")
    with pytest.raises(ModelLoadError) as err:
        LLM(str(out), **ENGINE)
    assert str(err.value) == f"{out}: metadata {key} is missing; a {name} file gives its {field}"


# -- gpt-oss -------------------------------------------------------------------------------------


def test_gpt_oss_layers_read_its_declaration(tiny_model):
    """The checkpoint's sinks per head, windows by layer type (layer 0 windowed, layer 1 global),
    the clamped SwiGLU's constants from the config, biases on q, k, v, o, the router and the experts."""
    path = tiny_model("gpt_oss")
    llm = LLM(str(path), model_impl="pagedinfer", **ENGINE)
    first, second = llm.engine.loaded.model.layers
    stored = load_file(path / "model.safetensors")
    assert torch.equal(first.sinks, stored["model.layers.0.self_attn.sinks"])
    assert (first.window, second.window) == (8, 0)
    mlp = first.mlp
    assert mlp.renormalise and mlp.top_k == 2 and [e.glu for e in mlp.experts] == [(1.702, 7.0)] * 4

    def bias(linear) -> torch.Tensor:  # [out]: a linear's, or its panels' (padded to whole panels)
        segments = getattr(linear, "segments", None)
        return (linear.bias if not segments else segments[0].bias).reshape(-1)[: linear.out_features]

    assert torch.equal(bias(mlp.router), stored["model.layers.0.mlp.router.bias"])
    gate_up_bias = stored["model.layers.0.mlp.experts.gate_up_proj_bias"][2]  # [2 I]: gate, up alternating
    assert torch.equal(bias(mlp.experts[2].gate_up_proj), torch.cat([gate_up_bias[0::2], gate_up_bias[1::2]]))
    assert torch.equal(bias(mlp.experts[3].down_proj), stored["model.layers.0.mlp.experts.down_proj_bias"][3])
    q_bias, o_bias = (stored[f"model.layers.1.self_attn.{m}_proj.bias"] for m in ("q", "o"))
    assert torch.equal(bias(second.qkv_proj)[:64], q_bias) and torch.equal(bias(second.o_proj), o_bias)


def test_gpt_oss_through_transformers_layers_still_matches(tiny_model, prompts):
    """``--model-impl transformers`` on gpt_oss: its modules with our pool and sinks, greedy-identical
    to its generate."""
    path = tiny_model("gpt_oss")
    llm = LLM(str(path), block_size=4, num_blocks=64, model_impl="transformers", **ENGINE)
    assert llm.engine.loaded.impl == "transformers"
    for prompt, tokens in zip(prompts, greedy(llm, prompts), strict=True):
        assert tokens == reference(path, tuple(prompt)), f"prompt of {len(prompt)}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_clamped_swiglu_chain_is_transformers_activation(dtype):
    """The C chain against transformers' GptOssExperts activation on the same values (interleaved as
    its checkpoint holds them; in float32: bfloat16 rows are computed in float32 and rounded three
    times, as our chains round, where transformers' bfloat16 module rounds after each of its six
    ops), gate and up well past the limit of 7 on both sides, in 8-lane vectors and a scalar tail; a
    row's values the same bits alone as among others; the torch fallback too."""
    config = CONFIGS["gpt_oss"]()
    apply_gate = tf.models.gpt_oss.modeling_gpt_oss.GptOssExperts(config)._apply_gate
    gen = torch.Generator().manual_seed(0)
    for width in (96, 99):
        gate_up = (torch.randn(5, 2 * width, generator=gen) * 6).to(dtype)  # [T, 2 I]: gate, then up
        assert (gate_up > 7).any() and (gate_up < -7).any()
        got = fused_ops.clamped_swiglu(gate_up, 1.702, 7.0, True)  # [T, I]
        interleaved = torch.stack([gate_up[:, :width], gate_up[:, width:]], dim=-1).flatten(1).float()
        want = apply_gate(interleaved)  # [T, I] float32
        step = 2**-6 if dtype == torch.bfloat16 else 2**-20  # bfloat16: three roundings of 2^-8 at most
        torch.testing.assert_close(got.float(), want, rtol=step, atol=1e-6)
        torch.testing.assert_close(
            fused_ops.clamped_swiglu(gate_up.float(), 1.702, 7.0, False), want, rtol=2**-20, atol=1e-6
        )
        assert all(
            torch.equal(fused_ops.clamped_swiglu(gate_up[i : i + 1], 1.702, 7.0, True), got[i : i + 1])
            for i in range(5)
        )


def test_a_gpt_oss_gguf_file_runs_its_mxfp4_experts_as_stored(tiny_model, model_root, prompts):
    """llama.cpp's gpt-oss layout (each expert's gate, up and down apart in 3-D "*_exps" tensors, biases
    beside them, the sinks as "attn_sinks.weight", YaRN under llama.cpp's keys) read by our layers, the
    experts in MXFP4 kept as stored (gate and up one segment of plain panels, the clamped SwiGLU after):
    the config is the checkpoint's, and the greedy tokens are transformers' ``generate`` on the
    checkpoint whose experts hold the file's dequantized MXFP4 values (llama.cpp's dequantizer's).
    transformers' own GGUF reader puts gpt-oss's experts under names its model lacks, so the
    reference reads safetensors."""
    import gguf as gguf_py

    path = tiny_model("gpt_oss")
    file = save_gguf(path, model_root / "gpt_oss-mxfp4.gguf", lambda t: "MXFP4" if "_exps" in t else "F32")
    llm = LLM(str(file), block_size=4, num_blocks=256, **{**ENGINE, "dtype": "auto"})
    loaded = llm.engine.loaded
    assert loaded.impl == "pagedinfer" and loaded.model.family.name == "gpt_oss"
    assert loaded.dtype_reason == "float32 activations; weights as stored in the GGUF (F32 x18, MXFP4 x6)"
    want_config, config = CONFIGS["gpt_oss"](), loaded.model.config
    for field in (
        "rope_parameters",
        "head_dim",
        "sliding_window",
        "layer_types",
        "swiglu_limit",
        "swiglu_alpha",
    ):
        assert getattr(config, field) == getattr(want_config, field), field
    mlp = loaded.model.layers[1].mlp
    assert [e.gate_up_proj.kinds + e.down_proj.kinds for e in mlp.experts] == [["MXFP4"] * 2] * 4
    from cli_helpers import with_weights

    def experts(sd: dict) -> None:  # the file's [E, rows, in] gate, up, down -> stacked [E, in, rows]
        stored = {t.name: t for t in gguf_py.GGUFReader(file).tensors}

        def of(name: str) -> torch.Tensor:  # [E, in, rows]
            t = stored[name]
            return torch.from_numpy(gguf_py.quants.dequantize(t.data, t.tensor_type)).mT

        for i in range(config.num_hidden_layers):
            gate, up = (of(f"blk.{i}.ffn_{part}_exps.weight") for part in ("gate", "up"))
            stack = f"model.layers.{i}.mlp.experts"
            sd[f"{stack}.gate_up_proj"] = (
                torch.stack([gate, up], dim=-1).flatten(-2).contiguous()
            )  # interleaved
            sd[f"{stack}.down_proj"] = of(f"blk.{i}.ffn_down_exps.weight").contiguous()

    reference_dir = with_weights(path, model_root / "gpt_oss-mxfp4-dequantized", experts)
    for prompt, tokens in zip(prompts, greedy(llm, prompts), strict=True):
        assert tokens == reference(reference_dir, tuple(prompt)), f"prompt of {len(prompt)}"


def test_a_gpt_oss_checkpoint_quantized_in_mxfp4_is_left_to_transformers_layers():
    """A safetensors checkpoint quantized in MXFP4 (``quantization_config``) is transformers' to
    dequantize: our layers read unquantized weights only."""
    config = CONFIGS["gpt_oss"]()
    assert families.by_gguf_arch("gpt-oss", {"gpt-oss.expert_count": 4}) is families.by_model_type("gpt_oss")
    assert llama.unsupported_reason(config) is None
    config.quantization_config = {"quant_method": "mxfp4"}
    assert llama.unsupported_reason(config) == (
        "quantization_config 'mxfp4' (pagedinfer's implementation reads unquantized weights only)"
    )


DOWN_STACK = "model.layers.1.mlp.experts.down_proj"  # [E, I, H]


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda sd: sd.update({DOWN_STACK: sd[DOWN_STACK][:, :, :32].contiguous()}),
            "tensor 'model.layers.1.mlp.experts.down_proj' has shape [4, 128, 32]; the config expects "
            "[4, 128, 64] (num_experts (mixtral: num_local_experts), intermediate_size, hidden_size = 4, 128, 64)",
        ),
        (
            lambda sd: sd.pop("model.layers.0.self_attn.sinks"),
            "the weights have no tensor 'model.layers.0.self_attn.sinks', which the config implies",
        ),
        (
            lambda sd: sd.pop("model.layers.1.mlp.experts.gate_up_proj_bias"),
            "the weights have no tensor 'model.layers.1.mlp.experts.gate_up_proj_bias', which the config implies",
        ),
    ],
    ids=["misshapen-stack", "no-sinks", "no-expert-bias"],
)
def test_a_gpt_oss_checkpoint_off_its_declaration_is_refused_naming_the_tensor(
    tiny_model, tmp_path, change, message
):
    """The stacked experts, their biases and the sinks are checked against the config like any tensor."""
    from cli_helpers import with_weights

    path = with_weights(tiny_model("gpt_oss"), tmp_path / "gpt_oss-changed", change)
    with pytest.raises(ModelLoadError) as err:
        LLM(str(path), model_impl="pagedinfer", **ENGINE)
    assert str(err.value) == f"{path / 'model.safetensors'}: {message}"


# -- the routed experts in one C call --------------------------------------------------------------

ONE_CALL_CASES = [  # (family, how it is loaded)
    *((name, {"dtype": "float32"}) for name in MOE),
    ("qwen2_moe", {"dtype": "bfloat16"}),  # its shared expert beside the routed ones
    ("gpt_oss", {"dtype": "bfloat16"}),  # biased router and experts, clamped SwiGLU
    ("qwen3_moe", {"dtype": "float32", "quantization": "int4"}),
    ("gpt_oss", {"dtype": "float32", "quantization": "int8"}),
    ("mixtral", {"gguf": "Q4_0"}),
    ("qwen2_moe", {"gguf": "Q8_0"}),
    ("gpt_oss", {"gguf": "MXFP4"}),  # llama.cpp's layout: gate and up apart, one segment of plain panels
]


@pytest.mark.parametrize(
    "name, load", ONE_CALL_CASES, ids=[f"{n}-{'-'.join(map(str, v.values()))}" for n, v in ONE_CALL_CASES]
)
def test_the_one_call_experts_equal_the_torch_loop(tiny_model, model_root, monkeypatch, name, load):
    """The routed experts in one C call (kernels/cpu_moe.c) give every row the bits of the torch loop
    it replaces (softmax weights in float64, rows grouped by expert, each expert's GEMMs once, each
    row's sum in rank order), at 1, 7 and 40 rows; the shared expert added after, as before."""
    path = tiny_model(name)
    if "gguf" in load:  # every matrix in the type but qwen2_moe's shared expert (rows of 48: float32)
        kind = load["gguf"]
        path = save_gguf(path, model_root / f"{name}-{kind}.gguf", lambda t: "F32" if "shexp" in t else kind)
        load = {"dtype": "auto"}
    llm = LLM(str(path), device="cpu", **load)
    model = llm.engine.loaded.model
    dtype = model.norm.dtype
    torch.manual_seed(0)
    x = (torch.randn(40, model.norm.shape[0]) * (8 if name == "gpt_oss" else 1)).to(dtype)
    with torch.inference_mode():
        for layer in model.layers:
            mlp = layer.mlp
            got = [mlp(x[:n]) for n in (1, 7, 40)]
            assert isinstance(mlp._routed, moe_kernel.RoutedExperts), "the C call serves these experts"
            with monkeypatch.context() as m:
                m.setattr(mlp, "_routed", None)
                m.setattr(moe_kernel.RoutedExperts, "serves", staticmethod(lambda *_: False))
                want = [mlp(x[:n]) for n in (1, 7, 40)]
                assert mlp._routed is None  # the torch loop ran
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_the_one_call_experts_refuse_an_expert_outside_the_layer(tiny_model):
    """An expert index outside the layer's experts is refused before anything runs, naming it."""
    mlp = LLM(str(tiny_model("qwen3_moe")), **ENGINE).engine.loaded.model.layers[0].mlp
    x = torch.randn(2, 64)
    with torch.inference_mode():
        mlp(x)
        chosen = torch.tensor([[0, 1], [8, 2]])
        with pytest.raises(IndexError, match="expert 8 chosen at slot 2 is outside the layer's 8 experts"):
            mlp._routed.run(x, mlp.router(x), chosen)


# -- the one-call decode step -------------------------------------------------------------------

STEP_CASES = [  # (family or DENSE_LAYERS name, how it is loaded)
    *((name, {"dtype": "float32"}) for name in GGUF_MOE),
    ("qwen2_moe", {"dtype": "bfloat16"}),  # the shared expert's sigmoid and sum rounded to bfloat16
    ("olmoe", {"dtype": "bfloat16"}),
    ("qwen3_moe", {"dtype": "float32", "quantization": "int4"}),
    ("qwen2_moe-mlp-only-0", {"dtype": "float32"}),  # a dense layer before the sparse ones
    ("olmoe-clipped", {"dtype": "float32"}),  # clip_qkv in the step
    ("mixtral", {"gguf": "Q4_0"}),
    ("olmoe", {"gguf": "Q4_0"}),
    ("qwen2_moe", {"gguf": "Q8_0"}),
]


def _step_model(tiny_model, model_root: Path, name: str, load: dict) -> tuple[Path, dict]:
    """``name``'s checkpoint (a tiny family model, a DENSE_LAYERS one, OLMoE with a clip of 0.5), or
    its GGUF with every matrix in ``load``'s type (qwen2_moe's shared expert, rows of 48, float32)."""
    if name in DENSE_LAYERS:
        path = model_root / name
        if not (path / "config.json").exists():
            save_random_model(DENSE_LAYERS[name][0](), path, 0)
    elif name == "olmoe-clipped":
        path = model_root / name
        if not (path / "config.json").exists():
            save_random_model(tf.OlmoeConfig(**{**CONFIGS["olmoe"]().to_dict(), "clip_qkv": 0.5}), path, 0)
    else:
        path = tiny_model(name)
    if "gguf" in load:
        kind = load["gguf"]
        out = model_root / f"{name}-step-{kind}.gguf"
        path = out if out.exists() else save_gguf(path, out, lambda t: "F32" if "shexp" in t else kind)
        load = {"dtype": "auto"}
    return path, load


@pytest.mark.parametrize(
    "name, load", STEP_CASES, ids=[f"{n}-{'-'.join(map(str, v.values()))}" for n, v in STEP_CASES]
)
def test_the_c_step_gives_the_bits_of_the_layer_path(tiny_model, model_root, monkeypatch, name, load):
    """A mixture of experts' decode steps in the one C call (router GEMM, top k, routed experts through
    cpu_moe.c, shared expert; OLMoE's q/k norms over all heads and clip): seeded n=3 sampling with
    logprobs the same bits as layer by layer, in float32, bfloat16, int4 panels and GGUF blocks."""
    steps = count_one_call_steps(monkeypatch)
    path, load = _step_model(tiny_model, model_root, name, load)

    def make_llm():
        return LLM(str(path), block_size=4, num_blocks=256, device="cpu", **load)

    step_and_layer_path_agree(monkeypatch, steps, make_llm, [list(range(3, 3 + n)) for n in (1, 9, 23)], 8)


@pytest.mark.parametrize("name", ["olmoe", "qwen2_moe"])
def test_a_rows_bits_in_the_c_step_do_not_depend_on_the_rows_beside_it(tiny_model, monkeypatch, name):
    """Three decoding sequences (contexts of 13, 9 and 22) in one C step, and each in a step of its own:
    every row's logits the same bits (each expert's GEMM over whichever rows chose it, each row's sum
    in rank order, the shared expert's gate row by row)."""
    steps = count_one_call_steps(monkeypatch)
    llm = LLM(str(tiny_model(name)), block_size=4, num_blocks=64, model_impl="pagedinfer", **ENGINE)
    runner, pool = llm.engine.runner, llm.engine.pool
    rng = random.Random(5)
    chunks = []
    for context in (13, 9, 22):
        tables: list[list[int]] = [[] for _ in range(pool.num_groups)]
        for g, table in enumerate(tables):
            pool.reserve(table, 0, context + 1, g)
        ids = [rng.randrange(2, 256) for _ in range(context + 1)]
        runner.execute([Probe(tables, context, ids)], [])  # its context, as a prompt chunk
        chunks.append(Probe(tables, 1, ids, start=context))
    steps.clear()
    together = runner.execute(chunks, [])  # [3, vocab]
    alone = [runner.execute([c], []) for c in (chunks[2], chunks[0], chunks[1])]
    assert len(steps) == 4
    for row, got in zip((2, 0, 1), alone, strict=True):
        assert torch.equal(got.view(torch.int32), together[row : row + 1].view(torch.int32)), row


def test_tied_router_logits_choose_the_lower_expert_in_c_and_in_torch(tiny_model, monkeypatch):
    """Router logits with many ties (integers in [-2, 2] over 8 experts): the C call's top k and the
    torch loop's (`moe.route`'s stable sort) choose the same experts in the same order, so the outputs
    are the same bits (torch.topk orders ties its own way)."""
    mlp = LLM(str(tiny_model("qwen3_moe")), **ENGINE).engine.loaded.model.layers[0].mlp
    torch.manual_seed(0)
    x = torch.randn(40, 64)
    tied = torch.randint(-2, 3, (40, len(mlp.experts))).float()  # [40, E]
    monkeypatch.setattr(mlp.router, "forward", lambda rows: tied[: rows.shape[0]])
    _, chosen = moe.route(tied, mlp.top_k, mlp.renormalise)
    assert chosen.tolist() == [
        sorted(range(tied.shape[1]), key=lambda e: -row[e])[: mlp.top_k] for row in tied.tolist()
    ]
    with torch.inference_mode():
        got = mlp(x)
        assert isinstance(mlp._routed, moe_kernel.RoutedExperts)
        monkeypatch.setattr(mlp, "_routed", None)
        monkeypatch.setattr(moe_kernel.RoutedExperts, "serves", staticmethod(lambda *_: False))
        assert torch.equal(got, mlp(x))
