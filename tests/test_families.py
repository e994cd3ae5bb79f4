"""The family declarations (model/families): each consistent and named as llama.cpp names its tensors,
each family served by our layers as transformers generates, its GGUF rows put back as llama.cpp's
converter permuted them, a model of no declared family refused by name, a new dense family one
declaration; and the runner, not the model, choosing which path a step takes."""

from dataclasses import replace
from pathlib import Path

import gguf as gguf_py
import numpy as np
import pytest
import torch
from conftest import ENGINE
from gguf_models import save_gguf
from models import count_one_call_steps, hf_greedy
from safetensors.torch import load_file
from transformers import AutoConfig

from pagedinfer import LLM, SamplingParams
from pagedinfer.model import families, gguf
from pagedinfer.model.decode_step import OneCall
from pagedinfer.model.families.spec import DIMS, LINEAR_ROLES, NORM_ROLES, PLACED_NORMS
from pagedinfer.model.loader import ModelLoadError
from pagedinfer.model.validate import ModelCheckError

FAMILIES = {f.name: f for f in families.FAMILIES}
DENSE = [name for name, f in FAMILIES.items() if f.experts is None]  # (mixtures of experts: test_moe.py)
PROMPTS = [[5, 9, 200, 3, 17, 41, 8, 99, 12, 60, 2, 7], [250, 1, 33]]  # the longer one past mistral's window


def greedy_equals_transformers(llm: LLM, path: Path, max_tokens: int = 10) -> None:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, max_tokens)


@pytest.fixture
def family_gguf(tiny_model, model_root, tmp_path, monkeypatch):
    """The float32 GGUF of a family's tiny model (written once, as llama.cpp's converter names and
    orders its tensors), opened through a cache folder of this test's own."""
    monkeypatch.setenv("PAGEDINFER_GGUF_CACHE", str(tmp_path / "cache"))

    def opened(name: str) -> gguf.GGUFCheckpoint:
        out = model_root / f"{name}-family.gguf"
        if not out.exists():
            save_gguf(tiny_model(name), out)
        return gguf.open_checkpoint(out)

    return opened


@pytest.mark.parametrize("name", FAMILIES)
def test_a_declaration_names_each_role_with_its_own_modules(name):
    family = FAMILIES[name]
    stems = [m.hf for m in family.layer]
    assert len(set(stems)) == len(stems) and len({m.gguf for m in family.layer}) == len(stems)
    experts = family.experts
    # the order a layer runs them (a mixture of experts: its experts in place of gate_up and down,
    # which remain where the config can make layers dense)
    assert list(family.linears) == list(LINEAR_ROLES[: 2 if experts and not experts.dense_layers else 4])
    assert set(PLACED_NORMS[family.norm_placement]) <= set(family.norms) <= set(NORM_ROLES)
    used = [m for modules in family.linears.values() for m in modules] + list(family.norms.values())
    if experts:
        used += experts.modules()
        assert {m.hf for m in family.layer if m.experts or m.stacked} == {*experts.gate_up, experts.down}
    if family.sinks is not None:
        used.append(family.sinks)
    assert sorted(used) == sorted(stems)  # every module fills one role, and only one
    assert set(family.gguf_permuted) <= set(family.linears["qkv"])
    assert all(d in DIMS for m in (*family.top, *family.layer) for d in m.shape)
    assert family.qk_norm == ("q_norm" in family.norms) == ("k_norm" in family.norms)


