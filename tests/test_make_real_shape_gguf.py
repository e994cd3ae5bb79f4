"""scripts/make_real_shape_gguf.py at a tiny shape (OLMoE's, Gemma 3's): the file it writes is one our
GGUF reader reads and the family's declaration accepts (our layers run it), its blocks of the type asked
for with weights of the intended spread, the same bytes from the same seed, and a borrowed tokenizer
padded to the vocabulary; scripts/bench_llamacpp.py's --gguf takes the file's type from it. The real
shapes: their published parameter counts."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import transformers as tf
from conftest import ENGINE
from models import CONFIGS

from pagedinfer import LLM, SamplingParams
from pagedinfer.model import gguf

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def make():
    sys.path.insert(0, str(ROOT / "scripts"))
    import make_real_shape_gguf

    yield make_real_shape_gguf
    sys.path.remove(str(ROOT / "scripts"))


@pytest.fixture
def gguf_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDINFER_GGUF_CACHE", str(tmp_path / "cache"))


def test_the_real_shape_is_olmoe_1b_7b(make):
    config = make.real_config("olmoe")
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (2048, 16, 16)
    assert (config.num_experts, config.num_experts_per_tok, config.intermediate_size) == (64, 8, 1024)
    assert (config.vocab_size, config.norm_topk_prob, config.tie_word_embeddings) == (50304, False, False)
    count = sum(int(np.prod(shape)) for _, shape, _ in make.tensors(config))
    assert 6.9e9 < count < 7.0e9  # OLMoE-1B-7B's 6.92B parameters


@pytest.mark.parametrize("kind", ["Q4_0", "Q8_0"])
def test_a_tiny_file_is_read_by_our_loader_and_runs_on_our_layers(make, tmp_path, gguf_cache, kind):
    config = CONFIGS["olmoe"]()  # hidden 64, 2 layers, 8 experts of 32 rows, top 2, vocabulary 256
    out = make.write(config, tmp_path / "olmoe.gguf", kind, seed=3)
    ckpt = gguf.open_checkpoint(out)
    tensors = ckpt.tensors
    assert (tensors["token_embd.weight"].kind, tensors["blk.1.ffn_gate_inp.weight"].kind) == ("F32", "F32")
    assert {
        tensors[n].kind for n in ("blk.0.attn_q.weight", "blk.1.ffn_down_exps.weight", "output.weight")
    } == {kind}
    assert tensors["blk.0.ffn_up_exps.weight"].shape == [8, 32, 64]  # llama.cpp's 3-D layout
    assert tensors["blk.0.attn_k_norm.weight"].shape == [32]  # over all of k's rows: 2 heads of 16
    read = tf.AutoConfig.from_pretrained(ckpt.folder)
    assert (read.model_type, read.num_experts, read.num_experts_per_tok) == ("olmoe", 8, 2)
    experts = gguf._dequantized(ckpt.raw(tensors["blk.0.ffn_gate_exps.weight"]).reshape(-1), kind)
    assert 0.015 < float(experts.std()) < 0.025  # the drawn scales give about WEIGHT_STD
    llm = LLM(str(out), block_size=4, num_blocks=64, **ENGINE)
    assert llm.engine.loaded.impl == "pagedinfer" and llm.engine.loaded.model.family.name == "olmoe"
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    got = llm.generate([{"prompt_token_ids": [5, 9, 200, 17]}], params, use_tqdm=False)
    assert len(got[0].outputs[0].token_ids) == 6
    again = make.write(config, tmp_path / "again.gguf", kind, seed=3)
    other = make.write(config, tmp_path / "other.gguf", kind, seed=4)
    assert out.read_bytes() == again.read_bytes() != other.read_bytes()


def test_the_real_shape_of_gemma3_is_gemma_3_1b(make):
    config = make.real_config("gemma3")
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (1152, 26, 6912)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 1, 256)
    assert (config.vocab_size, config.sliding_window, config.query_pre_attn_scalar) == (262144, 512, 256)
    assert [i for i, t in enumerate(config.layer_types) if t == "full_attention"] == [5, 11, 17, 23]
    rope = config.rope_parameters
    assert (rope["full_attention"]["rope_theta"], rope["sliding_attention"]["rope_theta"]) == (1e6, 1e4)
    tensors = make.tensors(config)
    assert config.tie_word_embeddings and "output.weight" not in [name for name, _, _ in tensors]
    count = sum(int(np.prod(shape)) for _, shape, _ in tensors)
    assert count == 999_885_952  # google/gemma-3-1b's 1.0B parameters, to the one


@pytest.mark.parametrize("kind", ["Q4_0", "BF16"])
def test_a_tiny_gemma3_file_is_read_by_our_loader_and_runs_on_our_layers(make, tmp_path, gguf_cache, kind):
    config = CONFIGS["gemma3_gguf"]()  # hidden 64, 4 layers (layer 2 global), heads of 16, softcap
    config.tie_word_embeddings = True  # as Gemma-3-1B's: the embedding is the output matrix
    out = make.write(config, tmp_path / "gemma3.gguf", kind, seed=3)
    ckpt = gguf.open_checkpoint(out)
    tensors = ckpt.tensors
    assert "output.weight" not in tensors
    assert {
        tensors[n].kind for n in ("token_embd.weight", "blk.0.attn_q.weight", "blk.3.ffn_down.weight")
    } == {kind}
    norm = tensors["blk.2.post_ffw_norm.weight"]
    assert norm.kind == "F32" and (ckpt.raw(norm).view(np.float32) == 1.0).all()  # stored 1 + weight 0
    read = tf.AutoConfig.from_pretrained(ckpt.folder)
    assert (read.model_type, read.head_dim, read.sliding_window) == ("gemma3_text", 16, 8)
    assert read.layer_types == config.layer_types
    assert (read.final_logit_softcapping, read.tie_word_embeddings) == (3.0, True)
    up = gguf._dequantized(ckpt.raw(tensors["blk.0.ffn_up.weight"]).reshape(-1), kind)
    assert 0.015 < float(up.std()) < 0.025  # the drawn scales or values give about WEIGHT_STD
    llm = LLM(str(out), block_size=4, num_blocks=64, **ENGINE)
    assert llm.engine.loaded.impl == "pagedinfer" and llm.engine.loaded.model.family.name == "gemma3_text"
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    got = llm.generate([{"prompt_token_ids": [5, 9, 200, 17]}], params, use_tqdm=False)
    assert len(got[0].outputs[0].token_ids) == 6
    assert out.read_bytes() == make.write(config, tmp_path / "again.gguf", kind, seed=3).read_bytes()


def _tokenizer_source(path: Path) -> Path:
    """A GGUF holding only a four-token byte-pair tokenizer (llama.cpp's gpt2 model)."""
    import gguf as gguf_py

    writer = gguf_py.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(["<|endoftext|>", "a", "b", "ab"])
    writer.add_token_types([3, 1, 1, 1])
    writer.add_token_merges(["a b"])
    writer.add_eos_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("name", ["olmoe", "gemma3_gguf"])
def test_a_borrowed_tokenizer_is_padded_to_the_vocabulary(make, tmp_path, gguf_cache, capfd, name):
    """The borrowed tokens padded to the vocabulary, no more: under a gemma3 file too, whose tokenizer
    class (GemmaTokenizer) adds its ``<mask>`` where the file's list lacks it (then one token past the
    embedding's rows, and a warning of it), left out as llama.cpp's vocabulary has none."""
    source = _tokenizer_source(tmp_path / "tok.gguf")
    out = make.write(CONFIGS[name](), tmp_path / f"{name}.gguf", "Q4_0", tokenizer=source)
    from pagedinfer.model.gguf_header import read

    meta = read(out).metadata
    tokens = meta["tokenizer.ggml.tokens"].items
    assert len(tokens) == 256 and tokens[:4] == ["<|endoftext|>", "a", "b", "ab"]
    assert tokens[4] == "<|unused_4|>" and tokens[255] == "<|unused_255|>"
    assert list(meta["tokenizer.ggml.token_type"].items[3:6]) == [1, make.UNUSED, make.UNUSED]
    assert meta["tokenizer.ggml.merges"].items == ["a b"]
    tokenizer = LLM(str(out), block_size=4, num_blocks=64, **ENGINE).get_tokenizer()
    assert len(tokenizer) == 256 and tokenizer.encode("ab", add_special_tokens=False) == [3]
    assert "<mask>" not in tokenizer.get_vocab() and "its tokenizer has" not in capfd.readouterr().err


def test_bench_llamacpp_runs_the_file_in_its_own_type(make, tmp_path, capsys):
    out = make.write(CONFIGS["olmoe"](), tmp_path / "olmoe.gguf", "Q8_0")
    import bench_llamacpp

    args = bench_llamacpp.parse_args(["--gguf", str(out)])
    assert (args.formats, args.dtypes) == ("Q8_0", "Q8_0") and bench_llamacpp.gguf_vocab(out) == 256
    assert bench_llamacpp.parse_args(["--gguf", str(out), "--dtypes", "Q8_0:bfloat16"]).formats == "Q8_0"
    with pytest.raises(SystemExit) as e:
        bench_llamacpp.parse_args(["--gguf", str(out), "--dtypes", "float32,Q8_0"])
    assert e.value.code == 2
    want = f"--gguf {out} holds Q8_0: no float32 to run (its systems run the files themselves)"
    assert want in capsys.readouterr().err
