"""pagedinfer's own Llama-family modeling: chosen when it applies, refused clearly when it does not,
its C chains equal to their torch form, and greedy parity with transformers when completions share blocks.

The greedy parity of every family, with and without preemption, through the kernels and with chunked
prefill, runs in test_parity.py for both implementations.
"""

import random

import pytest
import torch
import torch.nn.functional as F
from cli_helpers import read_jsonl, tiny_model, write_jsonl
from conftest import DEVICE, ENGINE
from models import hf_greedy
from typer.testing import CliRunner

from pagedinfer import LLM, SamplingParams
from pagedinfer.cli.app import app
from pagedinfer.model import fused_ops
from pagedinfer.model.llama import LlamaFamilyForCausalLM
from pagedinfer.model.loader import ModelLoadError, load_model


@pytest.mark.parametrize(
    ("family", "impl", "chosen"),
    [
        ("llama", "auto", "pagedinfer" if DEVICE == "cpu" else "transformers"),
        ("qwen3", "pagedinfer", "pagedinfer"),
        ("llama", "transformers", "transformers"),
        ("gpt2", "auto", "transformers"),
    ],
)
def test_model_impl_selection(tiny_model, family, impl, chosen):
    loaded = load_model(tiny_model(family), device=DEVICE, dtype="float32", model_impl=impl)
    assert loaded.impl == chosen
    assert isinstance(loaded.model, LlamaFamilyForCausalLM) == (chosen == "pagedinfer")
    assert set(loaded.layer_shapes) == {0, 1}  # the probe finds both layers through the attention entry


@pytest.mark.parametrize(
    ("family", "impl", "message"),
    [
        ("gpt2", "pagedinfer", "model implementation 'pagedinfer' cannot serve"),
        ("llama", "vllm", "unknown model implementation 'vllm': use auto, pagedinfer or transformers"),
    ],
)
def test_model_impl_refusals_are_one_line(tiny_model, family, impl, message):
    with pytest.raises(ModelLoadError) as err:
        load_model(tiny_model(family), device="cpu", dtype="float32", model_impl=impl)
    assert message in str(err.value) and "\n" not in str(err.value)
    if family == "gpt2":
        assert "model family 'gpt2' has no pagedinfer implementation" in str(err.value)