def test_each_model_type_has_one_family():
    types = [t for f in families.FAMILIES for t in f.model_types]
    assert len(types) == len(set(types))
    assert (
        families.names()
        == "llama, mistral, qwen2, qwen3, olmo2, granite, phi3, gemma3_text, qwen3_moe, qwen2_moe, mixtral, olmoe, "
        "gpt_oss"
    )


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_gguf_names_are_llama_cpps(name):
    """Each module's GGUF name is the one gguf-py (llama.cpp's own name table) gives its Hugging Face
    name for the family's architecture, in layer 0 and in layer 11 (a module per expert: the name of
    its 3-D tensor of every expert, gguf-py's name for the module without the expert's index), as its
    GGUF files lay them out (`Family.gguf_layout`: gpt-oss's experts apart, not stacked). The
    dense MLP of a mixture of experts' dense layers, which llama.cpp's architecture has no tensor for
    (its files have none: their configs make no layer dense), takes llama's names."""
    family = FAMILIES[name].gguf_layout or FAMILIES[name]

    def table(arch_name: str):
        arch = next(k for k, v in gguf_py.MODEL_ARCH_NAMES.items() if v == arch_name)
        return gguf_py.get_tensor_name_map(arch, 12)

    own, llama = table(family.gguf_arch), table("llama")
    dense = {m for r in ("gate_up", "down") for m in family.linears.get(r, ())} if family.experts else set()
    for m in family.top:
        assert own.get_name(m.hf) == m.gguf
    for i in (0, 11):
        for m in family.layer:
            hf = f"model.layers.{i}.{m.hf.replace('.{}', '')}"
            got = (llama if m.hf in dense else own).get_name(hf)
            assert got == f"blk.{i}.{m.gguf}", m.hf
            assert m.hf not in dense or own.get_name(hf) is None, m.hf


@pytest.mark.parametrize("name", DENSE)
def test_each_family_is_served_by_our_layers_as_transformers_generates(tiny_model, monkeypatch, name):
    """A saved model of each declared family: our layers built by its declaration, greedy-equal to
    transformers' generate, its decode-only steps through the one-call C step."""
    path = tiny_model(name)
    steps = count_one_call_steps(monkeypatch)
    llm = LLM(str(path), block_size=4, num_blocks=64, model_impl="pagedinfer", **ENGINE)
    assert llm.engine.loaded.model.family is FAMILIES[name]
    greedy_equals_transformers(llm, path)
    assert len(steps) >= 9  # the decode-only steps


def test_a_model_of_no_declared_family_is_refused_naming_the_declared_ones(tiny_model):
    """gemma2 is a dense decoder too, but its softcapped attention scores and layer pattern are no
    declared layer: transformers serves it, and our layers, asked for, refuse it in one line naming the families
    they have."""
    path = tiny_model("gemma2")
    assert families.find(AutoConfig.from_pretrained(path)) is None
    assert LLM(str(path), **ENGINE).engine.loaded.impl == "transformers"
    with pytest.raises(ModelLoadError) as err:
        LLM(str(path), model_impl="pagedinfer", **ENGINE)
    assert str(err.value) == (
        f"model implementation 'pagedinfer' cannot serve {str(path)!r}: model family 'gemma2' has no "
        "pagedinfer implementation (llama, mistral, qwen2, qwen3, olmo2, granite, phi3, gemma3_text, "
        "qwen3_moe, qwen2_moe, mixtral, olmoe, gpt_oss do)"
    )


