#!/usr/bin/env bash
# Build llama.cpp (the sources vendored in the llama-cpp-python 0.3.36 sdist) once into $CACHE, plus our driver.
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
    python -m pip download "llama-cpp-python==$VERSION" --no-deps --no-binary :all: --no-build-isolation -d "$CACHE/sdist"
  fi
  tar xzf "$CACHE/sdist/llama_cpp_python-$VERSION.tar.gz" -C "$CACHE"
fi
BUILD=$CACHE/build
if [ ! -f "$BUILD/.done" ]; then
  cmake -S "$SRC" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
    -DGGML_NATIVE=ON -DGGML_OPENMP=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_COMMON=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_APP=OFF >"$CACHE/cmake.log"
  cmake --build "$BUILD" --target llama -j "$JOBS" >"$CACHE/build.log"
  touch "$BUILD/.done"
fi
DRIVER=$CACHE/llamacpp_driver
if [ ! -x "$DRIVER" ] || [ "$HERE/llamacpp_driver.cpp" -nt "$DRIVER" ]; then
  g++ -O2 -std=c++17 "$HERE/llamacpp_driver.cpp" -I"$SRC/include" -I"$SRC/ggml/include" \
    -L"$BUILD/bin" -Wl,-rpath,"$BUILD/bin" -lllama -lggml -lggml-base -o "$DRIVER"
fi
echo "$CACHE"
