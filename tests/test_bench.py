"""`pagedinfer bench` end to end on a shrunken W0 (systems in this process: spawning three fresh
interpreters would triple the time), its option errors, and the output comparison it reports."""

from __future__ import annotations

import json

import pytest
import torch
from transformers.generation.continuous_batching import cache as cb_cache
from typer.testing import CliRunner

from pagedinfer.bench.report import agreement
from pagedinfer.bench.workloads import WORKLOADS, Shrink, make_prompts
from pagedinfer.cli.app import app

SYSTEMS = {"pagedinfer", "hf_generate", "hf_generate_batch"}


def test_bench_w0_end_to_end(tmp_path):
    init = cb_cache.PagedAttentionCache.__init__
    out = tmp_path / "bench.json"
    args = ["bench", "--workloads", "W0", "--prompts", "4", "--max-tokens", "4", "--gemm-size", "64"]
    args += [
        "--threads",
        str(torch.get_num_threads()),
        "--in-process",
        "--model-cache",
        str(tmp_path),
        "--json",
        str(out),
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = {line.split("|")[1].strip() for line in result.output.splitlines() if line.startswith("| ")}
    assert rows == SYSTEMS | {"system"}
    assert "float32 GEMM 64^3" in result.output and "bfloat16 GEMM 64^3" in result.output

    res = json.loads(out.read_text())["workloads"]["W0"]["float32"]
    assert set(res["systems"]) == SYSTEMS
    assert res["prompt_tokens"] == sum(map(len, make_prompts(WORKLOADS["W0"], 1024, Shrink(prompts=4))[0]))
    assert res["expected_output_tokens"] == 16
    for peer in ("hf_generate", "hf_generate_batch"):  # greedy: the same tokens as pagedinfer
        assert res["ratios"][peer]["greedy_agreement"]["identical_sequences"] == 1.0
    stats = res["systems"]["pagedinfer"]["stats"]
    assert stats["prompt_tokens_computed"] == res["prompt_tokens"]
    assert (
        res["systems"]["pagedinfer"]["peak_kv_bytes"] == stats["peak_blocks_used"] * stats["bytes_per_block"]
    )
    assert cb_cache.PagedAttentionCache.__init__ is init  # the recording patch was undone


def test_bench_bad_option_is_one_line():
    result = CliRunner().invoke(app, ["bench", "--workloads", "W0,W9"])
    assert result.exit_code == 2
    assert "unknown workload 'W9': choose from W0, W1, W2, W3, W4, W5" in result.output
    assert "Traceback" not in result.output


def test_shrink_keeps_the_full_workloads_prompts():
    full, full_max = make_prompts(WORKLOADS["W3"], 1000)
    cut, cut_max = make_prompts(WORKLOADS["W3"], 1000, Shrink(prompts=5, prompt_len=20, max_tokens=8))
    assert len(full) == 64 and all(p[:512] == full[0][:512] for p in full)  # one shared 512-token prefix
    assert cut == [p[:20] + p[512:][:20] for p in full[:5]]
    assert cut_max == [min(m, 8) for m in full_max[:5]]


def test_agreement_counts_tokens_before_the_first_difference():
    ref = [[[1, 2, 3, 4]], [[5, 6]]]
    other = [[[1, 2, 9, 4]], [[5, 6]]]
    assert agreement(ref, other) == {"identical_sequences": 0.5, "prefix_token_share": 4 / 6}


def test_transformers_baselines_let_mkl_take_the_cpus_path():
    """pagedinfer's own system runs with MKL on its one shared path (MKL_CBWR=COMPATIBLE, as `import
    pagedinfer` asks); the transformers baselines' processes on the CPU's own, as outside pagedinfer."""
    from pagedinfer.bench.runner import _Host
    from pagedinfer.engine.fingerprint import mkl_branch

    if mkl_branch() is None:
        pytest.skip("torch is built without MKL")
    for own, branch in ((True, "COMPATIBLE"), (False, "the CPU's")):
        host = _Host(in_process=False, own=own)
        try:
            assert host.call(mkl_branch) == branch
        finally:
            host.close()
