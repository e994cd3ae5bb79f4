"""scripts/bench_peers.py without any peer installed: its options, its workloads, the environment of
each system's process and its tables."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "scripts"))  # its own modules (bench_isa), as when it runs
    spec = importlib.util.spec_from_file_location("bench_peers", ROOT / "scripts" / "bench_peers.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    yield module
    sys.path.remove(str(ROOT / "scripts"))


def test_defaults_and_choices(bench, tmp_path):
    opts = bench.parse_args(["--cache", str(tmp_path)])
    assert opts.systems == ("pagedinfer", "vllm", "openvino") and opts.isa == "native"
    assert opts.dtypes == ("float32", "bfloat16", "int8", "auto", "int8:auto")  # equal, then the defaults
    assert opts.workloads == ("A", "B", "C", "D", "b1", "W1", "W3")
    assert opts.repeats == 2 and not opts.quick and opts.cache == tmp_path.resolve()
    avx2 = bench.parse_args(["--isa", "avx2"])
    assert (avx2.isa, avx2.dtypes) == ("avx2", ("float32", "int8", "auto", "int8:auto"))  # no bfloat16
    opts = bench.parse_args(["--systems", "vllm,pagedinfer", "--dtypes", "bfloat16", "--workloads", "C,W3"])
    assert (opts.systems, opts.dtypes, opts.workloads) == (("vllm", "pagedinfer"), ("bfloat16",), ("C", "W3"))
    assert bench.parse_args(["--quick", "--repeats", "5"]).repeats == 1  # --quick: one run each
    assert bench.parse_args(["--dtypes", "int8:bfloat16,int8"]).dtypes == ("int8:bfloat16", "int8")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--systems", "pagedinfer,tgi"], "unknown system 'tgi': choose from pagedinfer, vllm, openvino"),
        (
            ["--dtypes", "float16"],
            "unknown dtype 'float16': choose from float32, bfloat16, int8, int8:bfloat16, auto, int8:auto",
        ),
        (["--isa", "avx512"], "unknown ISA 'avx512': choose from native, avx2"),
        (
            ["--isa", "avx2", "--dtypes", "float32,int8:bfloat16"],
            "--isa avx2 runs no int8:bfloat16: an AVX2 CPU has no bfloat16 instructions",
        ),
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
    def rec(walls: dict, outputs: dict, kv: str, ready: float = 1.0, rss: int = 2**30) -> dict:
        return {
            "ready_s": ready,
            "walls": walls,
            "outputs": outputs,
            "peak_rss_bytes": rss,
            "weights": "float32",
            "activations": "float32",
            "kv": kv,
            "isa": "torch AVX2, oneDNN Intel AVX2",
        }

    same, other = [[[1, 2]], [[3, 4]]], [[[1, 2]], [[3, 5]]]
    return {
        "machine": "CPU: Test CPU (family 1 model 2: avx2 fma), 2 cores; ISA cap: avx2",
        "workloads": ["C", "b1"],
        "greedy": ["C", "b1"],
        "output_tokens": {"C": 4096, "b1": 128},
        "skipped": {"vllm int8": "vLLM's CPU build runs int8 only from a pre-quantized checkpoint"},
        "notes": ["vllm ran without libtcmalloc_minimal.so.4 in LD_PRELOAD"],
        "runs": {
            "pagedinfer float32": rec(
                {"C": [10.0, 12.0], "b1": [4.0, 5.0]}, {"C": same, "b1": [[[7]]]}, "float32"
            ),
            "pagedinfer bfloat16": rec({"C": [6.0], "b1": [2.0]}, {"C": other, "b1": [[[7]]]}, "bfloat16"),
            "vllm float32": rec(
                {"C": [20.0], "b1": [6.0]}, {"C": same, "b1": [[[8]]]}, "float32", ready=100.0, rss=5 * 2**30
            ),
            "vllm bfloat16": rec({"C": [9.0], "b1": [5.0]}, {"C": other, "b1": [[[7]]]}, "bfloat16"),
            "openvino float32": rec({"C": [15.0], "b1": [8.0]}, {"C": same, "b1": [[[7]]]}, "K f32, V f32"),
            "pagedinfer auto": rec({"C": [7.0], "b1": [3.0]}, {"C": same, "b1": [[[7]]]}, "float32"),
            "openvino auto": rec({"C": [14.0], "b1": [3.2]}, {"C": other, "b1": [[[7]]]}, "K u8, V u8"),
        },
    }


def _sections(table: str) -> dict[str, dict[str, list[str]]]:
    """Each markdown table of ``table`` by the line above it: its rows by first cell, cells stripped."""
    out: dict[str, dict[str, list[str]]] = {}
    title = ""
    for line in table.splitlines():
        if line.startswith("| "):
            cells = [c.strip() for c in line.strip("|").split("|")]
            out.setdefault(title, {})[cells[0]] = cells
        elif line.strip() and not line.startswith("|"):
            title = line
    return out


def test_tables_at_equal_precision_and_at_the_defaults(bench):
    table = bench.report(_results())
    assert table.splitlines()[0] == "CPU: Test CPU (family 1 model 2: avx2 fma), 2 cores; ISA cap: avx2"
    sections = _sections(table)
    equal = sections["At equal precision (the same weights, activations and K/V type on every system):"]
    assert equal["workload"][1:6] == [
        "pagedinfer float32",
        "pagedinfer bfloat16",
        "vllm float32",
        "vllm bfloat16",
        "openvino float32",
    ]
    c = equal["C"]
    assert c[1:6] == ["10.00 s", "6.00 s", "20.00 s", "9.00 s", "15.00 s"]  # each one's fastest run
    assert c[6] == "vllm float32 2.00x, vllm bfloat16 1.50x, openvino float32 1.50x"  # theirs / ours
    assert len(c) == 7  # no best / best here: equal precision only
    b1 = equal["b1"]
    assert b1[1:6] == ["32.0 tok/s", "64.0 tok/s", "21.3 tok/s", "25.6 tok/s", "16.0 tok/s"]
    defaults = sections[
        "At each system's defaults (what its users get from the same files; best / best over every run):"
    ]
    assert defaults["workload"][1:3] == ["pagedinfer auto", "openvino auto"]
    assert defaults["C"][1:5] == [
        "7.00 s",
        "14.00 s",
        "openvino auto 2.00x",
        "vllm (bfloat16) 1.50x, openvino (auto) 2.33x",
    ]
    assert defaults["b1"][3:5] == ["openvino auto 1.07x", "vllm (bfloat16) 2.50x, openvino (auto) 1.60x"]
    assert "pagedinfer float32" not in defaults["workload"]
    legend = sections["Runs (each one's precision as its system reported it):"]
    assert legend["run"] == [
        "run",
        "weights",
        "activations",
        "K/V",
        "load s (process start to ready)",
        "peak RSS MiB",
        "all runs (s)",
    ]
    assert legend["openvino auto"][1:4] == ["float32", "float32", "K u8, V u8"]  # each run's K/V named
    assert legend["vllm float32"][4:7] == ["100.0", "5,120", "C 20.00; b1 6.00"]
    assert legend["pagedinfer float32"][6] == "C 10.00, 12.00; b1 4.00, 5.00"
    assert "  vllm bfloat16: torch AVX2, oneDNN Intel AVX2" in table
    assert "  pagedinfer bfloat16: 2/3" in table  # C's second prompt differs
    assert "  vllm float32: 2/3" in table and "  openvino float32: 3/3" in table
    assert "vllm ran without libtcmalloc_minimal.so.4 in LD_PRELOAD" in table
    assert "skipped vllm int8: vLLM's CPU build runs int8 only from a pre-quantized checkpoint" in table


def test_a_system_missing_a_workload_leaves_a_dash(bench):
    res = _results()
    del res["runs"]["openvino float32"]["walls"]["b1"], res["runs"]["openvino float32"]["outputs"]["b1"]
    table = bench.report(res)
    b1 = next(line for line in table.splitlines() if line.startswith("| b1 "))
    cells = [c.strip() for c in b1.strip("|").split("|")]
    assert cells[5] == "-" and cells[6] == "vllm float32 1.50x, vllm bfloat16 2.50x, openvino float32 -"
    assert "  openvino float32: 2/2" in table  # C only


def test_every_system_gets_the_cap_and_the_peers_the_starting_environment(bench, tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "START_ENV", {"PATH": "/bin", "LD_PRELOAD": "/opt/mine.so"})
    monkeypatch.setenv("GOMP_SPINCOUNT", "10000")  # what import pagedinfer sets in this process
    monkeypatch.delenv("PAGEDINFER_CC_FLAGS", raising=False)
    isa = bench.bench_isa.isa_env("avx2", tmp_path)
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "libtcmalloc_minimal.so.4").touch()
    venv = tmp_path / "venv-vllm"
    (venv / "lib").mkdir(parents=True)
    (venv / "lib" / "libiomp5.so").touch()
    monkeypatch.setattr(bench, "TCMALLOC_DIRS", (str(tmp_path / "none"), str(lib)))
    python = venv / "bin" / "python"
    envs = {s: bench.worker_env(s, 2, isa, python) for s in bench.SYSTEMS}
    for system, env in envs.items():
        assert {k: env[k] for k in bench.bench_isa.AVX2_ENV} == bench.bench_isa.AVX2_ENV, system
        assert env["PAGEDINFER_CC_FLAGS"] == "-mno-avx512f -mno-avxvnni -mno-amx-tile"
        assert env["PAGEDINFER_CACHE"] == str(tmp_path / "kernels-avx2")
        assert "GOMP_SPINCOUNT" not in env and env["OMP_NUM_THREADS"] == "2", system
    assert envs["pagedinfer"]["PYTHONPATH"] == str(ROOT)
    vllm = envs["vllm"]  # as vLLM's CPU documentation prescribes: tcmalloc, then Intel OpenMP, preloaded
    assert vllm["LD_PRELOAD"] == f"{lib}/libtcmalloc_minimal.so.4:{venv}/lib/libiomp5.so:/opt/mine.so"
    assert vllm["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and "VLLM_ENABLE_V1_MULTIPROCESSING" not in vllm
    assert "PYTHONPATH" not in vllm  # its own processes, at its defaults
    site = bench.bench_isa.vllm_avx2_site(tmp_path)
    assert bench.worker_env("vllm", 2, isa, python, site)["PYTHONPATH"] == str(site)
    assert (site / "sitecustomize.py").read_text() == bench.bench_isa.VLLM_AVX2_SITECUSTOMIZE
    assert envs["openvino"]["LD_PRELOAD"] == "/opt/mine.so"
    (venv / "lib" / "libiomp5.so").unlink()
    assert bench.vllm_preload(python) == ([f"{lib}/libtcmalloc_minimal.so.4"], ["libiomp5.so"])
    assert (
        bench.worker_env("vllm", 2, {}, python)["LD_PRELOAD"]
        == f"{lib}/libtcmalloc_minimal.so.4:/opt/mine.so"
    )


def test_precisions_and_each_peers_arguments(bench):
    assert [bench.precision(d) for d in bench.DTYPES] == [
        (None, "float32"),
        (None, "bfloat16"),
        ("int8", "float32"),
        ("int8", "bfloat16"),
        (None, "auto"),
        ("int8", "auto"),
    ]
    assert set(bench.NOT_SUPPORTED) == {("vllm", "int8"), ("vllm", "int8:bfloat16"), ("vllm", "int8:auto")}
    # OpenVINO at equal precision: hints set, dynamic quantization off; at its defaults: nothing but threads
    assert bench.openvino_properties("float32", 2) == {
        "INFERENCE_NUM_THREADS": 2,
        "INFERENCE_PRECISION_HINT": "f32",
        "KV_CACHE_PRECISION": "f32",
        "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0,
    }
    assert bench.openvino_properties("int8:bfloat16", 2)["KV_CACHE_PRECISION"] == "bf16"
    assert (
        bench.openvino_properties("auto", 3)
        == bench.openvino_properties("int8:auto", 3)
        == {"INFERENCE_NUM_THREADS": 3}
    )
    greedy_n = {"n": 4, "temperature": 0.0, "max_tokens": [5, 6], "seed": 0}
    sampled = {"n": 2, "temperature": 0.8, "max_tokens": [7], "seed": 11}
    b1 = {"n": 1, "temperature": 0.0, "max_tokens": [128], "seed": 0}
    assert bench.vllm_sampling(greedy_n) == [
        {"n": 4, "temperature": 1.0, "top_k": 1, "max_tokens": 5, "ignore_eos": True},
        {"n": 4, "temperature": 1.0, "top_k": 1, "max_tokens": 6, "ignore_eos": True},
    ]
    assert bench.vllm_sampling(sampled) == [{"n": 2, "temperature": 0.8, "max_tokens": 7, "ignore_eos": True}]
    assert bench.vllm_sampling(b1) == [{"n": 1, "temperature": 0.0, "max_tokens": 128, "ignore_eos": True}]
    fixed = {"min_new_tokens": 5, "max_new_tokens": 5, "ignore_eos": True, "num_return_sequences": 4}
    assert bench.openvino_generation(greedy_n)[0] == fixed | {"do_sample": True, "top_k": 1}
    assert bench.openvino_generation(sampled) == [
        {"max_new_tokens": 7, "min_new_tokens": 7, "ignore_eos": True, "num_return_sequences": 2}
        | {"do_sample": True, "temperature": 0.8, "top_p": 1.0, "rng_seed": 11}
    ]
    assert bench.openvino_generation(b1) == [
        {"max_new_tokens": 128, "min_new_tokens": 128, "ignore_eos": True, "num_return_sequences": 1}
    ]


def test_peer_install_failure_is_one_line(bench, tmp_path, monkeypatch):
    monkeypatch.setitem(bench.PEER_PACKAGES, "vllm", [["pagedinfer-no-such-package-xyz"]])
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # no network: pip fails at once
    python, why = bench.peer_python(tmp_path, "vllm")
    assert python is None
    assert why.startswith("`pip install --progress-bar off pagedinfer-no-such-package-xyz` failed: ")
    assert "\n" not in why and "pagedinfer-no-such-package-xyz" in why
    assert not (tmp_path / "venv-vllm" / ".bench-peers-installed").exists()


def test_speculative_peers_table_and_stopping_workloads(bench):
    spec = importlib.util.spec_from_file_location(
        "bench_speculative_peers", ROOT / "scripts" / "bench_speculative_peers.py"
    )
    peers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peers)
    # W6 stops at the end token: the flag reaches vLLM's arguments (the other workloads keep ignore_eos)
    w6 = {"n": 1, "temperature": 0.0, "max_tokens": [9], "seed": 0, "ignore_eos": False}
    assert bench.vllm_sampling(w6) == [{"n": 1, "temperature": 0.0, "max_tokens": 9, "ignore_eos": False}]
    off = [[[1, 2, 3]], [[4, 5]]]  # per prompt, per completion
    assert peers.tokens(off) == 5
    runs = {
        "pagedinfer off": {"walls": {"b1": [2.0, 1.0]}, "outputs": {"b1": off}},
        "pagedinfer ngram": {"walls": {"b1": [0.5]}, "outputs": {"b1": off}},
        "vllm off": {"walls": {"b1": [5.0]}, "outputs": {"b1": off}},
        "vllm ngram": {"walls": {"b1": [2.5]}, "outputs": {"b1": [[[1, 2, 3]], [[4, 6]]]}},
    }
    table = peers.report(
        {
            "systems": ["pagedinfer", "vllm"],
            "workloads": ["b1"],
            "runs": runs,
            "loadavg": [1.0, 2.5],
            "machine": "M",
        }
    )
    assert table.splitlines()[3:] == [
        "| pagedinfer | b1 | 5.0 | 10.0 | 2.00x | yes | off yes, on yes |",  # the fastest run of each
        "| vllm | b1 | 1.0 | 2.0 | 2.00x | no | off yes, on no |",
        "load average 1.0-2.5",
    ]
