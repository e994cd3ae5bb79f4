#!/usr/bin/env bash
# One prepared check for a GPU machine (H200 image: torch, CuPy, nvcc; no internet), run from a checkout:
#   bash scripts/gpu_check.sh
# 1. the kernel tests through real CuPy on CUDA tensors (PAGEDINFER_TEST_CUDA=1),
# 2. the engine's greedy parity tests on CUDA (PAGEDINFER_TEST_DEVICE=cuda),
# 3. the decode microbenchmark (bandwidth vs a device-to-device copy, time vs SDPA).
# Every step runs (no -x: one GPU run should show all failures); the exit status is non-zero if any failed.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
failed=()

step() {
  echo "=== $*"
  local start=$SECONDS
  "$@" || failed+=("$*")
  echo "=== done in $((SECONDS - start)) s: $*"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python -c "import torch, cupy; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'CuPy', cupy.__version__)"
# --noconftest: the kernel tests need only torch and CuPy, not the model fixtures' dependencies
step env PAGEDINFER_TEST_CUDA=1 python -m pytest -q -rf -p no:cacheprovider --noconftest tests/test_kernels.py
if [[ -f tests/test_parity.py ]]; then
  step env PAGEDINFER_TEST_DEVICE=cuda python -m pytest -q -rf -p no:cacheprovider tests/test_parity.py
else
  echo "=== tests/test_parity.py is missing"
  failed+=("parity tests (missing)")
fi
step python scripts/bench_kernels.py

if ((${#failed[@]})); then
  printf '=== FAILED: %s\n' "${failed[@]}"
  exit 1
fi
echo "=== all GPU checks passed"
