"""scripts/bench_llamacpp.py and scripts/bench_isa.py without llama.cpp built: options, the systems and
their pairing at equal precision and at the defaults, the warm-up both sides run, pagedinfer's job
(import order, prefix cache emptied, K/V type) and the ISA cap's checks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from models import save_model

from pagedinfer.kernels.build import cpu_flags

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "scripts"))  # the scripts import each other, as when they run
    import bench_llamacpp

    yield bench_llamacpp
    sys.path.remove(str(ROOT / "scripts"))


def test_options(bench, capsys):
    args = bench.parse_args([])
    assert (args.isa, args.formats, args.dtypes) == ("native", "F32,Q8_0,Q4_0", "float32,Q8_0,Q4_0")
    assert args.llamacpp_kv_types == ["f16", "same"] and args.workloads == ["A", "B", "C", "D", "b1"]
    assert bench.parse_args(["--isa", "avx2", "--llamacpp-kv-types", "f32,f16"]).llamacpp_kv_types == [
        "f32",
        "f16",
    ]
    for argv, message in [
        (["--isa", "sse2"], "unknown ISA 'sse2': choose from native, avx2"),
        (["--llamacpp-kv-types", "q8_0"], "unknown K/V type 'q8_0': choose from f16, f32, bf16, same"),
        (["--workloads", "A,E"], "unknown workload 'E': choose from A, B, C, D, b1"),
        (
            ["--isa", "avx2", "--dtypes", "float32,Q4_0:bfloat16"],
            "--isa avx2 runs no Q4_0:bfloat16: an AVX2 CPU has no bfloat16 instructions",
        ),
        (["--isa", "avx2", "--formats", "F32,BF16"], "--isa avx2 runs no BF16: an AVX2 CPU has no bfloat16"),
        (["--isa", "avx2", "--llamacpp-kv-types", "bf16"], "--isa avx2 runs no bf16: an AVX2 CPU has no"),
    ]:
        with pytest.raises(SystemExit) as e:
            bench.parse_args(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err


def test_our_systems_name_their_twin_weights_and_defaults(bench, tmp_path):
    args = bench.parse_args(
        ["--dtypes", "float32,Q4_0,Q4_0:bfloat16,int8", "--kv-cache-dtypes", "auto,float16"]
    )
    ggufs = {"Q4_0": tmp_path / "q4.gguf"}
    systems = {s.name: s for s in bench.our_systems(args, tmp_path, ggufs, {})}
    assert {n: (s.weights, s.default) for n, s in systems.items()} == {
        "pagedinfer float32": ("F32", True),
        "pagedinfer float32, K/V f16": ("F32", False),
        "pagedinfer Q4_0": ("Q4_0", True),
        "pagedinfer Q4_0, K/V f16": ("Q4_0", False),
        "pagedinfer Q4_0:bfloat16": ("Q4_0", False),  # activations asked for: not the default
        "pagedinfer Q4_0:bfloat16, K/V f16": ("Q4_0", False),
        "pagedinfer int8": (None, True),  # no llama.cpp file holds per-channel int8 weights
        "pagedinfer int8, K/V f16": (None, False),
    }
    assert {s.side for s in systems.values()} == {"pagedinfer"}


def _rec(side: str, weights: str | None, default: bool, kv: str, walls: dict[str, float]) -> dict:
    runs = {
        w: {"wall_s": t, "peak_rss_mb": 100.0, "kv_type": kv, "isa": f"{side} AVX2", "outputs": [[1, 2]]}
        for w, t in walls.items()
    }
    return {"side": side, "weights": weights, "default": default, "runs": runs}


def _results() -> dict:
    return {
        "pagedinfer float32": _rec("pagedinfer", "F32", True, "f32", {"C": 10.0, "b1": 2.0}),
        "pagedinfer Q4_0": _rec("pagedinfer", "Q4_0", True, "f32", {"C": 8.0, "b1": 1.0}),
        "pagedinfer int8": _rec("pagedinfer", None, True, "f32", {"C": 9.0, "b1": 1.5}),
        "llama.cpp F32, K/V f16": _rec("llama.cpp", "F32", True, "f16", {"C": 15.0, "b1": 2.5}),
        "llama.cpp Q4_0, K/V f16": _rec("llama.cpp", "Q4_0", True, "f16", {"C": 16.0, "b1": 0.8}),
        "llama.cpp Q4_0, K/V f32": _rec("llama.cpp", "Q4_0", False, "f32", {"C": 12.0, "b1": 0.9}),
    }


def test_matched_kv_types_are_those_of_our_runs_of_the_same_weights(bench):
    results = _results()
    assert bench.matched_kv_types(results, "Q4_0", ["f16"]) == ["f32"]
    assert bench.matched_kv_types(results, "Q4_0", ["f16", "f32"]) == []
    assert bench.matched_kv_types(results, "Q8_0", ["f16"]) == []  # no run of ours holds Q8_0


def test_report_prints_each_comparison_at_equal_precision_and_at_the_defaults(bench):
    table = bench.report(_results(), ["C", "b1"], {"C": 64, "b1": 128}, "CPU: Test CPU; ISA cap: avx2")
    lines = table.splitlines()
    assert lines[:2] == ["CPU: Test CPU; ISA cap: avx2", ""]  # the machine and the cap head the table
    lines = lines[2:]
    assert lines[0] == (
        "| workload | pagedinfer float32, K/V f32 | pagedinfer Q4_0, K/V f32 | pagedinfer int8, K/V f32 | "
        "llama.cpp F32, K/V f16 | llama.cpp Q4_0, K/V f16 | llama.cpp Q4_0, K/V f32 |"
    )
    assert lines[2] == "| C | 10.00 s | 8.00 s | 9.00 s | 15.00 s | 16.00 s | 12.00 s |"
    assert (
        lines[3] == "| b1 | 64.0 tok/s | 128.0 tok/s | 85.3 tok/s | 51.2 tok/s | 160.0 tok/s | 142.2 tok/s |"
    )
    equal = lines.index(
        "At equal precision (the same weights and K/V type; ours / llama.cpp, above 1 when ours is faster):"
    )
    assert lines[equal + 1] == "| workload | pagedinfer Q4_0, K/V f32 / llama.cpp Q4_0, K/V f32 |"
    assert lines[equal + 3 : equal + 5] == ["| C | 1.50x |", "| b1 | 0.90x |"]
    defaults = lines.index("At each system's defaults (ours: the model's K/V type; llama.cpp: f16 K/V):")
    assert lines[defaults + 1] == (
        "| workload | pagedinfer float32, K/V f32 / llama.cpp F32, K/V f16 | "
        "pagedinfer Q4_0, K/V f32 / llama.cpp Q4_0, K/V f16 |"
    )
    assert lines[defaults + 3 : defaults + 5] == ["| C | 1.50x | 2.00x |", "| b1 | 1.25x | 0.80x |"]
    assert "  llama.cpp Q4_0, K/V f32: llama.cpp AVX2" in lines
    assert "  llama.cpp F32, K/V f16: 2/2; 4/4" in lines  # greedy agreement with the first system
    assert (bench.common_prefix([1, 2, 3], [1, 5, 3]), bench.common_prefix([1, 2], [1, 2, 3])) == (1, 2)


def test_report_says_how_to_get_a_missing_comparison(bench):
    results = _results()
    del results["llama.cpp Q4_0, K/V f32"]
    table = bench.report(results, ["C"], {"C": 64}, "CPU: Test CPU")
    assert "no pair at equal precision: add --llamacpp-kv-types same, or --kv-cache-dtypes float16" in table


def test_the_llamacpp_driver_gets_the_warm_up_and_the_kv_type(bench, tmp_path):
    """A stand-in driver records its arguments and workload file: the format llamacpp_driver.cpp reads."""
    driver = tmp_path / "llamacpp_driver"
    driver.write_text(
        '#!/bin/sh\necho "$@" > "$0.args"\ncp "$2" "$0.workload"\necho "OMP=$OMP_NUM_THREADS CAP=$ONEDNN_MAX_CPU_ISA" '
        '> "$0.env"\necho \'{"wall_s": 1.5, "prefill_s": 0.5, "peak_rss_mb": 50.0, "kv_type": "f32", '
        '"system_info": "CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | AVX512 = 0 | OPENMP = 1 | REPACK = 1 |", '
        '"outputs": [[5, 6]]}\'\n'
    )
    driver.chmod(0o755)
    w = bench.Workload("C", [[7, 8, 9], [10, 11]], 1, 2)
    got = bench.run_llamacpp(
        driver, tmp_path / "m.gguf", w, 2, "f32", {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    )
    assert got["isa"] == "SSE3 AVX AVX2 F16C FMA" and got["wall_s"] == 1.5 and "system_info" not in got
    assert Path(f"{driver}.args").read_text().split() == [
        str(tmp_path / "m.gguf"),
        str(tmp_path / "workload-m-C.txt"),
        "2",
        "f32",
    ]
    assert Path(f"{driver}.workload").read_text().splitlines() == [
        "1 2 2 4",  # n, new tokens, prompts, the warm-up's new tokens
        "16 " + " ".join(str(t) for t in range(100, 116)),  # the warm-up prompt: pagedinfer's too
        "3 7 8 9",
        "2 10 11",
    ]
    assert Path(f"{driver}.env").read_text().split() == ["OMP=2", "CAP=AVX2"]


def test_pagedinfer_job_imports_pagedinfer_first_and_reports_its_kv_and_isa(bench, model_root):
    model = save_model("llama", model_root)
    w = bench.Workload("C", [[3, 4, 5, 6], [7, 8, 9]], 1, 3)
    got = bench.run_pagedinfer(model, "pagedinfer", "float32", "float16", w, 1, dict(os.environ))
    assert got["kv_type"] == "f16" and got["dtype"] == "float32"
    assert len(got["outputs"]) == 2 and all(len(o) == 3 for o in got["outputs"])
    # pagedinfer's OpenMP spin count reached libgomp: it was imported before torch loaded libgomp
    assert got["isa"].endswith("GOMP_SPINCOUNT 10000"), got["isa"]
    assert got["isa"].startswith("torch ") and "; C kernels: " in got["isa"]


def test_the_build_script_refuses_an_unknown_isa_before_fetching_anything(tmp_path):
    script = ROOT / "scripts" / "bench_llamacpp_build.sh"
    res = subprocess.run(["bash", str(script), str(tmp_path), "avx512"], capture_output=True, text=True)
    assert res.returncode == 2
    assert res.stderr == "bench_llamacpp_build: unknown ISA 'avx512': choose native or avx2\n"
    assert not (tmp_path / "sdist").exists()


# ---------------------------------------------------------------- bench_isa


def test_isa_env_caps_every_library_and_keeps_the_kernels_apart(bench, tmp_path, monkeypatch):
    isa = bench.bench_isa
    monkeypatch.setenv("PAGEDINFER_CC_FLAGS", "-DWR=8")
    assert isa.isa_env("native", tmp_path) == {}
    env = isa.isa_env("avx2", tmp_path)
    assert env == {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "OV_CPU_MAX_ISA": "AVX2",
        "PAGEDINFER_CC_FLAGS": "-DWR=8 -mno-avx512f -mno-avxvnni -mno-amx-tile",
        "PAGEDINFER_CACHE": str(tmp_path / "kernels-avx2"),
    }
    line = isa.machine_line("avx2")
    assert line.startswith("CPU: ") and line.endswith("ISA cap: avx2 (AVX2, FMA, F16C; no AVX-512)")
    assert "family " in line and f"{os.cpu_count()} cores" in line
    assert isa.llamacpp_isa("CPU : AVX = 1 | AVX2 = 1 | AVX512 = 0 | OPENMP = 1 |") == "AVX AVX2"


@pytest.mark.skipif(
    shutil.which("objdump") is None or shutil.which("cc") is None, reason="needs cc and objdump"
)
def test_zmm_count_tells_an_avx512_build_from_an_avx2_one(bench, tmp_path):
    """The check of compiled code: a loop built for AVX-512 uses zmm registers, built for AVX2 none."""
    source = tmp_path / "scale.c"
    source.write_text("void scale(float *a, int n) { for (int i = 0; i < n; i++) a[i] *= 3.0f; }\n")
    counts = {}
    for name, flags in (
        ("avx512", ["-mavx512f", "-mprefer-vector-width=512"]),
        ("avx2", ["-mavx2", "-mfma"]),
    ):
        lib = tmp_path / f"{name}.so"
        subprocess.run(["cc", "-O3", "-shared", "-fPIC", *flags, str(source), "-o", str(lib)], check=True)
        counts[name] = bench.bench_isa.zmm_instructions(lib)
    assert counts["avx512"] > 0 and counts["avx2"] == 0
    assert bench.bench_isa.zmm_summary([tmp_path / "avx2.so"]) == "0 zmm instructions in 1 libraries"


@pytest.mark.skipif(not cpu_flags(("avx2",)), reason="needs an AVX2 CPU")
def test_torch_isa_reports_the_cap_in_force():
    """ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA seen by torch's own kernels and by oneDNN."""
    code = "import sys; sys.path.insert(0, 'scripts'); import bench_isa; print(bench_isa.torch_isa())"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "torch AVX2, oneDNN Intel AVX2"


def test_the_vllm_site_answers_torch_cpu_queries_as_an_avx2_cpu(bench, tmp_path):
    site = bench.bench_isa.vllm_avx2_site(tmp_path)
    code = "import json, torch.cpu as c; print(json.dumps([c._is_avx512_supported(), c._is_avx512_bf16_supported(), c._is_amx_tile_supported()]))"
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == [False, False, False]
