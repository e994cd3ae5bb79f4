"""`pagedinfer bench --device cuda` without a GPU: its refusals, the G1/G2 definitions, the kernel
classes of the time split, and the GPU workload's whole path (sequential systems, random weights
drawn in place, profile windows, figures, table) run on the CPU with the two CUDA calls stubbed."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from typer.testing import CliRunner

from pagedinfer.bench import runner
from pagedinfer.bench.gpu import classify, profiled_split
from pagedinfer.bench.models import MODELS, build_model, kv_elements_per_token, llama_parameters
from pagedinfer.bench.report import format_gpu_workload, format_machine
from pagedinfer.bench.workloads import WORKLOADS, Shrink
from pagedinfer.cli.app import app


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--device", "cuda"],
            "error: --device cuda: torch sees no CUDA device (the GPU workloads G1, G2 need one)",
        ),
        (["-w", "G1"], "error: G1 is a GPU workload: run it with --device cuda"),
        (
            ["--device", "cuda", "-w", "W1"],
            "error: W1 is a CPU workload; with --device cuda the workloads are G1, G2",
        ),
    ],
)
def test_gpu_bench_refusals_are_one_line(args, message):
    result = CliRunner().invoke(app, ["bench", *args])
    assert result.exit_code == 2
    assert result.output.strip() == message


def test_g1_g2_are_the_llama_shapes():
    g1, g2 = WORKLOADS["G1"], WORKLOADS["G2"]
    for w in (g1, g2):
        assert (w.num_prompts, w.prompt_len, w.max_tokens, w.n, w.temperature) == (
            256,
            (128, 1024),
            (256, 256),
            4,
            0.8,
        )
        assert w.device == "cuda" and w.dtypes == ("bfloat16",)
        assert w.systems == ("pagedinfer", "hf_generate", "hf_generate_batch")
    one, eight = MODELS[g1.model][0], MODELS[g2.model][0]
    assert llama_parameters(one) == 1_235_814_400  # Llama-3.2-1B (tied head)
    assert llama_parameters(eight) == 8_030_261_248  # Llama-3.1-8B
    assert kv_elements_per_token(one) == 16 * 2 * 8 * 64 and kv_elements_per_token(eight) == 32 * 2 * 8 * 128


def test_parameter_count_matches_a_built_model(tmp_path):
    built = build_model("tiny2l", tmp_path)  # saved with weights: counted from the model itself
    assert built.parameters == llama_parameters(MODELS["tiny2l"][0])
    config_only = build_model("tiny2l", tmp_path, weights=False)
    assert not list(config_only.path.glob("*.safetensors")) and config_only.parameters == built.parameters


def test_g1_job_on_the_gpu(tmp_path):
    opts = runner.BenchOptions(workloads=("G1",), device="cuda", shrink=Shrink(hf_prompts=64))
    model = runner.BuiltModel(tmp_path, 1, 128256, 1)
    job = runner.make_job(WORKLOADS["G1"], opts, model, "bfloat16")
    assert len(job.prompts) == 256 and all(128 <= len(p) <= 1024 for p in job.prompts)
    longest = max(len(p) + m for p, m in zip(job.prompts, job.max_tokens, strict=True))
    assert (job.device, job.load_format, job.max_model_len) == ("cuda", "dummy", longest)
    assert job.num_blocks == 256 * -(-longest // 16)  # max_num_seqs completions at full length
    hf = runner.job_for("hf_generate", job, WORKLOADS["G1"], opts.shrink)
    assert hf.prompts == job.prompts[:64] and hf.max_tokens == job.max_tokens[:64]
    assert runner.job_for("pagedinfer", job, WORKLOADS["G1"], opts.shrink) == job


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("paged_decode_kernel<__nv_bfloat16, 64, 16>", "attention"),
        ("paged_decode_merge<__nv_bfloat16, 128>", "attention"),
        ("reshape_and_cache<__nv_bfloat16>", "attention"),
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", "attention"),
        ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel)", "attention"),
        ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
        ("nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNN", "gemm"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
        ("ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x3_tn", "gemm"),
        ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm>", "gemm"),
        ("aten::mm", "gemm"),
        (
            "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>",
            "other",
        ),
        ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>", "other"),
        ("Memcpy HtoD (Pageable -> Device)", "other"),
        ("copy_blocks", "other"),
    ],
)
def test_kernel_classes(name, kind):
    assert classify(name) == kind


def test_profiled_split_of_a_cpu_profile():
    """Steps of a GEMM, an SDPA and elementwise ops: each class gets time, only in the window."""
    x = torch.randn(64, 256)
    w = torch.randn(256, 256)
    q = torch.randn(1, 4, 32, 64)

    def run(step, steps: int = 20) -> None:
        for _ in range(steps):
            torch.nn.functional.scaled_dot_product_attention(q, q, q)
            (x @ w).relu_().add_(1.0)
            step()

    split = profiled_split(run, "cpu", wait=3, active=5)
    assert split["window_steps"] == 5 and split["after_steps"] == 4
    assert all(split["us"][c] > 0 for c in ("attention", "gemm", "other"))
    assert split["total_us"] == pytest.approx(sum(split["us"].values()))
    short = profiled_split(lambda step: run(step, steps=6), "cpu", wait=3, active=5)
    assert short == {"error": "the run ended after 6 steps, before the profile window (3 + 1 + 5)"}


def test_gpu_workload_path_on_the_cpu(tmp_path, monkeypatch):
    """G1's path with a tiny model: systems one after another, random weights drawn in place, the
    transformers systems on their first 2 prompts, profile windows, the GPU figures and table."""
    make_job, time_system = runner.make_job, runner.time_system
    monkeypatch.setattr(runner, "make_job", lambda *a: dataclasses.replace(make_job(*a), device="cpu"))
    monkeypatch.setenv("PAGEDINFER_PACK_WEIGHTS", "0")  # as on a GPU: the model's own linears (profiled)

    def timed(name: str, device: str):
        assert device == "cuda"
        result = time_system(name, "cpu")
        result.details["peak_gpu_bytes"] = 3 << 20
        return result

    monkeypatch.setattr(runner, "time_system", timed)
    setup_system = runner.setup_system

    def setup(name: str, job):
        if name == "hf_generate_batch":  # a system that fails on the GPU: the others' figures stay
            raise RuntimeError("CUDA out of memory\nsecond line")
        return setup_system(name, job)

    monkeypatch.setattr(runner, "setup_system", setup)
    w = dataclasses.replace(
        WORKLOADS["G1"], model="tiny2l", num_prompts=4, prompt_len=(8, 24), max_tokens=(16, 16)
    )
    opts = runner.BenchOptions(
        workloads=("G1",), in_process=True, shrink=Shrink(hf_prompts=2), threads=torch.get_num_threads()
    )
    model = build_model("tiny2l", tmp_path, weights=False)
    rates = {"bf16_flops": 1e12, "copy_bytes_per_s": 1e11}
    res = runner.run_workload(w, "float32", opts, model, rates)

    assert set(res["systems"]) == {"pagedinfer", "hf_generate"} and res["errors"] == ["hf_generate_batch"]
    assert res["failed"] == {"hf_generate_batch": "error: RuntimeError: CUDA out of memory"}
    paged, hf = res["systems"]["pagedinfer"], res["systems"]["hf_generate"]
    assert (paged["prompts"], hf["prompts"]) == (4, 2)
    assert (paged["output_tokens"], hf["output_tokens"]) == (4 * 4 * 16, 2 * 4 * 16)
    assert paged["profile"]["window_steps"] == 5 and paged["profile"]["us"]["gemm"] > 0
    assert hf["profile"]["us"]["gemm"] > 0 and hf["hbm_bytes"] > 0
    job = runner.make_job(w, opts, model, "float32")
    weights = model.parameters * 4
    context = sum(16 * len(p) + 16 * 15 // 2 for p in job.prompts)  # every generated token's context
    assert paged["hbm_bytes"] == paged["forward_passes"] * weights + 4 * context * res["kv_bytes_per_token"]
    assert paged["hbm_fraction"] == pytest.approx(paged["hbm_bytes"] / paged["wall_s"] / 1e11)
    tokens = sum(map(len, job.prompts)) + 4 * 4 * 16
    flops = tokens * 2 * model.parameters
    assert paged["matmul_peak_fraction"] == pytest.approx(flops / paged["wall_s"] / 1e12)
    assert not [key for key in paged if "datasheet" in key]  # fractions of this run's own rates only
    assert paged["peak_gpu_bytes"] == 3 << 20

    table = format_gpu_workload("G1", res)
    assert "the transformers systems run only the first 2 prompts (tok/s over theirs)" in table
    rows = [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ")]
    assert rows == ["system", "pagedinfer", "hf_generate", "hf_generate_batch"]
    assert "| hf_generate_batch | failed: error: RuntimeError: CUDA out of memory |" in table
    assert "| peak KV MiB | matmul peak | HBM | GPU time attention / GEMM / other |" in table
    pct = f"| {100 * paged['matmul_peak_fraction']:.1f}% | {100 * paged['hbm_fraction']:.1f}% |"
    assert pct in next(line for line in table.splitlines() if line.startswith("| pagedinfer |"))
    assert "- pagedinfer profile: 5 steps after" in table and "- hf_generate profile: 5 steps after" in table


def test_bench_exits_1_when_a_system_failed(monkeypatch):
    result = {"workloads": {"G1": {"bfloat16": {"errors": ["hf_generate_batch"]}}, "G2": {"bfloat16": {}}}}
    monkeypatch.setattr(runner, "run_bench", lambda opts: result)
    out = CliRunner().invoke(app, ["bench", "-w", "W0"])
    assert out.exit_code == 1
    assert out.output.strip() == "error: systems failed: G1 bfloat16: hf_generate_batch"


def test_gpu_machine_line_gives_the_devices_own_peaks():
    """Any GPU's figures are fractions of what it reached in the same run: no datasheet is assumed."""
    gpu = {
        "name": "Some GPU",
        "memory_bytes": 80 << 30,
        "matmul_size": 8192,
        "bf16_flops": 7.5e14,
        "copy_bytes": 2 << 30,
        "copy_bytes_per_s": 3.2e12,
    }
    assert format_machine({"torch": "2.13", "transformers": "5.0", "gpu": gpu}) == (
        "Some GPU (80 GiB), torch 2.13, transformers 5.0; measured: bfloat16 matmul 8192^3 750 TFLOP/s, "
        "device copy of 2 GiB 3.20 TB/s read + written (the peaks the tables' fractions are of)"
    )
