"""scripts/bench_peers.py without any peer installed: its options, its workloads and its table."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_peers", ROOT / "scripts" / "bench_peers.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


def test_defaults_and_choices(bench, tmp_path):
    opts = bench.parse_args(["--cache", str(tmp_path)])
    assert opts.systems == ("pagedinfer", "vllm", "openvino")
    assert opts.dtypes == ("float32", "bfloat16", "int8")
    assert opts.workloads == ("A", "B", "C", "D", "b1", "W1", "W3")
    assert opts.repeats == 2 and not opts.quick and opts.cache == tmp_path.resolve()
    opts = bench.parse_args(["--systems", "vllm,pagedinfer", "--dtypes", "bfloat16", "--workloads", "C,W3"])
    assert (opts.systems, opts.dtypes, opts.workloads) == (("vllm", "pagedinfer"), ("bfloat16",), ("C", "W3"))
    assert bench.parse_args(["--quick", "--repeats", "5"]).repeats == 1  # --quick: one run each
    assert bench.parse_args(["--dtypes", "int8:bfloat16,int8"]).dtypes == ("int8:bfloat16", "int8")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--systems", "pagedinfer,tgi"], "unknown system 'tgi': choose from pagedinfer, vllm, openvino"),
        (["--dtypes", "float16"], "unknown dtype 'float16': choose from float32, bfloat16, int8"),
        (["--workloads", "A,W2"], "unknown workload 'W2': choose from A, B, C, D, b1, W1, W3"),
        (["--workloads", ","], "no workload given"),
        (["--repeats", "0"], "must be at least 1, got 0"),
    ],
)
def test_bad_options_are_one_line_errors(bench, argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_workloads_are_those_of_both_benchmarks(bench):
    ws = {w["name"]: w for w in bench.make_workloads(49152, bench.WORKLOADS, quick=False)}
    c = ws["C"]
    assert (len(c["prompts"]), {len(p) for p in c["prompts"]}, c["n"], set(c["max_tokens"])) == (
        64,
        {128},
        1,
        {64},
    )
    assert (len(ws["D"]["prompts"]), ws["D"]["n"]) == (1, 64)
    assert ws["b1"]["max_tokens"] == [128] and ws["b1"]["temperature"] == 0.0
    w1, w3 = ws["W1"], ws["W3"]
    assert (len(w1["prompts"]), w1["n"], w1["temperature"], set(w1["max_tokens"])) == (16, 4, 0.8, {64})
    assert all(64 <= len(p) <= 192 for p in w1["prompts"])
    prefix = w3["prompts"][0][:512]
    assert len(w3["prompts"]) == 64 and all(p[:512] == prefix and 528 <= len(p) <= 576 for p in w3["prompts"])
    quick = {w["name"]: w for w in bench.make_workloads(49152, ("A", "W3"), quick=True)}
    assert quick["A"]["prompts"] == ws["A"]["prompts"][:4] and quick["A"]["max_tokens"] == [8] * 4
    assert quick["W3"]["prompts"] == w3["prompts"][:4]


def _results() -> dict:
    def rec(walls: dict, outputs: dict, ready: float = 1.0, rss: int = 2**30) -> dict:
        return {"ready_s": ready, "walls": walls, "outputs": outputs, "peak_rss_bytes": rss}

    same, other = [[[1, 2]], [[3, 4]]], [[[1, 2]], [[3, 5]]]
    return {
        "workloads": ["C", "b1"],
        "greedy": ["C", "b1"],
        "output_tokens": {"C": 4096, "b1": 128},
        "skipped": {"vllm int8": "vLLM's CPU build runs int8 only from a pre-quantized checkpoint"},
        "runs": {
            "pagedinfer float32": rec({"C": [10.0, 12.0], "b1": [4.0, 5.0]}, {"C": same, "b1": [[[7]]]}),
            "pagedinfer bfloat16": rec({"C": [6.0], "b1": [2.0]}, {"C": other, "b1": [[[7]]]}),
            "vllm float32": rec(
                {"C": [20.0], "b1": [6.0]}, {"C": same, "b1": [[[8]]]}, ready=100.0, rss=5 * 2**30
            ),
            "vllm bfloat16": rec({"C": [9.0], "b1": [5.0]}, {"C": other, "b1": [[[7]]]}),
            "openvino float32": rec({"C": [15.0], "b1": [8.0]}, {"C": same, "b1": [[[7]]]}),
        },
    }


def test_table_ratios_best_against_best_load_rss_and_agreement(bench):
    table = bench.report(_results())
    rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")]
        for line in table.splitlines()
        if line.startswith("| ")
    }
    header = rows["workload"]
    assert header[1:6] == [
        "pagedinfer float32",
        "pagedinfer bfloat16",
        "vllm float32",
        "vllm bfloat16",
        "openvino float32",
    ]
    c = rows["C"]
    assert c[1:6] == ["10.00 s", "6.00 s", "20.00 s", "9.00 s", "15.00 s"]  # each one's fastest run
    assert c[6] == "vllm float32 2.00x, vllm bfloat16 1.50x, openvino float32 1.50x"  # theirs / ours
    assert c[7] == "vllm (bfloat16) 1.50x, openvino (float32) 2.50x"  # our best (6 s) against theirs
    b1 = rows["b1"]
    assert b1[1:6] == ["32.0 tok/s", "64.0 tok/s", "21.3 tok/s", "25.6 tok/s", "16.0 tok/s"]
    assert b1[7] == "vllm (bfloat16) 2.50x, openvino (float32) 4.00x"
    assert rows["vllm float32"][1:4] == ["100.0", "5,120", "C 20.00; b1 6.00"]
    assert rows["pagedinfer float32"][3] == "C 10.00, 12.00; b1 4.00, 5.00"
    assert "  pagedinfer bfloat16: 2/3" in table  # C's second prompt differs
    assert "  vllm float32: 2/3" in table and "  openvino float32: 3/3" in table
    assert "skipped vllm int8: vLLM's CPU build runs int8 only from a pre-quantized checkpoint" in table


def test_a_system_missing_a_workload_leaves_a_dash(bench):
    res = _results()
    del res["runs"]["openvino float32"]["walls"]["b1"], res["runs"]["openvino float32"]["outputs"]["b1"]
    table = bench.report(res)
    b1 = next(line for line in table.splitlines() if line.startswith("| b1 "))
    cells = [c.strip() for c in b1.strip("|").split("|")]
    assert cells[5] == "-" and cells[7] == "vllm (bfloat16) 2.50x"
    assert "  openvino float32: 2/2" in table  # C only


def test_peer_install_failure_is_one_line(bench, tmp_path, monkeypatch):
    monkeypatch.setitem(bench.PEER_PACKAGES, "vllm", [["pagedinfer-no-such-package-xyz"]])
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # no network: pip fails at once
    python, why = bench.peer_python(tmp_path, "vllm")
    assert python is None
    assert why.startswith("`pip install --progress-bar off pagedinfer-no-such-package-xyz` failed: ")
    assert "\n" not in why and "pagedinfer-no-such-package-xyz" in why
    assert not (tmp_path / "venv-vllm" / ".bench-peers-installed").exists()
