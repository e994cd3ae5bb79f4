"""Every C entry point that indexes by a token id, slot, block id, context length or row refuses one
outside its buffer, whole: nothing is read or written through it, and the exception names it and the
bound (kernels/cpu_bounds.h). The sanitizer tier (tests/test_sanitizers.py) runs these under
AddressSanitizer too, where an index that slipped through would be a reported overflow."""

from __future__ import annotations

import ctypes
import dataclasses
import re

import pytest
import torch
from conftest import DEVICE, ENGINE
from models import refused_then_run

from pagedinfer import LLM, SamplingParams
from pagedinfer.config import QUANTIZATIONS
from pagedinfer.kernels import abi, build, paged_decode
from pagedinfer.kernels.abi import IndexOutOfRange
from pagedinfer.lora import delta
from pagedinfer.model import decode_step, fused_ops, gguf_blocks, packed_linear

pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="the C kernels are the CPU's")


@pytest.fixture(autouse=True)
def kernels():
    if not (paged_decode.available() and fused_ops._library() and packed_linear._gemm_library()):
        pytest.fail("the C kernels did not build (is a C compiler installed?)")


def q8_0_blocks(w: torch.Tensor) -> torch.Tensor:
    """``w`` [out, in] as GGUF Q8_0 blocks (float16 scale, 32 int8 values), the file's bytes."""
    groups = w.reshape(-1, 32)
    d = (groups.abs().amax(1, keepdim=True) / 127).clamp_min(1e-8)
    q = (groups / d).round().clamp(-127, 127).to(torch.int8)
    data = torch.cat([d.half().view(torch.uint8), q.view(torch.uint8)], 1)  # [blocks, 34]
    return data.reshape(w.shape[0], -1).numpy()


@pytest.mark.parametrize("kind", ["Q8_0", "int8"])
def test_an_embedding_lookup_refuses_an_id_past_its_rows(kind):
    """The quantized table's row lookup (gemm_panel_rows: a GGUF embedding shared with its tied
    lm_head) serves ids in [0, rows) and refuses the first id outside them, naming it."""
    torch.manual_seed(0)
    w = torch.randn(40, 64)
    if kind == "int8":
        table = packed_linear.quantized_segment(w, None, False, QUANTIZATIONS["int8"])
    else:
        weight = gguf_blocks.GGUFWeight("Q8_0", q8_0_blocks(w), 64)
        table = packed_linear.gguf_segment([weight], None, gated=False)
    embedding = packed_linear.PanelEmbedding(table)
    every = packed_linear.dequantized(table)  # [40, 64]
    assert torch.equal(embedding(torch.tensor([[39, 0, 7]])), every[[39, 0, 7]].unsqueeze(0))
    for ids, message in (
        ([3, 40, 41], "embedding lookup: id 40 at position 1 is outside the table's 40 rows"),
        ([-1], "embedding lookup: id -1 at position 0 is outside the table's 40 rows"),
        ([0, 1 << 40], f"embedding lookup: id {1 << 40} at position 1 is outside the table's 40 rows"),
    ):
        with pytest.raises(IndexOutOfRange) as refused:
            embedding(torch.tensor(ids))
        assert str(refused.value) == message


