"""Decode steps through the CUDA graph path's static buffers: same greedy tokens as transformers.

On the CPU nothing is captured, but `LLMEngine(graph_buffers_on_cpu=True)` sends every pure-decode
step through the very buffers, padding rows, scratch block and upper-bound metadata that a captured
graph replays on CUDA (`pagedinfer/model/cuda_graphs.py`), with the CPU backends and with the CUDA
kernels through their CPU harness. The last test runs on CUDA only (PAGEDINFER_TEST_DEVICE=cuda,
scripts/gpu_check.sh): real graphs against eager steps, float32 and bfloat16 in one run.
"""

import pytest
import torch
from conftest import DEVICE
from models import hf_greedy

from pagedinfer import LLM, SamplingParams
from pagedinfer.attention import cuda_kernels, cuda_on_cpu
from pagedinfer.engine.llm_engine import LLMEngine, graph_plan
from pagedinfer.model.cuda_graphs import DecodeGraphs, batch_buckets

# 5 prompts (bucket 8: three padding rows), finishing at different steps (batches of 5, 4, 3, 2, 1)
PROMPTS = [[(7 * i + 3 * j) % 250 + 3 for j in range(n)] for i, n in enumerate((3, 9, 14, 6, 21))]
MAX_TOKENS = [4, 7, 10, 12, 9]


def static_llm(path, use_cuda_kernels: bool | None = None, **kw) -> LLM:
    """An LLM whose engine runs decode steps through the graph path's static buffers (CPU, no capture)."""
    llm = LLM(str(path), device="cpu", dtype="float32", **kw)
    e = llm.engine
    llm.engine = LLMEngine(e.loaded, e.config, use_cuda_kernels=use_cuda_kernels, graph_buffers_on_cpu=True)
    assert isinstance(llm.engine.runner.graphs, DecodeGraphs)
    return llm


@pytest.fixture
def loads(monkeypatch) -> list[tuple[int, int]]:
    """(sequences, bucket) of every step that went through the static buffers."""
    seen: list[tuple[int, int]] = []
    load = DecodeGraphs._load

    def recording(self, batch):
        b = load(self, batch)
        seen.append((len(batch), b))
        return b

    monkeypatch.setattr(DecodeGraphs, "_load", recording)
    return seen


def generate(llm: LLM, n: int = 1) -> list[list[list[int]]]:
    params = [SamplingParams(n=n, temperature=0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs]


def expected(path) -> list[list[int]]:
    return [hf_greedy(path, p, m) for p, m in zip(PROMPTS, MAX_TOKENS, strict=True)]


def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]


def test_graph_plan():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert graph_plan(cpu, False, False, False) == (False, "not applicable on the CPU")
    assert graph_plan(cpu, False, False, True)[0] is True
    assert graph_plan(cuda, True, False, False) == (True, "on")
    assert graph_plan(cuda, True, True, False) == (False, "off: enforce_eager")
    assert graph_plan(cuda, False, False, False)[1].startswith("off: the torch attention path")


@pytest.mark.parametrize("impl", ["transformers", "pagedinfer"])
@pytest.mark.parametrize("num_blocks", [64, 9], ids=["roomy-pool", "preempting-pool"])
def test_static_buffers_match_transformers(tiny_model, loads, impl, num_blocks):
    path = tiny_model("llama")
    llm = static_llm(path, block_size=4, num_blocks=num_blocks, model_impl=impl)
    assert llm.engine.kv.k[0].shape[0] == num_blocks + 1  # the padding rows' scratch block
    assert generate(llm) == [[want] for want in expected(path)]
    st = llm.stats
    assert 0 < st.graph_steps < st.steps and st.graph_steps == len(loads)
    assert (3, 4) in loads and (1, 1) in loads  # a padded bucket; batches shrink as completions finish
    if num_blocks == 64:
        assert (5, 8) in loads
    assert (st.preemptions > 0) == (num_blocks == 9)
    assert llm.engine.pool.num_used == 0


def test_static_buffers_with_completions_sharing_blocks(tiny_model, loads):
    """n=3 greedy completions fork the prompt's blocks; each copies the partial last block on write."""
    path = tiny_model("llama")
    llm = static_llm(path, block_size=4, num_blocks=64, max_num_seqs=12)
    assert generate(llm, n=3) == [[want] * 3 for want in expected(path)]
    assert llm.stats.cow_copies > 0
    assert (12, 12) in loads  # 15 completions, at most 12 running: the largest bucket, 12, not a power of two