@pytest.mark.parametrize("name", DENSE)
def test_the_gguf_reader_puts_back_the_rows_llama_cpp_permuted(tiny_model, family_gguf, name):
    """A family's GGUF reads back to its checkpoint's own tensors, bit for bit: the rows llama.cpp's
    converter interleaved (Q and K of the llama architecture, mistral's and granite's included) put back by the
    declaration's ``gguf_permuted``, every other tensor as stored (Gemma 3's norms as their multipliers,
    1 + weight, which its files store)."""
    family, ckpt = FAMILIES[name], family_gguf(name)
    path = tiny_model(name)
    offset = family.norm_weight_offset
    want = {
        k: v + offset if offset and k.endswith("norm.weight") else v
        for k, v in load_file(path / "model.safetensors").items()
    }
    sd, dequantized = gguf.state_dict(ckpt, AutoConfig.from_pretrained(path), family, keep_blocks=False)
    assert sorted(sd) == sorted(want) and not dequantized
    assert all(torch.equal(sd[k], want[k]) for k in want)
    stored = {gguf.hf_names(family)(i.name)[0]: ckpt.raw(i).view(np.float32) for i in ckpt.tensors.values()}
    moved = {k for k in want if not np.array_equal(stored[k].reshape(want[k].shape), want[k].numpy())}
    layers = range(AutoConfig.from_pretrained(path).num_hidden_layers)
    qk = {f"model.layers.{i}.self_attn.{m}_proj.weight" for i in layers for m in "qk"}
    assert moved == (qk if family.gguf_permuted else set())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bfloat16_tensors_are_read_as_stored(tiny_model, tmp_path, monkeypatch, dtype):
    """A BF16 GGUF's tensors (read without a float32 copy of the model) are the checkpoint's values
    rounded to bfloat16, bit for bit, in the run's dtype: Q and K rows put back, as gguf-py's float32
    dequantization gives them."""
    monkeypatch.setenv("PAGEDINFER_GGUF_CACHE", str(tmp_path / "cache"))
    path = tiny_model("llama")
    ckpt = gguf.open_checkpoint(save_gguf(path, tmp_path / "llama-bf16.gguf", kind_of=lambda _: "BF16"))
    assert ckpt.kinds() == {"BF16": 16}
    sd, dequantized = gguf.state_dict(
        ckpt, AutoConfig.from_pretrained(path), FAMILIES["llama"], keep_blocks=False, dtype=dtype
    )
    want = load_file(path / "model.safetensors")
    assert sorted(sd) == sorted(want) and dequantized == {"BF16": 16}
    for name, w in want.items():
        rounded = w.to(torch.bfloat16).to(dtype) if w.dim() == 2 else w.to(dtype)
        assert sd[name].dtype == dtype and torch.equal(sd[name], rounded), name


def test_a_gguf_of_another_architecture_is_refused_by_name(family_gguf):
    """The names and row order a declaration gives are its architecture's: a file of another is
    refused in one line, not read as garbage."""
    ckpt = family_gguf("qwen2")
    with pytest.raises(ModelCheckError) as err:
        gguf.tensor_index(ckpt, FAMILIES["llama"])
    assert str(err.value) == (
        f"{ckpt.path}: its architecture is 'qwen2'; pagedinfer reads llama GGUF files of architecture 'llama'"
    )


def test_the_gguf_reader_maps_names_by_the_declaration():
    llama, qwen3 = gguf.hf_names(FAMILIES["llama"]), gguf.hf_names(FAMILIES["qwen3"])
    name, module = llama("blk.17.attn_q.bias")
    assert name == "model.layers.17.self_attn.q_proj.bias" and module.gguf == "attn_q"
    assert llama("output.weight")[0] == "lm_head.weight"
    assert llama("rope_freqs.weight") is None and llama("blk.0.attn_q.scale") is None
    assert llama("blk.0.attn_q_norm.weight") is None  # not a llama tensor: left unread
    assert qwen3("blk.0.attn_q_norm.weight")[0] == "model.layers.0.self_attn.q_norm.weight"


# a new dense family: one declaration (its class's config defaults not listed: transformers reads it)
MINISTRAL = replace(families.MISTRAL, model_types=("ministral",), config_defaults={})


