"""OLMo-2 (its norms after each branch, q/k norms over all of q's and k's rows), Granite (its four
multipliers), Phi-3 (fused q/k/v and gate/up modules, LongRoPE) and Gemma 3 (norms before and after
each branch of 1 + weight, GeGLU, scaled embeddings and queries, RoPE per layer type over windowed and
global layers, a logit softcap) on pagedinfer's own layers: greedy-identical to transformers' generate
with a roomy and a preempting pool, through the one-call C step and layer by layer, the two paths
giving the same bits; Gemma 3's, OLMo-2's and Granite's GGUF files (llama.cpp's layout: Gemma's norms
stored as 1 + weight, the windows' pattern; Granite's multipliers as llama.cpp's keys) read as
llama.cpp reads them.
(Reproducibility across batches: tests/test_reproducibility.py.)"""

import json
import random
import shutil
from dataclasses import asdict

import numpy as np
import pytest
import torch
from conftest import DEVICE, ENGINE
from gguf_models import save_gguf
from models import count_one_call_steps, hf_greedy, peft_greedy, save_lora, step_and_layer_path_agree
from transformers import AutoModelForCausalLM

from pagedinfer import LLM, LoRARequest, SamplingParams
from pagedinfer.model import families, packed_linear
from pagedinfer.model.loader import ModelLoadError

pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="the one-call C step is the CPU's")
NEW = {  # model: family
    "olmo2": "olmo2",
    "granite": "granite",
    "phi3": "phi3",
    "phi3_window": "phi3",
    "gemma3_text": "gemma3_text",  # a window of 16 on 3 of 4 layers
    "gemma3_scaled": "gemma3_text",  # linear RoPE scaling on its global layer, a softcap, norms drawn
}
MAX_TOKENS = 12
BF16_STEP = packed_linear.panel_dtype(torch.bfloat16, 2)  # bfloat16 panels where the kernel builds


def prompts(count: int = 6) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(2, 256) for _ in range(rng.randrange(1, 30))] for _ in range(count)]


def assert_greedy_like_transformers(llm: LLM, path) -> None:
    """Every prompt's greedy tokens from ``llm`` are transformers' `generate` on the checkpoint ``path``."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ps = prompts()
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    for prompt, out in zip(ps, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, MAX_TOKENS), f"prompt of {len(prompt)}"


PREEMPTING = {"gemma3_scaled": 8}  # the blocks of a pool that preempts (else 12): its windows of 8 need few


@pytest.mark.parametrize("name", NEW)
@pytest.mark.parametrize("roomy", [True, False], ids=["roomy-pool", "preempting-pool"])
@pytest.mark.parametrize("one_call", [True, False], ids=["one-call-step", "layer-by-layer"])
def test_greedy_matches_transformers_on_our_layers(tiny_model, monkeypatch, name, roomy, one_call):
    steps = count_one_call_steps(monkeypatch)
    if not one_call:
        monkeypatch.setenv("PAGEDINFER_DECODE_STEP", "0")
    path = tiny_model(name)
    num_blocks = 256 if roomy else PREEMPTING.get(name, 12)
    llm = LLM(str(path), block_size=4, num_blocks=num_blocks, **ENGINE)  # --model-impl auto
    assert llm.engine.loaded.impl == "pagedinfer"  # not transformers' modules
    assert llm.engine.loaded.model.family is next(f for f in families.FAMILIES if f.name == NEW[name])
    assert_greedy_like_transformers(llm, path)
    assert bool(steps) == one_call  # the decode-only steps in one C call, or none of them
    assert (llm.stats.preemptions > 0) == (not roomy)


@pytest.mark.parametrize("name", NEW)
@pytest.mark.parametrize(
    "dtype",
    [
        "float32",
        pytest.param("bfloat16", marks=pytest.mark.skipif(not BF16_STEP, reason="no bfloat16 panels")),
    ],
)
def test_the_one_call_step_gives_the_bits_of_the_layer_path(tiny_model, monkeypatch, name, dtype):
    """Seeded n=3 sampling with logprobs: tokens and log-probabilities exactly equal with the C step
    and without it (the same norms, multipliers and residual adds, in C or as torch ops)."""
    steps = count_one_call_steps(monkeypatch)
    path = tiny_model(name)

    def make_llm():
        return LLM(str(path), block_size=4, num_blocks=256, **{**ENGINE, "dtype": dtype})

    step_and_layer_path_agree(monkeypatch, steps, make_llm, prompts(4), MAX_TOKENS)


def test_gemma3_adapters_match_peft(tiny_model, model_root):
    """A LoRA adapter on every linear of Gemma 3's layers: its gate and up deltas go into the plain
    gate-up product before gelu-tanh(gate) * up, as PEFT's do before transformers' GeGLU."""
    base = tiny_model("gemma3_scaled")
    adapter = save_lora(base, model_root / "loras", "gemma3_scaled-r8", 8, seed=1)
    llm = LLM(str(base), block_size=4, num_blocks=256, enable_lora=True, max_loras=1, **ENGINE)
    assert llm.engine.loaded.impl == "pagedinfer"
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ps = prompts(3)
    request = LoRARequest("r8", 1, str(adapter))
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False, lora_request=request)
    for prompt, out in zip(ps, outs, strict=True):
        assert out.error is None
        assert out.outputs[0].token_ids == peft_greedy(base, adapter, prompt, MAX_TOKENS), (
            f"prompt of {len(prompt)}"
        )


@pytest.mark.parametrize("one_call", [True, False], ids=["one-call-step", "layer-by-layer"])
def test_longrope_matches_transformers(tiny_model, monkeypatch, one_call):
    """Phi-3's LongRoPE short factors (the angles transformers computes) over every position."""
    steps = count_one_call_steps(monkeypatch)
    if not one_call:
        monkeypatch.setenv("PAGEDINFER_DECODE_STEP", "0")
    path = tiny_model("phi3_longrope")
    llm = LLM(str(path), block_size=4, num_blocks=64, **ENGINE)
    assert llm.engine.loaded.impl == "pagedinfer"
    assert_greedy_like_transformers(llm, path)
    assert bool(steps) == one_call