def test_static_buffers_through_the_cuda_kernels(tiny_model, loads, monkeypatch):
    """The CUDA kernels (CPU harness) read the graph step's metadata: padded rows, the scratch block,
    ``max_context_len`` the bound (1200: 3 of the decode kernel's 512-key partitions, while the real
    contexts fill less than one), no host context lengths."""
    path = tiny_model("llama_d64_long")
    launched = []
    attend = cuda_kernels.paged_attention
    monkeypatch.setattr(
        cuda_kernels,
        "paged_attention",
        lambda *a, **k: launched.append(a[4].max_context_len) or attend(*a, **k),
    )
    cuda_kernels.set_raw_module_factory(cuda_on_cpu.RawModule)
    try:
        llm = static_llm(path, use_cuda_kernels=True, block_size=8, num_blocks=40, model_impl="transformers")
        assert llm.engine.runner.graphs.max_context == 1200
        got = generate(llm)
    finally:
        cuda_kernels.set_raw_module_factory(None)
    assert got == [[want] for want in expected(path)]
    assert 1200 in launched and max(launched) == 1200 and (5, 8) in loads


@pytest.mark.skipif(DEVICE != "cuda", reason="captures CUDA graphs: PAGEDINFER_TEST_DEVICE=cuda")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_match_eager(tiny_model, dtype):
    """Captured graphs replayed against eager steps (and, in float32, transformers), in one run."""
    path = tiny_model("llama_d64_long")
    kw = dict(device="cuda", dtype=dtype, block_size=16, num_blocks=64, max_num_seqs=8)
    graphed = LLM(str(path), **kw)
    assert graphed.stats.cuda_graphs.startswith("on: batch sizes 1, 2, 4, 8"), graphed.stats.cuda_graphs
    assert graphed.stats.graph_capture_s > 0
    got = generate(graphed)
    assert 0 < graphed.stats.graph_steps < graphed.stats.steps
    eager = LLM(str(path), enforce_eager=True, **kw)
    assert eager.stats.cuda_graphs == "off: enforce_eager"
    assert generate(eager) == got
    assert eager.stats.graph_steps == 0
    if dtype == "float32":
        assert got == [[want] for want in expected(path)]


def test_enforce_eager_option_reaches_the_engine(tmp_path, monkeypatch):
    import json

    from cli_helpers import tiny_model as cli_model
    from cli_helpers import write_jsonl
    from typer.testing import CliRunner

    from pagedinfer.cli.app import app
    from pagedinfer.engine import llm_engine

    asked = []
    plan = llm_engine.graph_plan
    monkeypatch.setattr(llm_engine, "graph_plan", lambda *a: asked.append(a[2]) or plan(*a))
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "to be", "max_tokens": 3}])
    report = tmp_path / "r.json"
    args = ["run", prompts, "--model", cli_model(), "--device", "cpu", "--quiet", "--report-json", report]
    for extra in ([], ["--enforce-eager"]):
        result = CliRunner().invoke(app, [str(a) for a in args + extra])
        assert result.exit_code == 0, result.output
        assert json.loads(report.read_text())["cuda_graphs"]["mode"] == "not applicable on the CPU"
    assert asked == [False, True]


@pytest.mark.parametrize(
    ("family", "use_cuda_kernels"),
    [("qwen2_window", None), ("gemma3_text", None), ("qwen2_window_d64", True)],
)
def test_static_buffers_with_layer_groups(tiny_model, loads, family, use_cuda_kernels):
    """Windowed and global layers: each group's slots and tables in buffers of their own (a windowed
    group's naming the null block), read by the torch path or the CUDA kernels (CPU harness); n=2
    completions forking every group's blocks, a pool that preempts."""
    path = tiny_model(family)
    cuda_kernels.set_raw_module_factory(cuda_on_cpu.RawModule)
    try:
        llm = static_llm(path, use_cuda_kernels, block_size=8, num_blocks=16)
        assert llm.engine.runner.use_cuda_kernels == bool(use_cuda_kernels)
        assert len(llm.engine.runner.graphs.slots) == len(llm.engine.kv.groups) > 1
        got = generate(llm, n=2)
    finally:
        cuda_kernels.set_raw_module_factory(None)
    assert got == [[want] * 2 for want in expected(path)]
    st = llm.stats
    assert 0 < st.graph_steps == len(loads) and st.kv.window_releases > 0 and st.preemptions > 0
    assert llm.engine.pool.num_used == 0
