#!/usr/bin/env bash
# One prepared check for a GPU machine (H200 image: torch, CuPy, nvcc; no internet), run from a checkout:
#   bash scripts/gpu_check.sh
# 1. the kernel tests through real CuPy on CUDA tensors (PAGEDINFER_TEST_CUDA=1),
# 2. the engine's tests on CUDA (PAGEDINFER_TEST_DEVICE=cuda): greedy parity with transformers through the
#    torch path (head size 16) and the CuPy kernels (head size 64), sampling, logprobs, penalties,
# 3. the kernel microbenchmarks: decode and prefill/extend tables against SDPA on contiguous K/V (bandwidth
#    as a fraction of a device-to-device copy), see docs/kernels.md,
# 4. the CLI end to end on the embedded demo model: greedy in float32 on the CPU and on CUDA (outputs compared)
#    and n=4 sampling in bfloat16 on CUDA, with the memory report; outputs go to $OUT (else /tmp),
# 5. CUDA graphs: captured decode graphs against eager steps, greedy, float32 (and transformers) and bfloat16,
# 6. the end-to-end GPU benchmark G1 (Llama-3.2-1B shape) and G2 (Llama-3.1-8B shape), last, under a timeout,
#    so that a slow run cannot take the earlier results with it (each table prints as its workload ends).
# Expected durations on an H200 (steps 1-4 measured on 2026-11-29, docs/gpu_check_h200.log; 5-6 estimated,
# not yet run): 1 ~30 s, 2 ~25 s, 3 ~20 s (before the decode kernel's rewrite widened its tables), 4 ~35 s,
# 5 ~30 s, 6 ~150-240 s (time-limited to 270 s); about 6-7 minutes in all, within the 8-minute budget.
# Every step runs (no -x: one GPU run should show all failures); the exit status is non-zero if any failed.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py=$(command -v python3 || command -v python)
failed=()

step() {
  echo "=== $*"
  local start=$SECONDS
  "$@" || failed+=("$*")
  echo "=== done in $((SECONDS - start)) s: $*"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$py" -c "import torch, cupy; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'CuPy', cupy.__version__,
      'TF32 matmul', torch.backends.cuda.matmul.allow_tf32, 'cuDNN', torch.backends.cudnn.allow_tf32)"
# --noconftest: the kernel tests need only torch and CuPy, not the model fixtures' dependencies
step env PAGEDINFER_TEST_CUDA=1 "$py" -m pytest -q -rfs -p no:cacheprovider --noconftest tests/test_kernels.py
step env PAGEDINFER_TEST_DEVICE=cuda "$py" -m pytest -q -rfs -p no:cacheprovider tests/test_parity.py tests/test_engine.py
step "$py" scripts/bench_kernels.py

out_dir=${OUT:-/tmp}
cli() { "$py" -m pagedinfer.cli run prompts/example.jsonl --max-tokens 24 "$@"; }
step cli --temperature 0 --device cpu -o "$out_dir/example.cpu.jsonl" --quiet
step cli --temperature 0 --device cuda --dtype float32 -o "$out_dir/example.cuda.jsonl" --report-json "$out_dir/report.cuda.json"
step cli --temperature 0.8 -n 4 --device cuda --dtype bfloat16 -o "$out_dir/example.cuda-bf16.jsonl" --quiet
step "$py" scripts/compare_outputs.py "$out_dir/example.cpu.jsonl" "$out_dir/example.cuda.jsonl"

# 5. ~30 s: the graph tests (the CPU ones run too: static buffers without capture, on 16 cores)
step env PAGEDINFER_TEST_DEVICE=cuda "$py" -m pytest -q -rfs -p no:cacheprovider tests/test_cuda_graphs.py
# 6. ~150-240 s: G1 then G2, 256 prompts of 128-1024 tokens, n=4, 256 new tokens, temperature 0.8, bfloat16,
#    random weights drawn on the GPU; pagedinfer on the whole workload, the transformers systems (generate,
#    generate_batch) on its first 32 prompts only (generate's Python per step is slow; the tables say so)
step timeout 270 "$py" -m pagedinfer bench --device cuda --workloads G1,G2 --hf-prompts 32 \
  --json "$out_dir/bench_gpu.json"

if ((${#failed[@]})); then
  printf '=== FAILED: %s\n' "${failed[@]}"
  exit 1
fi
echo "=== all GPU checks passed"