def test_longrope_that_switches_factors_is_left_to_transformers(tiny_model):
    """Past original_max_position_embeddings transformers' Phi-3 recomputes the sequence's cache with
    the long factors; our layers keep the pool's K as written: the config goes to transformers' modules
    (auto), and our layers asked for refuse it in one line."""
    path = tiny_model("phi3_longrope_switch")
    assert LLM(str(path), **ENGINE).engine.loaded.impl == "transformers"
    with pytest.raises(ModelLoadError) as err:
        LLM(str(path), model_impl="pagedinfer", **ENGINE)
    assert str(err.value) == (
        f"model implementation 'pagedinfer' cannot serve {str(path)!r}: LongRoPE past "
        "original_max_position_embeddings (12): transformers recomputes a sequence's cache with the long "
        "factors there, pagedinfer's implementation does not"
    )


def dequantized_copy(path, out, kind: str):
    """The checkpoint at ``path`` with each matrix replaced by its ``kind`` blocks' values (what a GGUF
    of that type holds), saved at ``out``: the reference transformers runs for a quantized file."""
    import gguf

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                blocks = gguf.quants.quantize(p.numpy(), qtype)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, qtype).reshape(p.shape)))
    model.save_pretrained(out)
    return out


@pytest.mark.parametrize("name", ["olmo2", "granite"])
@pytest.mark.parametrize("kind", ["F32", "Q8_0"])
@pytest.mark.parametrize("roomy", [True, False], ids=["roomy-pool", "preempting-pool"])
def test_an_olmo2_or_granite_gguf_matches_transformers_on_its_checkpoint(
    tiny_model, tmp_path, monkeypatch, name, kind, roomy
):
    """An OLMo-2 or Granite GGUF in llama.cpp's layout (olmo2's Q and K as the checkpoint has them,
    granite's permuted as llama's, its multipliers as llama.cpp's float32 keys), float32 or Q8_0 kept
    in its blocks, runs on our layers greedy-identical to transformers' generate on the checkpoint it
    was written from (for Q8_0: that checkpoint with the blocks' values)."""
    monkeypatch.setenv("PAGEDINFER_GGUF_CACHE", str(tmp_path / "cache"))
    path = tiny_model(name)
    gguf_path = save_gguf(path, tmp_path / f"{name}-{kind}.gguf", kind_of=lambda _: kind)
    pool = {"num_blocks": 64} if roomy else {"num_blocks": 12}
    llm = LLM(str(gguf_path), block_size=4, **pool, **{**ENGINE, "dtype": "auto"})
    loaded = llm.engine.loaded
    assert loaded.impl == "pagedinfer" and loaded.model.family.name == name
    assert f"weights as stored in the GGUF ({kind} x" in loaded.dtype_reason
    config, theirs = loaded.model.config, json.loads((path / "config.json").read_text())
    multipliers = families.by_model_type(name).multipliers
    for key in asdict(multipliers).values() if multipliers else ():  # float32 in the file
        assert config.to_dict()[key] == pytest.approx(theirs[key], rel=1e-7), key
    reference = path if kind == "F32" else dequantized_copy(path, tmp_path / "reference", kind)
    assert_greedy_like_transformers(llm, reference)
    assert (llm.stats.preemptions > 0) == (not roomy)