@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3"])
def test_c_chains_equal_their_torch_form(qk_norm):
    """The C loops (add + RMSNorm, per-head norm + RoPE in place, SiLU x up) against the torch fallback."""
    assert fused_ops.use_c(torch.zeros(1))  # the library builds here: the comparison below is real
    g = torch.Generator().manual_seed(0)
    t, hq, hkv, d, hidden, inter = 5, 4, 2, 16, 64, 96
    res, x, w = (torch.randn(t, hidden, generator=g) for _ in range(3))
    outs = []
    for fast in (True, False):
        r = res.clone()
        outs.append((fused_ops.add_rms_norm(r, x, w[0], 1e-5, fast), r))
    torch.testing.assert_close(outs[0], outs[1])
    qkv = torch.randn(t, (hq + 2 * hkv) * d + 8, generator=g)[:, 8:]  # rows with a stride, like a slice
    angles = torch.rand(t, d // 2, generator=g) * 10
    norms = (torch.rand(d, generator=g), torch.rand(d, generator=g)) if qk_norm else (None, None)
    rotated = []
    for fast in (True, False):
        y = qkv.clone()
        fused_ops.qk_norm_rope_(y, hq, hkv, d, angles.cos(), angles.sin(), *norms, 1e-6, fast)
        rotated.append(y)
    torch.testing.assert_close(rotated[0], rotated[1])
    assert not torch.equal(rotated[0], qkv) and torch.equal(rotated[0][:, -hkv * d :], qkv[:, -hkv * d :])
    for width in (inter, inter + 3):  # 8-float vectors, and a scalar tail
        gate_up = torch.randn(t, 2 * width, generator=g) * 40  # beyond exp's clamp at +-87
        torch.testing.assert_close(fused_ops.silu_mul(gate_up, True), fused_ops.silu_mul(gate_up, False))


@pytest.mark.parametrize("cols", [5, 8, 49152, 1003])
def test_c_argmax_equals_torchs(cols):
    """The sampler's C argmax gives torch's index: first of tied maxima (within and across lanes and
    in the tail), rows with a stride of their own; a row without a finite maximum (all -inf, a NaN,
    +inf) gives -1, in C and in the torch fallback alike, of all rows or of rows given by index."""
    if not fused_ops.use_c(torch.empty(1)):
        pytest.fail("the C chains did not build (is a C compiler installed?)")
    gen = torch.Generator().manual_seed(cols)
    wide = torch.randn(8, cols + 3, generator=gen)
    wide[1, 3 : cols : max(1, cols // 4)] = 50.0  # ties in several lanes: the first wins
    wide[3, cols - 1] = 60.0  # the maximum in the tail (or last lane)
    wide[4, : min(8, cols)] = 70.0  # a tie inside the first vector
    rows = wide[:, :cols]  # [8, cols], row stride cols + 3
    assert torch.equal(fused_ops.argmax(rows), rows.argmax(dim=-1))
    rows[2] = float("-inf")
    rows[5, cols // 2] = float("nan")
    rows[6, cols - 1] = float("inf")  # in the tail (or last lane)
    rows[7, 0] = float("inf")
    rows[7, cols // 3] = float("nan")
    expected = rows.argmax(dim=-1)
    expected[[2, 5, 6, 7]] = -1
    assert torch.equal(fused_ops.argmax(rows), expected)
    assert torch.equal(fused_ops.argmax(rows.double()), expected)  # the torch fallback
    some = torch.tensor([7, 0, 3, 2])  # rows picked by index, none copied
    assert torch.equal(fused_ops.argmax(rows, some), expected[some])
    assert torch.equal(fused_ops.argmax(rows.double(), some), expected[some])


@pytest.mark.parametrize("cols", [5, 300, 49152])
def test_c_temperature_draw_inverts_each_rows_cdf(cols):
    """The sampler's C draw: each row's token is where its tempered CDF passes the row's uniform number
    (the torch ops' token on random rows: the sums differ only in rounding), whatever other rows are
    drawn beside it; masked (-inf) tokens are never drawn, even at u just below 1 (the rounding
    fallback); draws follow softmax(x / T) (200,000 draws of a 5-token row); a row with a NaN, +inf,
    all tokens masked or a maximum that overflows at its temperature gives -1 (its neighbours draw
    as ever); a tensor off the C loop gives None (the torch ops then run)."""
    if not fused_ops.use_c(torch.empty(1)):
        pytest.fail("the C chains did not build (is a C compiler installed?)")
    gen = torch.Generator().manual_seed(cols)
    wide = torch.randn(8, cols + 3, generator=gen) * 3
    logits = wide[:, :cols]  # [8, cols], row stride cols + 3
    logits[2, ::2] = float("-inf")
    logits[3, cols // 2 :] = float("-inf")  # its last tokens masked, drawn at u just below 1
    u = torch.rand(8, generator=gen)  # [8]
    u[3] = 1.0 - 2.0**-24  # the largest float below 1
    temps = [0.8, 1.0, 0.5, 1.3, 0.8, 2.0, 1.0, 0.7]
    out = fused_ops.sample(logits, torch.arange(8), temps, u)  # [8]
    cdf = torch.softmax(logits / torch.tensor(temps).unsqueeze(1), dim=-1).cumsum(-1)  # [8, cols]
    expected = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    assert torch.equal(out[[0, 1, 2, 4, 5, 6, 7]], expected[[0, 1, 2, 4, 5, 6, 7]])
    assert logits[3, out[3]] > float("-inf") and logits[2, out[2]] > float("-inf")
    alone = [fused_ops.sample(logits, torch.tensor([r]), [temps[r]], u[r : r + 1]) for r in (6, 1, 4)]
    assert [int(t) for t in alone] == [int(out[6]), int(out[1]), int(out[4])]
    five = torch.tensor([[0.0, 1.0, 2.0, float("-inf"), 0.5]]).expand(200_000, 5).contiguous()
    draws = fused_ops.sample(five, torch.arange(200_000), [1.0] * 200_000, torch.rand(200_000, generator=gen))
    freq = torch.bincount(draws, minlength=5) / 200_000
    torch.testing.assert_close(freq, torch.softmax(five[0], dim=0), atol=0.004, rtol=0)
    logits[5, 1] = float("nan")
    logits[6] = float("-inf")
    logits[7, 2] = float("inf")
    logits[1, 0] = 1e37  # finite, but not at temperature 0.01
    picked = fused_ops.sample(logits, torch.tensor([0, 5, 6, 7, 1]), [0.8, 1.0, 1.0, 1.0, 0.01], u[:5])
    assert picked.tolist() == [int(out[0]), -1, -1, -1, -1]
    assert fused_ops.sample(logits.double(), torch.tensor([0]), [1.0], u[:1]) is None


def test_bfloat16_c_chains_round_like_transformers_modules():
    """In bfloat16 the C loops round where transformers' modules do: residual add, LlamaRMSNorm (float32
    inside, two roundings), apply_rotary_pos_emb and silu(gate) * up come out bit for bit (the SiLU's exp
    polynomial may differ from torch's in the last float32 bit, so it is allowed a rare last-place miss)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    bf = torch.bfloat16
    g = torch.Generator().manual_seed(1)
    t, hq, hkv, d, hidden, inter = 5, 4, 2, 16, 64, 96
    res, x = (torch.randn(t, hidden, generator=g).to(bf) for _ in range(2))
    norm = LlamaRMSNorm(hidden, 1e-5).to(bf)
    norm.weight.data = (torch.rand(hidden, generator=g) + 0.5).to(bf)
    r = res.clone()
    out = fused_ops.add_rms_norm(r, x, norm.weight, 1e-5, fused_ops.use_c(r))
    assert fused_ops.use_c(r) and torch.equal(r, res + x) and torch.equal(out, norm(res + x))
    qkv = torch.randn(t, (hq + 2 * hkv) * d + 8, generator=g).to(bf)[:, 8:]  # rows with a stride
    angles = torch.rand(t, d // 2, generator=g) * 10
    cos, sin = angles.cos().to(bf), angles.sin().to(bf)
    y = qkv.clone()
    fused_ops.qk_norm_rope_(y, hq, hkv, d, cos, sin, None, None, 1e-6, True)
    heads = qkv.view(t, hq + 2 * hkv, d).transpose(0, 1)[None]  # [1, heads, T, D] like HF's
    full_cos, full_sin = torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None]  # [1, T, D]
    q, k = apply_rotary_pos_emb(heads[:, :hq], heads[:, hq : hq + hkv], full_cos, full_sin)
    assert torch.equal(y.view(t, hq + 2 * hkv, d)[:, : hq + hkv], torch.cat([q, k], 1)[0].transpose(0, 1))
    for width in (inter, inter + 3):  # 8-lane vectors, and a scalar tail
        gate_up = (torch.randn(t, 2 * width, generator=g) * 4).to(bf)
        got, want = fused_ops.silu_mul(gate_up, True), F.silu(gate_up[:, :width]) * gate_up[:, width:]
        torch.testing.assert_close(got, want, rtol=2**-7, atol=0)  # one bfloat16 step at most
        assert (got == want).float().mean() >= 0.99


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_parallel_completions_share_blocks_and_match_transformers(tiny_model, family):
    """n=3 greedy completions fork the prompt's blocks (the partial last one copied on write) on the fast path."""
    rng = random.Random(2)
    prompts = [[rng.randrange(2, 256) for _ in range(n)] for n in (6, 13)]
    path = tiny_model(family)
    llm = LLM(str(path), block_size=4, num_blocks=64, model_impl="pagedinfer", **ENGINE)
    params = SamplingParams(n=3, temperature=0, max_tokens=10, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        want = hf_greedy(path, prompt, 10)
        assert [c.token_ids for c in out.outputs] == [want] * 3
    assert llm.stats.prompt_tokens_computed == 6 + 13  # each prompt computed once for its 3 completions


def test_cli_model_impl_option(tmp_path):
    """``--model-impl`` reaches the loader: both implementations write the same greedy tokens."""
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "To be, or not"}, {"prompt": "The quick brown"}])
    texts = []
    for impl in ("transformers", "pagedinfer"):
        out = tmp_path / f"{impl}.jsonl"
        args = ["run", prompts, "--model", tiny_model(), "--device", "cpu", "--quiet", "--temperature", "0"]
        result = CliRunner().invoke(
            app, [str(a) for a in [*args, "--max-tokens", "8", "--model-impl", impl, "-o", out]]
        )
        assert result.exit_code == 0, result.output
        texts.append([r["outputs"][0]["token_ids"] for r in read_jsonl(out)])
    assert texts[0] == texts[1] and all(texts[0])