def test_a_new_dense_family_is_one_declaration(tiny_model, monkeypatch):
    """transformers' ministral (Mistral's layer, a window per layer type) has no declaration here:
    transformers serves it. Declared (the one line above), our layers serve it, greedy-equal to
    transformers, its decode-only steps through the one-call C step."""
    path = tiny_model("ministral")
    assert LLM(str(path), **ENGINE).engine.loaded.impl == "transformers"
    monkeypatch.setattr(families, "FAMILIES", (*families.FAMILIES, MINISTRAL))
    steps = count_one_call_steps(monkeypatch)
    llm = LLM(str(path), block_size=4, num_blocks=64, model_impl="pagedinfer", **ENGINE)
    assert llm.engine.loaded.model.family is MINISTRAL
    greedy_equals_transformers(llm, path)
    assert len(steps) >= 9  # the decode-only steps


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"norm": "rms_1p"}, "norm 'rms_1p' (pagedinfer's implementation has rms only)"),
        ({"rope": "interleaved"}, "RoPE 'interleaved' (pagedinfer's implementation has half only)"),
        (  # Gemma's field, which this config lacks: the declared default is read
            {"activation": ("hidden_activation", "gelu")},
            "activation 'gelu' (pagedinfer's implementation has silu, gelu_pytorch_tanh only)",
        ),
    ],
)
def test_a_kind_our_layers_do_not_compute_leaves_the_family_to_transformers(
    tiny_model, monkeypatch, change, reason
):
    monkeypatch.setattr(families, "FAMILIES", (replace(MINISTRAL, **change),))
    path = tiny_model("ministral")
    assert LLM(str(path), **ENGINE).engine.loaded.impl == "transformers"
    with pytest.raises(ModelLoadError) as err:
        LLM(str(path), model_impl="pagedinfer", **ENGINE)
    assert str(err.value) == f"model implementation 'pagedinfer' cannot serve {str(path)!r}: {reason}"


def test_the_runner_chooses_the_path_and_the_model_follows(tiny_model, monkeypatch):
    """The one-call C step for a step of our layers without adapter rows, where every linear is in
    the panels and each sequence has at most `MAX_QUERY_ROWS` rows (short prompt chunks too); a step
    with adapter rows, or transformers' modules run without it. The model takes the path it is given: the same decode step layer by layer gives the
    same bits."""
    from pagedinfer.model import packed_linear

    monkeypatch.setattr(packed_linear, "MIN_WEIGHTS", 0)
    monkeypatch.setenv("PAGEDINFER_CPU_GEMM", "panels")
    path = tiny_model("qwen3")
    runner = LLM(str(path), block_size=4, num_blocks=16, model_impl="pagedinfer", **ENGINE).engine.runner
    other = LLM(str(path), block_size=4, num_blocks=16, model_impl="transformers", **ENGINE).engine.runner

    class Seq:
        def __init__(self, ids: list[int], blocks: list[int]) -> None:
            self.token_ids, self.block_tables, self.lora_slot = ids, [blocks], 0

    class Chunk:
        def __init__(self, seq: Seq, start: int, num_tokens: int) -> None:
            self.seq, self.start, self.num_tokens, self.num_logits = seq, start, num_tokens, 1
            self.step_token_ids = seq.token_ids[start : start + num_tokens]  # no drafted tokens

    seqs = [Seq([3, 14, 15, 92, 65], [0, 1]), Seq([35, 89, 79], [2])]
    prefill = [Chunk(s, 0, len(s.token_ids) - 1) for s in seqs]
    decode = [Chunk(s, len(s.token_ids) - 1, 1) for s in seqs]
    _, _, prefill_meta = runner.build_metadata(prefill)
    ids, positions, meta = runner.build_metadata(decode)
    assert isinstance(runner.one_call(prefill_meta, lora=False), OneCall)  # chunks of at most MAX_QUERY_ROWS
    assert runner.one_call(meta, lora=True) is None
    assert other.one_call(meta, lora=False) is None
    assert isinstance(runner.one_call(meta, lora=False), OneCall)
    runner.execute(prefill, [])  # the prompts' K/V in the pool
    kv = {i: (k.clone(), runner.kv.v[i].clone()) for i, k in runner.kv.k.items()}
    one_call = runner.run_model(ids, positions, meta, 0)
    for i, (k, v) in kv.items():  # the pool as before the decode step: it writes the same slots again
        runner.kv.k[i].copy_(k)
        runner.kv.v[i].copy_(v)
    monkeypatch.setattr(runner, "one_call", lambda meta, lora: None)
    assert torch.equal(runner.run_model(ids, positions, meta, 0), one_call)