@pytest.mark.parametrize(
    "name,keys,why",
    [
        (
            "granite",
            {"residual_scale": float("nan")},
            "metadata granite.residual_scale is nan; it must be a finite positive number",
        ),
        (
            "granite",
            {"logit_scale": -2.0},
            "metadata granite.logit_scale is -2.0; it must be a finite positive number",
        ),
        (
            "granite",
            {"attention.scale": None},
            "metadata granite.attention.scale is missing; a granite file gives its attention_multiplier",
        ),
        (
            "olmo2",
            {"attention.sliding_window": 8},
            "metadata olmo2.attention.sliding_window is 8; pagedinfer reads olmo2 files without windows "
            "or RoPE scaling (OLMo 3's)",
        ),
    ],
    ids=["granite-nan", "granite-negative", "granite-missing", "olmo3-window"],
)
def test_an_olmo2_or_granite_gguf_with_a_malformed_key_is_refused_by_name(
    tiny_model, tmp_path, monkeypatch, name, keys, why
):
    """A key llama.cpp reads as a multiplier or a window, malformed, missing or of OLMo 3's: one line
    naming it, before a tensor is read."""
    monkeypatch.setenv("PAGEDINFER_GGUF_CACHE", str(tmp_path / "cache"))
    path = save_gguf(tiny_model(name), tmp_path / f"{name}.gguf", keys=keys)
    with pytest.raises(ModelLoadError) as err:
        LLM(str(path), **ENGINE)
    assert str(err.value) == f"{path}: {why}"


def test_gemma3_with_bidirectional_attention_is_left_to_transformers(tiny_model, tmp_path):
    """use_bidirectional_attention (EmbeddingGemma's) attends past each token: our layers attend
    causally, so auto takes transformers' modules and our layers asked for refuse it in one line."""
    config = json.loads((tiny_model("gemma3_text") / "config.json").read_text())
    path = tmp_path / "bidirectional"
    shutil.copytree(tiny_model("gemma3_text"), path)
    (path / "config.json").write_text(json.dumps({**config, "use_bidirectional_attention": True}))
    with pytest.raises(ModelLoadError) as err:
        LLM(str(path), model_impl="pagedinfer", **ENGINE)
    assert str(err.value) == (
        f"model implementation 'pagedinfer' cannot serve {str(path)!r}: use_bidirectional_attention "
        "(pagedinfer's implementation attends causally only)"
    )


def test_a_phi3_gguf_with_longrope_factors_is_refused(tiny_model, tmp_path, monkeypatch):
    """A Phi-3 GGUF reads (tests/test_families.py), but one holding llama.cpp's LongRoPE factor
    tensors would get a config without them from transformers' reader: refused in one line."""
    monkeypatch.setenv("PAGEDINFER_GGUF_CACHE", str(tmp_path / "cache"))
    factors = {f"rope_factors_{k}.weight": np.ones(8, np.float32) for k in ("long", "short")}
    path = save_gguf(tiny_model("phi3"), tmp_path / "phi3.gguf", extra=factors)
    with pytest.raises(ModelLoadError) as err:
        LLM(str(path), **ENGINE)
    assert str(err.value) == (
        f"{path}: tensor rope_factors_long.weight is refused: its LongRoPE factors, which transformers' "
        "GGUF reader leaves out of the config, so the angles would be the unscaled ones"
    )


@pytest.mark.parametrize("pattern_array", [False, True], ids=["pattern-integer", "pattern-per-layer"])
@pytest.mark.parametrize("one_call", [True, False], ids=["one-call-step", "layer-by-layer"])
def test_a_gemma3_gguf_matches_transformers_on_its_checkpoint(
    tiny_model, tmp_path, monkeypatch, pattern_array, one_call
):
    """A Gemma 3 GGUF in llama.cpp's layout (each norm's weight stored as 1 + weight; the windowed
    layers as the pattern's integer or one boolean per layer; the global layer's linear RoPE scaling,
    the softcap as its keys) is read as llama.cpp reads it: greedy-identical to transformers' generate
    on the safetensors checkpoint it was written from, with a pool that preempts."""
    monkeypatch.setenv("PAGEDINFER_GGUF_CACHE", str(tmp_path / "cache"))
    steps = count_one_call_steps(monkeypatch)
    if not one_call:
        monkeypatch.setenv("PAGEDINFER_DECODE_STEP", "0")
    path = tiny_model("gemma3_gguf")
    gguf_path = save_gguf(path, tmp_path / "gemma3.gguf", pattern_array=pattern_array)
    llm = LLM(str(gguf_path), block_size=4, num_blocks=8, **ENGINE)
    loaded = llm.engine.loaded
    assert loaded.impl == "pagedinfer" and loaded.model.family.name == "gemma3_text"
    config, theirs = loaded.model.config, json.loads((path / "config.json").read_text())
    for key in (
        "layer_types",
        "sliding_window",
        "query_pre_attn_scalar",
        "final_logit_softcapping",
        "head_dim",
    ):
        assert getattr(config, key) == theirs[key], key
    assert config.rope_parameters == theirs["rope_parameters"]
    assert_greedy_like_transformers(llm, path)
    assert bool(steps) == one_call
    assert llm.stats.preemptions > 0


