"""Packed CPU linears (oneDNN's layout or cpu_gemm.c's panels): same products as nn.Linear, every Linear
swapped, tied embeddings intact, the panel kernel chosen per CPU."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers as tf
from torch import nn

from pagedinfer.kernels.build import cpu_flags
from pagedinfer.model import packed_linear
from pagedinfer.model.fused_ops import GatedLinear
from pagedinfer.model.loader import load_model

REPO = Path(__file__).resolve().parent.parent
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
    assert packed_linear.pack_linears(model, panels=False) == 0  # too small for oneDNN's call overhead
    assert packed_linear.pack_linears(model) == 2  # the panels take every linear (row-independent bits)
    assert [type(m).__name__ for m in model] == ["PackedLinear", "ReLU", "PackedLinear"]
    torch.testing.assert_close(model(x), want, atol=1e-5, rtol=1e-5)
    for rows in (1, 7, 64, 2048):  # the layout is picked for 2048 rows; every row count works
        xr = torch.randn(rows, 48)
        torch.testing.assert_close(model[0](xr), xr @ weight.T + bias, atol=1e-5, rtol=1e-5)
    strided = torch.randn(48, 5).T  # [5, 48], last dim not contiguous
    torch.testing.assert_close(model[0](strided), strided @ weight.T + bias, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("flags", [[], ["avx512_bf16"]], ids=["avx2", "avx512_bf16"])
def test_which_cpu_models_are_packed(monkeypatch, flags):
    """float32 always; bfloat16 on the panels on every CPU, and (where the panels did not build) on
    oneDNN only where the CPU has native bfloat16 instructions; float16 never."""
    monkeypatch.setattr(packed_linear, "cpu_bf16_flags", lambda: flags)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    assert packed_linear.can_pack(nn.Linear(4, 4))
    assert packed_linear.can_pack(nn.Linear(4, 4).to(torch.bfloat16))
    assert not packed_linear.can_pack(nn.Linear(4, 4).to(torch.float16))
    assert not packed_linear.can_pack(nn.ReLU())  # no parameters at all
    monkeypatch.setattr(packed_linear, "panel_dtype", lambda dtype, k: dtype == torch.float32)  # no panels
    assert packed_linear.can_pack(nn.Linear(4, 4).to(torch.bfloat16)) == bool(flags)


def test_a_bfloat16_linear_the_panels_cannot_take_stays_with_torch_without_native_bfloat16(monkeypatch):
    """An odd input width (the panels read x in pairs) on a CPU without native bfloat16 instructions:
    oneDNN would emulate them, so that linear stays an nn.Linear; the others take the panels."""
    monkeypatch.setattr(packed_linear, "cpu_bf16_flags", lambda: [])
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(37, 16)).to(torch.bfloat16)
    assert packed_linear.pack_linears(model) == 1
    assert [type(m).__name__ for m in model] == ["PackedLinear", "Linear"]
    assert model[0].kinds == ["BF16"]


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="oneDNN has no bfloat16 here")
@pytest.mark.parametrize("panels", [False, True], ids=["onednn", "panels"])
def test_bfloat16_packed_linear_equals_f_linear(panels):
    """A packed bfloat16 weight gives F.linear's products (float32 accumulation, one rounding), at
    batch-1 and batch-64 rows, with a bias: in oneDNN's layout, and in cpu_gemm.c's pair panels."""
    torch.manual_seed(0)
    lin = nn.Linear(320, 96).to(torch.bfloat16)
    packed = packed_linear.PackedLinear(lin, panels=panels)
    assert (packed.segments is not None) == panels
    assert (packed.packed is None) == panels
    for rows in (1, 64):
        x = torch.randn(rows, 320).to(torch.bfloat16)
        want = (x.float() @ lin.weight.float().T + lin.bias.float()).bfloat16()
        torch.testing.assert_close(packed(x), want, rtol=2**-7, atol=1e-2)


@pytest.mark.parametrize(
    ("k", "n", "bias", "gated"),
    [
        (576, 960, False, False),
        (64, 70, True, False),
        (576, 1536, False, True),
        (64, 34, True, True),
        (40, 50, True, False),
    ],
)
def test_bfloat16_panel_kernel_for_any_row_count(k, n, bias, gated):
    """The pair panels against float32 products of the same bfloat16 values, rounded once as a
    bfloat16 linear rounds (gated: gate and up rounded, silu(gate) rounded, then the product): every
    row tile (1-12 rows and their remainders; from 8 rows AMX tiles where the kernel has them, of up
    to 32 rows by 2 panels, except for an ``in`` not a multiple of 32: 40), row blocks (300 and 301
    rows), a partial last panel, a bias, each row with the bits it has in any other row count. An odd
    ``in`` (x is read in pairs) stays with oneDNN (or torch, `pack_linears`)."""
    torch.manual_seed(6)
    lin = (GatedLinear if gated else nn.Linear)(k, n, bias=bias).to(torch.bfloat16)
    panels = packed_linear.PackedLinear(lin, panels=True)
    assert panels.packed is None and panels.segments[0].panels.shape == (-(-n // 16), k, 16)
    w = lin.weight.detach().float()
    big = torch.randn(301, k).to(torch.bfloat16)
    whole = panels(big)  # [301, n]: tiles of 6 rows by 4 panels
    for rows in (*range(1, 14), 24, 25, 300, 301):
        x = torch.randn(rows, k).to(torch.bfloat16)
        y = x.float() @ w.T + (lin.bias.detach().float() if bias else 0)  # [rows, n]
        if gated:
            gate, up = y[:, : n // 2].bfloat16().float(), y[:, n // 2 :].bfloat16().float()
            y = torch.nn.functional.silu(gate).bfloat16().float() * up
        torch.testing.assert_close(panels(x), y.bfloat16(), rtol=2**-7, atol=2e-2)
        # every tile shape gives a row the same bits: batch-invariant
        assert torch.equal(panels(big[:rows]), whole[:rows]), rows
        assert torch.equal(panels(big[rows - 1 : rows]), whole[rows - 1 : rows]), rows
    with pytest.raises(TypeError, match="input is torch.float32"):
        panels(torch.randn(2, k))  # never read as bfloat16 bits
    assert not packed_linear.panel_dtype(torch.bfloat16, 37)


def vdpbf16ps_sums(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # [R, K], [N, K] bfloat16 -> [R, N]
    """x @ w.T as vdpbf16ps sums it, in torch: for each pair kp, acc += x[2kp + 1] w[2kp + 1], then
    acc += x[2kp] w[2kp]; each product exact (so one float32 addition rounds as the fused step does,
    for products in float32's normal range), subnormal inputs and sums flushed to zeros of their sign."""

    def flush(t: torch.Tensor) -> torch.Tensor:
        return torch.where(t.abs() < torch.finfo(torch.float32).tiny, t * 0, t)

    xf, wf = flush(x.float()), flush(w.float())
    acc = torch.zeros(x.shape[0], w.shape[0])
    for kp in range(x.shape[1] // 2):
        for i in (2 * kp + 1, 2 * kp):
            acc = flush(acc + xf[:, i : i + 1] * wf[:, i])  # [R, 1] * [N] -> [R, N]
    return acc


@pytest.mark.parametrize("bias", [False, True], ids=["plain", "bias"])
def test_bfloat16_panels_take_the_vdpbf16ps_steps(bias):
    """The pair panels' float32 sums are vdpbf16ps' (native, or emulated where the kernel has no
    AVX512-BF16) on every row tile (1-13 rows, a partial last panel): the odd k of each pair first
    (row 1 sums to 4 so, to 3 the other way round), subnormal inputs treated as zero, and a sum that
    cancels to a subnormal flushed to zero (row 0; float32 arithmetic would keep 2^-133). k is no
    multiple of 32, so no AMX tile takes them."""
    torch.manual_seed(9)
    k, n = 48, 40
    lin = nn.Linear(k, n, bias=bias).to(torch.bfloat16)
    w = lin.weight.detach()  # [N, K]
    w.view(-1)[::29] = 1e-39  # subnormal in bfloat16 too
    w[:, :6] = torch.tensor([2.0, 2.0**12, -(2.0**12), 1.0, 2.0**-26, -(2.0**-26)])
    panels = packed_linear.PackedLinear(lin, panels=True)
    assert panels.kinds == ["BF16"]
    for rows in range(1, 14):
        x = torch.randn(rows, k).to(torch.bfloat16)
        x.view(-1)[::11] = -1e-39
        x[0] = 0
        x[0, 4:6] = torch.tensor([2.0**-100, 2.0**-100 * (1 + 2.0**-7)])  # -2^-126 (1 + 2^-7) + 2^-126
        if rows > 1:  # 2^24 + 2, then + 1 (a tie, to 2^24 + 4), then - 2^24
            x[1] = 0
            x[1, :4] = torch.tensor([1.0, 2.0**12, 2.0**12, 1.0])
        sums = vdpbf16ps_sums(x, w)
        assert sums[0, 0] == 0 and (rows == 1 or sums[1, 0] == 4)
        want = (sums + (lin.bias.detach().float() if bias else 0)).bfloat16()
        assert torch.equal(panels(x), want), f"{rows} rows"


def test_every_kernel_build_gives_the_same_bits(tmp_path):
    """The kernels built for AVX-512 with vdpbf16ps, for AVX-512 without it and for AVX2 (on a CPU that
    runs all three) give the same bits: bfloat16 panels (every tile shape, partial panels, bias, SiLU x
    up), int8 and int4 panels under bfloat16 activations, and the RMSNorm chains (float32 and
    bfloat16 rows, Qwen3's per-head norms), whose sums of squares are taken in a fixed order."""
    builds = {"": "avx512f"}
    if cpu_flags(("avx512_bf16",)):
        builds["-mno-avx512bf16"] = "avx512_bf16"
    if cpu_flags(("avx512f",)):
        builds["-mno-avx512f"] = "avx512f"
    if len(builds) == 1:
        pytest.skip("this CPU has no AVX-512: the suite's kernels are the AVX2 build already")
    script = tmp_path / "bits.py"
    script.write_text(
        """
import sys, torch
from torch import nn
from pagedinfer.config import QUANTIZATIONS
from pagedinfer.model import fused_ops, packed_linear
from pagedinfer.model.fused_ops import GatedLinear
torch.manual_seed(5)
out = {"native": packed_linear.native_bf16()}
for k, n, bias, gated in ((576, 960, False, False), (64, 70, True, False), (64, 34, True, True), (40, 50, True, True)):
    lin = (GatedLinear if gated else nn.Linear)(k, n, bias=bias)
    linears = {"bf16": packed_linear.PackedLinear(lin.to(torch.bfloat16), panels=True)}
    for name in ("int8", "int4"):
        linears[name] = packed_linear.PackedLinear(
            lin.float(), quantization=QUANTIZATIONS[name], activations=torch.bfloat16
        )
    for rows in (1, 2, 3, 4, 5, 7, 8, 9, 13, 17, 33, 300):
        x = torch.randn(rows, k).to(torch.bfloat16)
        for name, linear in linears.items():
            out[name, k, n, rows] = linear(x)
for dtype in (torch.float32, torch.bfloat16):
    for dim in (8, 64, 72, 576, 1000):
        x, h = torch.randn(5, dim).to(dtype), torch.randn(5, dim).to(dtype)
        out["norm", dtype, dim] = fused_ops.add_rms_norm(x, h, torch.rand(dim).to(dtype), 1e-6, True)
    qkv = torch.randn(3, 6 * 64).to(dtype)
    cos, sin = torch.rand(3, 32).to(dtype), torch.rand(3, 32).to(dtype)
    fused_ops.qk_norm_rope_(qkv, 3, 2, 64, cos, sin, torch.rand(64).to(dtype), torch.rand(64).to(dtype), 1e-6, True)
    out["qk_norm_rope", dtype] = qkv
torch.save(out, sys.argv[1])
"""
    )
    results = {}
    for flags in builds:
        path = tmp_path / f"bits{flags}.pt"
        env = {**__import__("os").environ, "PAGEDINFER_CC_FLAGS": flags, "PYTHONPATH": str(REPO)}
        run = subprocess.run([sys.executable, str(script), str(path)], env=env, capture_output=True)
        assert run.returncode == 0, run.stderr.decode()[-2000:]
        results[flags] = torch.load(path)
    native = results[""]
    assert native["native"] == bool(cpu_flags(("avx512_bf16",)))
    for flags in list(builds)[1:]:
        assert results[flags]["native"] is False  # the emulation ran
        differ = [
            key for key in native if key != "native" and not torch.equal(native[key], results[flags][key])
        ]
        assert not differ, f"{flags}: {differ[:5]}"


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


def test_a_tied_embedding_and_its_head_share_one_copy_through_the_packing(monkeypatch):
    """An embedding and a head made of the same tensor by two parameters (our layers' tied head):
    the packing copies the tensor once, before packing the head from that copy, so the tensor they
    read before is no longer held (a tied embedding's copy is never beside its packed copy); the
    head's products are the embedding's."""
    packed_from = []

    class Recording(packed_linear.PackedLinear):
        def __init__(self, linear, *args, **kwargs):
            packed_from.append(linear.weight.data_ptr())
            super().__init__(linear, *args, **kwargs)

    monkeypatch.setattr(packed_linear, "PackedLinear", Recording)
    torch.manual_seed(3)
    embed = nn.Embedding(300, 64)
    head = nn.Linear(64, 300, bias=False)
    head.weight = nn.Parameter(embed.weight.data, requires_grad=False)  # the same tensor, its own parameter
    model = nn.ModuleDict({"embed": embed, "head": head})
    before = embed.weight.data
    x = torch.randn(2, 64)
    want = x @ before.T
    assert packed_linear.pack_linears(model) == 1
    copy = model["embed"].weight
    assert torch.equal(copy, before) and copy.data_ptr() != before.data_ptr()
    assert packed_from == [copy.data_ptr()]  # the head packed from the embedding's copy
    torch.testing.assert_close(model["head"](x), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gated", [False, True])
def test_panels_packed_a_chunk_at_a_time_are_the_same_bits(monkeypatch, dtype, gated):
    """`pack_float` packs a chunk of panels at a time (its memory beside the weight: the packed copy
    and one chunk): chunks of one panel give the bits of one chunk of them all, zero padding included."""
    from pagedinfer.model import panel_formats

    torch.manual_seed(4)
    weight = torch.randn(70, 64).to(dtype)  # 70 rows: the last panel padded with zero rows
    whole = panel_formats.pack_float(weight, gated)
    monkeypatch.setattr(panel_formats, "PACK_CHUNK", 1)
    chunked = panel_formats.pack_float(weight, gated)
    assert chunked.shape == whole.shape == (5, 64, 16)
    assert torch.equal(chunked.view(torch.uint8), whole.view(torch.uint8))  # bit for bit
    assert int((whole == 0).sum()) == 10 * 64  # the 10 padding rows, and no weight, are zero
    packed_rows = whole[:, :, :] if dtype == torch.float32 else None
    if packed_rows is not None and not gated:  # float32, rows in order: panel p column r is row 16 p + r
        assert torch.equal(whole.transpose(1, 2).reshape(-1, 64)[:70], weight)


@pytest.mark.parametrize(
    ("k", "n", "bias"),
    [(576, 960, False), (37, 13, True), (1536, 70, True), (96, 50, False), (40, 100, True)],
)
def test_panel_kernel_gives_the_products_for_any_row_count(monkeypatch, k, n, bias):
    """cpu_gemm.c against a float64 product, beside oneDNN: every row tile (1-12 rows and their
    remainders; past 12 rows, tiles of 6 rows by 1-4 panels: 4, 5, 7 and 60 panels), row blocks of
    x (300 and 301 rows of k = 1536 make 5 blocks, the last one short), a partial last panel (n not
    a multiple of 16), k not a multiple of the vector width, a bias, rows that are a view into a
    bigger tensor, leading dimensions kept."""
    torch.manual_seed(3)
    lin = nn.Linear(k, n, bias=bias)
    panels, onednn = packed_linear.PackedLinear(lin, panels=True), packed_linear.PackedLinear(lin)
    assert panels.packed is None and panels.segments[0].panels.shape == (-(-n // 16), k, 16)
    assert onednn.segments is None
    lib, calls = packed_linear._gemm_library(), []
    kernel = lib.gemm_segments
    monkeypatch.setattr(lib, "gemm_segments", lambda *a: calls.append(a[4]) or kernel(*a))  # a[4]: rows
    row_counts = (*range(1, 14), 33, 300, 301)
    for rows in row_counts:
        x = torch.randn(2, rows, k)[1]  # a batch of rows, as a view into a bigger tensor
        want = x.double() @ lin.weight.detach().double().T + (lin.bias.detach().double() if bias else 0)
        got = panels(x)
        assert got.shape == (rows, n)
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(onednn(x).double(), want, atol=1e-4, rtol=1e-5)
    assert calls == list(row_counts)  # every call reached the kernel, oneDNN's never did
    assert panels(torch.randn(3, 1, k)).shape == (3, 1, n)  # leading dimensions are kept


@pytest.mark.parametrize(("k", "inter", "bias"), [(576, 1536, False), (37, 13, True), (64, 17, True)])
def test_gated_linear_gives_silu_of_gate_times_up_in_every_layout(monkeypatch, k, inter, bias):
    """A fused gate-up projection returns silu(gate) * up: unpacked, packed for oneDNN (product, then
    the C chain) and in paired panels (the activation in the kernel's epilogue), I a multiple of 8
    or not (a partial last panel), with a bias added before the activation."""
    torch.manual_seed(5)
    gated = GatedLinear(k, 2 * inter, bias=bias)
    panels, onednn = packed_linear.PackedLinear(gated, panels=True), packed_linear.PackedLinear(gated)
    assert panels.gated and panels.paired and panels.segments[0].panels.shape == (-(-inter // 8), k, 16)
    lib, calls = packed_linear._gemm_library(), []
    kernel = lib.gemm_segments
    monkeypatch.setattr(lib, "gemm_segments", lambda *a: calls.append(a[4]) or kernel(*a))
    row_counts = (1, 2, 5, 6, 7, 13, 64, 301)
    for rows in row_counts:
        x = torch.randn(rows, k)
        y = x.double() @ gated.weight.detach().double().T + (gated.bias.detach().double() if bias else 0)
        want = torch.nn.functional.silu(y[:, :inter]) * y[:, inter:]  # [rows, I]
        for module in (gated, onednn, panels):
            torch.testing.assert_close(module(x).double(), want, atol=1e-4, rtol=1e-4)
    assert calls == list(row_counts)
    assert panels(torch.randn(3, 1, k)).shape == (3, 1, inter)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_loader_picks_the_panel_kernel_on_every_cpu(tmp_path, monkeypatch, dtype):
    """By default every linear takes the panel kernel, on every CPU (AMX included: its tiles serve
    inside the panels only where they give the vdpbf16ps tiles' bits); PAGEDINFER_CPU_GEMM=onednn
    moves them to oneDNN."""
    torch.manual_seed(4)
    save_llama(tmp_path, layers=1)

    def layouts() -> set[str]:
        model = load_model(tmp_path, device="cpu", dtype=dtype).model
        packed = [m for m in model.modules() if isinstance(m, packed_linear.PackedLinear)]
        assert len(packed) == 5  # fused qkv, o, fused gate-up, down, lm_head
        return {"panels" if m.segments is not None else "onednn" for m in packed}

    assert layouts() == {"panels"}
    if packed_linear.onednn_serves(getattr(torch, dtype)):
        monkeypatch.setenv("PAGEDINFER_CPU_GEMM", "onednn")
        assert layouts() == {"onednn"}


def test_every_c_entry_is_safe_at_zero_rows():
    """A step where nothing samples hands the kernels empty inputs: each C entry returns an empty result
    (a GEMM's row blocking divided by zero rows, SIGFPE, before)."""
    from pagedinfer.config import QUANTIZATIONS
    from pagedinfer.kernels import paged_decode
    from pagedinfer.model import fused_ops

    torch.manual_seed(0)
    lin = nn.Linear(64, 48)
    for packed in (
        packed_linear.PackedLinear(lin, panels=True),
        packed_linear.PackedLinear(lin, panels=True, quantization=QUANTIZATIONS["int8"]),
        packed_linear.PackedLinear(lin, panels=True, quantization=QUANTIZATIONS["int4"]),
    ):
        assert packed(torch.empty(0, 64)).shape == (0, 48)
    table = packed_linear.PackedLinear(lin, panels=True).segments[0]
    assert packed_linear.panel_rows(table, torch.empty(0, dtype=torch.long)).shape == (0, 64)
    x = torch.empty(0, 64)
    assert fused_ops.add_rms_norm(x.clone(), x, torch.ones(64), 1e-6, True).shape == (0, 64)
    assert fused_ops.silu_mul(x, True).shape == (0, 32)
    qkv = torch.empty(0, 4 * 16)
    fused_ops.qk_norm_rope_(qkv, 2, 1, 16, torch.empty(0, 8), torch.empty(0, 8), None, None, 1e-6, True)
    assert fused_ops.argmax(torch.empty(0, 10)).shape == (0,)
    k_cache = torch.zeros(4, 16, 1, 16)
    paged_decode.store_kv(
        k_cache,
        k_cache.clone(),
        torch.empty(0, 1, 16),
        torch.empty(0, 1, 16),
        torch.empty(0, dtype=torch.long),
    )
    assert not k_cache.any()
    bounds = paged_decode.split([], 2 * 16)
    out = torch.empty(0, 2, 16)
    paged_decode.paged_decode(
        out,
        out,
        k_cache,
        k_cache,
        torch.empty(0, 4, dtype=torch.int32),
        torch.empty(0, dtype=torch.int32),
        torch.empty(0, dtype=torch.long),
        bounds,
        0.25,
        0,
        0.0,
        None,
    )
