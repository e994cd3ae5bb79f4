"""Prepacked oneDNN linears: same products as nn.Linear, every Linear swapped, tied embeddings intact."""

import pytest
import torch
import transformers as tf
from torch import nn

from pagedinfer.model import packed_linear
from pagedinfer.model.loader import load_model

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN (nothing is packed)"
)


def save_llama(path, layers: int, **extra) -> None:
    """A random Llama whose every weight is at least MIN_WEIGHTS, so every linear is packed."""
    config = tf.LlamaConfig(
        vocab_size=256,
        hidden_size=512,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        bos_token_id=None,
        eos_token_id=None,
        **extra,
    )
    tf.LlamaForCausalLM(config).save_pretrained(path)


def test_packed_linear_matches_linear_for_any_row_count_and_layout():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 96), nn.ReLU(), nn.Linear(96, 40, bias=False))
    weight, bias = model[0].weight.detach().clone(), model[0].bias.detach().clone()
    x = torch.randn(2, 33, 48)
    want = model(x)
    assert packed_linear.can_pack(model)
    assert packed_linear.pack_linears(model) == 0  # too small: oneDNN's call overhead would dominate
    assert packed_linear.pack_linears(model, min_weights=0) == 2
    assert [type(m).__name__ for m in model] == ["PackedLinear", "ReLU", "PackedLinear"]
    torch.testing.assert_close(model(x), want, atol=1e-5, rtol=1e-5)
    for rows in (1, 7, 64, 2048):  # the layout is picked for 2048 rows; every row count works
        xr = torch.randn(rows, 48)
        torch.testing.assert_close(model[0](xr), xr @ weight.T + bias, atol=1e-5, rtol=1e-5)
    strided = torch.randn(48, 5).T  # [5, 48], last dim not contiguous
    torch.testing.assert_close(model[0](strided), strided @ weight.T + bias, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("flags", [[], ["avx512_bf16"]], ids=["avx2", "avx512_bf16"])
def test_which_cpu_models_are_packed(monkeypatch, flags):
    """float32 always; bfloat16 only where the CPU has native bfloat16 instructions; float16 never."""
    monkeypatch.setattr(packed_linear, "cpu_bf16_flags", lambda: flags)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    assert packed_linear.can_pack(nn.Linear(4, 4))
    assert packed_linear.can_pack(nn.Linear(4, 4).to(torch.bfloat16)) == bool(flags)
    assert not packed_linear.can_pack(nn.Linear(4, 4).to(torch.float16))
    assert not packed_linear.can_pack(nn.ReLU())  # no parameters at all


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="oneDNN has no bfloat16 here")
def test_bfloat16_packed_linear_equals_f_linear():
    """A packed bfloat16 weight gives F.linear's products (float32 accumulation, one rounding), at
    batch-1 and batch-64 rows, with a bias; it keeps no plain float32 copy for the gemv kernel."""
    torch.manual_seed(0)
    lin = nn.Linear(320, 96).to(torch.bfloat16)
    packed = packed_linear.PackedLinear(lin, gemv=True)
    assert packed.weight is None
    for rows in (1, 64):
        x = torch.randn(rows, 320).to(torch.bfloat16)
        want = (x.float() @ lin.weight.float().T + lin.bias.float()).bfloat16()
        torch.testing.assert_close(packed(x), want, rtol=2**-7, atol=1e-2)


# linears per layer: transformers' q k v o gate up down; ours fused qkv, o, fused gate_up, down
@pytest.mark.parametrize(("impl", "per_layer"), [("transformers", 7), ("pagedinfer", 4)])
def test_loader_packs_every_linear_and_keeps_tied_embedding(tmp_path, monkeypatch, impl, per_layer):
    torch.manual_seed(1)
    save_llama(tmp_path, layers=2, tie_word_embeddings=True)
    reference = tf.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    loaded = load_model(tmp_path, device="cpu", model_impl=impl).model
    linears = [m for m in loaded.modules() if isinstance(m, nn.Linear)]
    packed = [m for m in loaded.modules() if isinstance(m, packed_linear.PackedLinear)]
    assert linears == [] and len(packed) == 2 * per_layer + 1  # and lm_head
    # the embedding the lookup reads was not released with the unpacked weights
    torch.testing.assert_close(loaded.get_input_embeddings().weight, reference.model.embed_tokens.weight)
    ids = torch.tensor([[5, 9, 2, 77]])
    head = loaded.lm_head(reference.model(ids).last_hidden_state)
    torch.testing.assert_close(
        head, reference.lm_head(reference.model(ids).last_hidden_state), atol=1e-5, rtol=1e-5
    )

    monkeypatch.setenv("PAGEDINFER_PACK_WEIGHTS", "0")
    plain = load_model(tmp_path, device="cpu", model_impl=impl).model
    assert not any(isinstance(m, packed_linear.PackedLinear) for m in plain.modules())