def test_a_quantized_gemma3_gguf_matches_transformers_on_the_same_file(tiny_model, tmp_path, monkeypatch):
    """A Q8_0 Gemma 3 GGUF (its embedding too: looked up from its panels, scaled by sqrt(hidden) in
    the activations' dtype) kept in its blocks: greedy-identical to transformers' modules on the same
    file (which dequantize every tensor to float32)."""
    monkeypatch.setenv("PAGEDINFER_GGUF_CACHE", str(tmp_path / "cache"))
    path = save_gguf(tiny_model("gemma3_gguf"), tmp_path / "gemma3-q8.gguf", kind_of=lambda name: "Q8_0")
    ours = LLM(str(path), block_size=4, num_blocks=64, **{**ENGINE, "dtype": "auto"})
    assert ours.engine.loaded.impl == "pagedinfer" and "Q8_0" in ours.engine.loaded.dtype_reason
    theirs = LLM(str(path), block_size=4, num_blocks=64, model_impl="transformers", **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ps = [{"prompt_token_ids": p} for p in prompts()]
    want = [o.outputs[0].token_ids for o in theirs.generate(ps, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in ours.generate(ps, params, use_tqdm=False)] == want


def test_a_gemma3_gguf_multiplies_by_its_norms_as_stored(tiny_model, tmp_path, monkeypatch):
    """Each norm's multiplier from the GGUF is the float32 1 + weight the file stores, bit for bit the
    one our layers make of the safetensors checkpoint (the 1 added in float32 at load), multipliers
    under 0.5 and negative ones included."""
    monkeypatch.setenv("PAGEDINFER_GGUF_CACHE", str(tmp_path / "cache"))
    path = tiny_model("gemma3_gguf")
    ours = LLM(str(save_gguf(path, tmp_path / "gemma3.gguf")), **ENGINE).engine.loaded.model
    theirs = LLM(str(path), **ENGINE).engine.loaded.model
    norms = {n: p for n, p in theirs.named_parameters() if "norm" in n}
    assert len(norms) == 4 * 6 + 1
    stored = dict(ours.named_parameters())
    for name, multiplier in norms.items():
        assert torch.equal(stored[name], multiplier), name
    every = torch.cat([m.flatten() for m in norms.values()])
    assert (every < 0.5).any() and (every < 0).any() and (every > 1.5).any()


@pytest.mark.parametrize(
    "keys,why",
    [
        (
            {"attention.sliding_window_pattern": [True, False]},
            "metadata gemma3.attention.sliding_window_pattern is an array of 2 items; it must be one "
            "boolean per layer (4)",
        ),
        (
            {"attention.sliding_window_pattern": "6"},
            "metadata gemma3.attention.sliding_window_pattern is '6'; it must be an integer >= 0 or one "
            "boolean per layer",
        ),
        (
            {"rope.scaling.type": "yarn"},
            "metadata gemma3.rope.scaling.type is 'yarn'; pagedinfer reads Gemma 3 files with none or linear",
        ),
        (
            {"attention.value_length": 32},
            "metadata gemma3.attention.value_length is 32, not key_length's 16: pagedinfer's layers have "
            "one head size",
        ),
    ],
    ids=["pattern-length", "pattern-type", "rope-scaling", "value-length"],
)
def test_a_gemma3_gguf_llama_cpp_reads_otherwise_is_refused(tiny_model, tmp_path, monkeypatch, keys, why):
    """A Gemma 3 file whose keys llama.cpp reads in a way pagedinfer does not follow (a pattern of
    another length or type, YaRN scaling, a value head size of its own): one line, nothing loaded."""
    monkeypatch.setenv("PAGEDINFER_GGUF_CACHE", str(tmp_path / "cache"))
    path = save_gguf(tiny_model("gemma3_gguf"), tmp_path / "gemma3.gguf", keys=keys)
    with pytest.raises(ModelLoadError) as err:
        LLM(str(path), **ENGINE)
    assert str(err.value) == f"{path}: {why}"
