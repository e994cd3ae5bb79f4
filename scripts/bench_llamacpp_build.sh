#!/usr/bin/env bash
# Build llama.cpp (the sources vendored in the llama-cpp-python 0.3.36 sdist) once into $CACHE, plus our driver
# and llama.cpp's own llama-quantize (bench_llamacpp.py converts the GGUFs it compares with it).
# Usage: scripts/bench_llamacpp_build.sh [CACHE]   (default: ~/.cache/pagedinfer-llamacpp). Idempotent.
set -euo pipefail
CACHE=${1:-${PAGEDINFER_LLAMACPP_CACHE:-$HOME/.cache/pagedinfer-llamacpp}}
VERSION=0.3.36
HERE=$(cd "$(dirname "$0")" && pwd)
JOBS=${JOBS:-2}
mkdir -p "$CACHE"
SRC=$CACHE/llama_cpp_python-$VERSION/vendor/llama.cpp
if [ ! -f "$SRC/CMakeLists.txt" ]; then
  if ! ls "$CACHE"/sdist/llama_cpp_python-$VERSION.tar.gz >/dev/null 2>&1; then
    python -m pip download "llama-cpp-python==$VERSION" --no-deps --no-binary :all: -d "$CACHE/sdist"
  fi
  tar xzf "$CACHE/sdist/llama_cpp_python-$VERSION.tar.gz" -C "$CACHE"
fi
BUILD=$CACHE/build
# llama.cpp's AMX kernels for quantized types run wherever the CPU lists AMX; in some virtual machines
# (KVM guests that list amx_tile without enabling its state) a tile instruction faults (SIGILL) even
# after the kernel grants the permission, and every quantized model crashes. Probe it and build without
# AMX there (its AVX-512 / VNNI kernels serve instead).
FLAGS=""
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
if [ ! -f "$BUILD/.done" ] || [ "$(cat "$BUILD/.done")" != "$FLAGS" ]; then
  cmake -S "$SRC" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
    -DCMAKE_C_FLAGS="$FLAGS" -DCMAKE_CXX_FLAGS="$FLAGS" \
    -DGGML_NATIVE=ON -DGGML_OPENMP=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_COMMON=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_APP=OFF >"$CACHE/cmake.log"
  cmake --build "$BUILD" --target llama llama-quantize -j "$JOBS" >"$CACHE/build.log"
  echo "$FLAGS" >"$BUILD/.done"
  rm -f "$CACHE/llamacpp_driver"  # relinked against the new build
fi
DRIVER=$CACHE/llamacpp_driver
if [ ! -x "$DRIVER" ] || [ "$HERE/llamacpp_driver.cpp" -nt "$DRIVER" ]; then
  g++ -O2 -std=c++17 "$HERE/llamacpp_driver.cpp" -I"$SRC/include" -I"$SRC/ggml/include" \
    -L"$BUILD/bin" -Wl,-rpath,"$BUILD/bin" -lllama -lggml -lggml-base -o "$DRIVER"
fi
echo "$CACHE"
