#!/usr/bin/env bash
# Build llama.cpp (the sources vendored in the llama-cpp-python 0.3.36 sdist) once into $CACHE, plus our driver
# and llama.cpp's own llama-quantize (bench_llamacpp.py converts the GGUFs it compares with it).
# Usage: scripts/bench_llamacpp_build.sh [CACHE] [ISA]   (default: ~/.cache/pagedinfer-llamacpp, native).
# ISA native: GGML_NATIVE (every instruction this CPU has), in $CACHE/build, driver $CACHE/llamacpp_driver.
# ISA avx2: the instruction set of an AVX2 machine (AVX2, FMA, F16C, BMI2; no AVX-512, AVX-VNNI or AMX)
# whatever this CPU has, in $CACHE/build-avx2, driver $CACHE/llamacpp_driver-avx2. Idempotent; prints the
# driver's path last.
set -euo pipefail
CACHE=${1:-${PAGEDINFER_LLAMACPP_CACHE:-$HOME/.cache/pagedinfer-llamacpp}}
ISA=${2:-native}
VERSION=0.3.36
HERE=$(cd "$(dirname "$0")" && pwd)
JOBS=${JOBS:-2}
mkdir -p "$CACHE"
FLAGS=""
case $ISA in
native)
  BUILD=$CACHE/build
  DRIVER=$CACHE/llamacpp_driver
  ISA_OPTIONS=(-DGGML_NATIVE=ON)
  # llama.cpp's AMX kernels for quantized types run wherever the CPU lists AMX; in some virtual machines
  # (KVM guests that list amx_tile without enabling its state) a tile instruction faults (SIGILL) even
  # after the kernel grants the permission, and every quantized model crashes. Probe it and build without
  # AMX there (its AVX-512 / VNNI kernels serve instead).
  if grep -qw amx_tile /proc/cpuinfo; then
    cat >"$CACHE/amx_probe.c" <<'EOF_PROBE'
#include <immintrin.h>
#include <signal.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
static void ill(int s) { (void)s; _exit(1); }
int main(void) {
    unsigned char cfg[64];
    if (syscall(SYS_arch_prctl, 0x1023, 18)) return 2; /* ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA */
    signal(SIGILL, ill);
    memset(cfg, 0, sizeof cfg);
    cfg[0] = 1, cfg[16] = 64, cfg[48] = 16;
    _tile_loadconfig(cfg);
    _tile_zero(0);
    _tile_release();
    return 0;
}
EOF_PROBE
    if ! (cc -O2 -mamx-tile "$CACHE/amx_probe.c" -o "$CACHE/amx_probe" && "$CACHE/amx_probe"); then
      FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
      echo "bench_llamacpp_build: AMX faults on this machine: llama.cpp built without it ($FLAGS)" >&2
    fi
  fi
  ;;
avx2)
  BUILD=$CACHE/build-avx2
  DRIVER=$CACHE/llamacpp_driver-avx2
  # ggml's own switches (no -march=native): the compiler gets -mavx2 -mfma -mf16c -mbmi2 and nothing wider
  ISA_OPTIONS=(-DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_BMI2=ON -DGGML_FMA=ON
    -DGGML_F16C=ON -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF
    -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
  ;;
*)
  echo "bench_llamacpp_build: unknown ISA '$ISA': choose native or avx2" >&2
  exit 2
  ;;
esac
SRC=$CACHE/llama_cpp_python-$VERSION/vendor/llama.cpp
if [ ! -f "$SRC/CMakeLists.txt" ]; then
  if ! ls "$CACHE"/sdist/llama_cpp_python-$VERSION.tar.gz >/dev/null 2>&1; then
    python -m pip download "llama-cpp-python==$VERSION" --no-deps --no-binary :all: -d "$CACHE/sdist"
  fi
  tar xzf "$CACHE/sdist/llama_cpp_python-$VERSION.tar.gz" -C "$CACHE"
fi
STAMP="$FLAGS ${ISA_OPTIONS[*]}"
if [ ! -f "$BUILD/.done" ] || [ "$(cat "$BUILD/.done")" != "$STAMP" ]; then
  cmake -S "$SRC" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
    -DCMAKE_C_FLAGS="$FLAGS" -DCMAKE_CXX_FLAGS="$FLAGS" "${ISA_OPTIONS[@]}" \
    -DGGML_OPENMP=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_COMMON=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_APP=OFF >"$BUILD.cmake.log"
  cmake --build "$BUILD" --target llama llama-quantize -j "$JOBS" >"$BUILD.build.log"
  echo "$STAMP" >"$BUILD/.done"
  rm -f "$DRIVER" # relinked against the new build
fi
if [ ! -x "$DRIVER" ] || [ "$HERE/llamacpp_driver.cpp" -nt "$DRIVER" ]; then
  g++ -O2 -std=c++17 "$HERE/llamacpp_driver.cpp" -I"$SRC/include" -I"$SRC/ggml/include" \
    -L"$BUILD/bin" -Wl,-rpath,"$BUILD/bin" -lllama -lggml -lggml-base -o "$DRIVER"
fi
echo "$DRIVER"