def test_panels_shorter_than_their_columns_are_refused_before_any_kernel_reads_them():
    """The kernels index a segment's panels by column and k alone: a segment whose panels (or scales)
    hold fewer bytes than its columns need is refused where a linear is built and at a lookup."""
    torch.manual_seed(0)
    table = packed_linear.quantized_segment(torch.randn(40, 64), None, False, QUANTIZATIONS["int8"])
    short = dataclasses.replace(table, panels=table.panels[:2])  # 2 of the 3 panels of 40 rows
    message = (
        "I8 weight of 40 rows x 64: the kernel reads 3072 bytes of panels (3 panels) and 48 values of "
        "bias and scales; found 2048 bytes of panels, 48 scales"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        packed_linear.PackedLinear.from_segments(64, 40, False, [short])
    with pytest.raises(ValueError, match=re.escape(message)):
        packed_linear.PanelEmbedding(short)(torch.tensor([0]))
    no_scales = dataclasses.replace(table, scale=table.scale[:1])
    with pytest.raises(ValueError, match="found 3072 bytes of panels, 16 scales"):
        packed_linear.panel_rows(no_scales, torch.tensor([0]))


def pool(blocks: int = 4, block_size: int = 4, heads: int = 2, dim: int = 16):
    """A zeroed K/V pool ``[blocks, block_size, heads, dim]`` of float32, twice."""
    return torch.zeros(blocks, block_size, heads, dim), torch.zeros(blocks, block_size, heads, dim)


def test_the_kv_write_refuses_a_slot_past_the_pool_and_writes_nothing():
    k_cache, v_cache = pool()
    k, v = torch.ones(3, 2, 16), torch.ones(3, 2, 16)
    with pytest.raises(
        IndexOutOfRange, match=r"^store_kv: the slot 16 of new token 2 is outside the KV pool's 16 slots$"
    ):
        paged_decode.store_kv(k_cache, v_cache, k, v, torch.tensor([0, 5, 16]))
    assert not k_cache.any() and not v_cache.any()  # not even the tokens before it
    paged_decode.store_kv(k_cache, v_cache, k, v, torch.tensor([0, -1, 15]))  # -1: padding, skipped
    assert k_cache.view(16, -1).any(1).nonzero().flatten().tolist() == [0, 15]


@pytest.mark.parametrize(
    "tables, lens, rows, message",
    [
        (
            [[0, 3], [1, 4]],
            [8, 5],
            [0, 1],
            "sequence 1's block table names block 4, outside the KV pool's 4 blocks",
        ),
        (
            [[0, 3], [1, -2]],
            [8, 5],
            [0, 1],
            "sequence 1's block table names block -2, outside the KV pool's 4 blocks",
        ),
        (
            [[0, 3], [1, 2]],
            [8, 9],
            [0, 1],
            "sequence 1's context of 9 tokens is outside its block table's 8 slots",
        ),
        (
            [[0, 3], [1, 2]],
            [-1, 3],
            [0, 1],
            "sequence 0's context of -1 tokens is outside its block table's 8 slots",
        ),
        ([[0, 3], [1, 2]], [8, 5], [0, 2], "sequence 1's query row 2 is outside the 2 query rows"),
    ],
)
def test_decode_attention_refuses_a_table_length_or_row_outside_its_buffers(tables, lens, rows, message):
    """Block ids are read only up to each context (a table's padding past it is never read, whatever
    it holds); a refusal leaves the output untouched."""
    out = torch.full((2, 4, 16), 7.0)
    k_cache, v_cache = pool()
    with pytest.raises(IndexOutOfRange) as refused:
        paged_decode.paged_decode(
            out,
            torch.randn(2, 4, 16),
            k_cache,
            v_cache,
            torch.tensor(tables, dtype=torch.int32),
            torch.tensor(lens, dtype=torch.int32),
            torch.tensor(rows),
            paged_decode.split([max(n, 0) for n in lens], 4 * 32),
            0.25,
            0,
            0.0,
            None,
        )
    assert str(refused.value) == f"paged_decode: {message}"
    assert torch.equal(out, torch.full_like(out, 7.0))


def test_decode_attention_reads_a_table_only_up_to_each_context():
    """Padding past a context (the engine pads tables with 0; any value) is never read, so never refused."""
    k_cache, v_cache = pool()
    out = torch.empty(2, 4, 16)
    tables = torch.tensor([[2, 99], [1, -5]], dtype=torch.int32)
    paged_decode.paged_decode(
        out, torch.randn(2, 4, 16), k_cache, v_cache, tables, torch.tensor([4, 1], dtype=torch.int32),
        torch.arange(2), paged_decode.split([4, 1], 128), 0.25, 0, 0.0, None,
    )  # fmt: skip
    assert torch.equal(out, torch.zeros_like(out))  # a zero pool's values, averaged


def test_decode_attention_refuses_thread_ranges_past_the_sequences():
    k_cache, v_cache = pool()
    with pytest.raises(IndexOutOfRange, match="thread range 0 ends at sequence 3, outside the 2 sequences"):
        paged_decode.paged_decode(
            torch.empty(2, 4, 16), torch.randn(2, 4, 16), k_cache, v_cache, torch.zeros(2, 2, dtype=torch.int32),
            torch.tensor([1, 1], dtype=torch.int32), torch.arange(2), (ctypes.c_int32 * 2)(0, 3), 0.25, 0, 0.0, None,
        )  # fmt: skip


def test_the_debug_build_asserts_what_callers_vouch_for(monkeypatch):
    """``PAGEDINFER_KERNEL_DEBUG=1`` builds the kernels with their assert()ions (``-UNDEBUG`` after the
    default ``-DNDEBUG``), and the bindings assert the shapes their callers vouch for: here K rows
    narrower than the pool's, stopped before any C runs."""
    monkeypatch.delenv("PAGEDINFER_KERNEL_DEBUG", raising=False)
    compiler = build._compiler()
    assert all("-UNDEBUG" not in flags for flags, _ in build._targets(paged_decode.SOURCE, compiler))
    monkeypatch.setenv("PAGEDINFER_KERNEL_DEBUG", "1")
    for flags, _ in build._targets(paged_decode.SOURCE, compiler):
        assert flags.index("-UNDEBUG") > flags.index("-DNDEBUG")
    abi.debug.cache_clear()
    try:
        k_cache, v_cache = pool()
        narrow = torch.ones(2, 2, 8)
        with pytest.raises(AssertionError):
            paged_decode.store_kv(k_cache, v_cache, narrow, narrow, torch.tensor([0, 1]))
        assert not k_cache.any()
    finally:
        abi.debug.cache_clear()


def test_the_samplers_c_passes_refuse_a_row_past_the_logits():
    logits = torch.randn(3, 50)
    uniform = torch.tensor([0.5, 0.5])
    assert fused_ops.sample(logits, torch.tensor([2, 0]), [1.0, 1.0], uniform) is not None
    assert torch.equal(fused_ops.argmax(logits, torch.tensor([2, 0])), logits.argmax(1)[[2, 0]])
    with pytest.raises(IndexOutOfRange, match=r"^sample: logits row 3 \(entry 1\) is outside the 3 rows$"):
        fused_ops.sample(logits, torch.tensor([2, 3]), [1.0, 1.0], uniform)
    with pytest.raises(IndexOutOfRange, match=r"^argmax: logits row -1 \(entry 0\) is outside the 3 rows$"):
        fused_ops.argmax(logits, torch.tensor([-1, 0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_lora_delta_refuses_rows_that_are_not_a_range_of_its_rows(dtype):
    """An adapter's rows [lo, hi) of the step (the LoRA context's ranges): one past the tensor's rows, a
    negative start or an end before the start is refused, y untouched."""
    if delta.library() is None:
        pytest.fail("the LoRA deltas' kernel did not build")
    torch.manual_seed(0)
    a_t, b_t = torch.zeros(64, delta.padded(8)), torch.zeros(8, delta.padded(70))
    a_t[:, :8], b_t[:, :70] = torch.randn(64, 8), torch.randn(8, 70)
    w = delta.DeltaWeights(a_t, b_t, 8, 70, 0.5)
    x, y = torch.randn(5, 64).to(dtype), torch.randn(5, 70).to(dtype)
    before = y.clone()
    delta.add_delta(y, x, 5, 5, w)  # no rows: nothing to do
    assert torch.equal(y, before)
    for lo, hi in ((3, 6), (-1, 2), (4, 3)):
        with pytest.raises(
            IndexOutOfRange, match=rf"^LoRA delta: rows {lo}:{hi} are not a range of the 5 rows$"
        ):
            delta.add_delta(y, x, lo, hi, w)
        assert torch.equal(y, before)
    delta.add_delta(y, x, 1, 5, w)
    assert torch.equal(y[0], before[0]) and not torch.equal(y[1:], before[1:])


def test_a_packed_linear_refuses_rows_of_another_width():
    """The GEMM reads ``in_features`` values a row and writes one output row per input row: an input
    of another width would read or write past its rows."""
    linear = packed_linear.PackedLinear(torch.nn.Linear(64, 32), panels=True)
    assert linear(torch.randn(3, 64)).shape == (3, 32)
    with pytest.raises(ValueError, match="input rows of 96 values, the weight takes 64"):
        linear(torch.randn(2, 96))


def test_the_one_call_decode_step_refuses_a_bad_slot_or_table_before_any_layer(tiny_model, monkeypatch):
    """Inside a running engine, each C step is first tried with a slot or a block id past the pool:
    refused, the pool untouched (checked before the first layer); then it runs as given, and the
    tokens are those of a run without the probes."""
    monkeypatch.setattr(packed_linear, "MIN_WEIGHTS", 0)
    monkeypatch.setenv("PAGEDINFER_CPU_GEMM", "panels")
    run = decode_step.DecodeStep.run
    refusals: list[str] = []

    def probed(self, residual, ropes, meta):
        slots = self.kv.num_blocks * self.kv.block_size
        tables = meta.block_tables.clone()
        tables[-1, (int(meta.context_lens[-1]) - 1) // self.kv.block_size] = self.kv.num_blocks
        bad = [
            dataclasses.replace(meta, slot_mapping=torch.full_like(meta.slot_mapping, slots)),
            dataclasses.replace(meta, block_tables=tables),
        ]
        return refused_then_run(run, self, residual, ropes, meta, bad, refusals)

    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    def generate():
        llm = LLM(str(tiny_model("llama")), block_size=4, num_blocks=32, model_impl="pagedinfer", **ENGINE)
        (out,) = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
        assert out.error is None, out.error
        return out.outputs[0].token_ids

    plain = generate()
    monkeypatch.setattr(decode_step.DecodeStep, "run", probed)
    assert generate() == plain
    assert refusals[:2] == [
        "decode step: the slot 128 of new token 0 is outside the KV pool's 128 slots",
        "decode step: sequence 0's block table names block 32, outside the KV pool's 32 blocks",
    ]