def test_weight_shared_by_two_linears_survives_packing():
    """The pages of a weight are released only once every linear using it is packed."""
    torch.manual_seed(2)
    first, second = nn.Linear(512, 256, bias=False), nn.Linear(512, 256, bias=False)
    second.weight = first.weight  # tied, as some checkpoints tie projections
    model = nn.Sequential(first, second)
    x = torch.randn(3, 512)
    want = x @ first.weight.detach().T
    assert packed_linear.pack_linears(model) == 2
    torch.testing.assert_close(model[0](x), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model[1](x), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("k", "n", "bias"), [(576, 960, False), (37, 13, True), (1536, 70, True)])
def test_small_batches_take_the_matrix_vector_kernel_with_the_same_products(monkeypatch, k, n, bias):
    """1-8 rows go through cpu_gemv.c (every tile shape: 1 row, 2, 3, 3 + 1 ...; k and n not multiples
    of the vector width or tile), more rows through oneDNN; both equal a float64 product."""
    torch.manual_seed(3)
    lin = nn.Linear(k, n, bias=bias)
    gemv, packed = packed_linear.PackedLinear(lin, gemv=True), packed_linear.PackedLinear(lin)
    assert gemv.weight is not None and packed.weight is None  # the plain copy exists only when asked
    lib, calls = packed_linear._gemv_library(), []
    kernel = lib.gemv_f32
    monkeypatch.setattr(lib, "gemv_f32", lambda *a: calls.append(a[4]) or kernel(*a))  # a[4]: rows
    for rows in (*range(1, packed_linear.GEMV_MAX_ROWS + 2), 33):
        x = torch.randn(2, rows, k)[1]  # a batch of rows, as a view into a bigger tensor
        want = x.double() @ lin.weight.detach().double().T + (lin.bias.detach().double() if bias else 0)
        got = gemv(x)
        assert got.shape == (rows, n)
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(packed(x).double(), want, atol=1e-4, rtol=1e-5)
    assert calls == list(range(1, packed_linear.GEMV_MAX_ROWS + 1))  # 9 and 33 rows: oneDNN
    assert gemv(torch.randn(3, 1, k)).shape == (3, 1, n)  # leading dimensions are kept


def test_loader_keeps_plain_weights_for_the_kernel_while_they_fit(tmp_path, monkeypatch):
    """By default the plain copies are kept on AVX2 CPUs while they fit in a share of free memory,
    never on AVX-512 ones (oneDNN is as fast there); the environment variable forces them on or off."""
    torch.manual_seed(4)
    save_llama(tmp_path, layers=1)

    def copies() -> list[bool]:
        model = load_model(tmp_path, device="cpu").model
        return [m.weight is not None for m in model.modules() if isinstance(m, packed_linear.PackedLinear)]

    monkeypatch.setattr(packed_linear, "cpu_flags", lambda names: [])  # an AVX2 CPU
    assert copies() == [True] * 5  # 3 MB of weights: they fit
    monkeypatch.setattr(packed_linear, "GEMV_MEMORY_SHARE", 0.0)  # as if the model filled the memory
    assert copies() == [False] * 5
    monkeypatch.setenv("PAGEDINFER_SMALL_BATCH_GEMV", "1")
    assert copies() == [True] * 5
    monkeypatch.undo()
    monkeypatch.setattr(packed_linear, "cpu_flags", lambda names: [n for n in names if n == "avx512f"])
    assert copies() == [False] * 5  # an AVX-512 CPU, though the copies would fit
    monkeypatch.setenv("PAGEDINFER_SMALL_BATCH_GEMV", "1")
    assert copies() == [True] * 5
    monkeypatch.setenv("PAGEDINFER_SMALL_BATCH_GEMV", "0")
    assert copies() == [False] * 5
