#!/usr/bin/env bash
# Build llama.cpp once from the llama-cpp-python sdist pinned in requirements/lock-hf.txt:
# the shared libraries its ctypes binding loads and the llama-server binary, from the same
# vendored llama.cpp commit, so that the in-process backend and the server run one build.
# Output: build/llamacpp/cmake/bin (libllama.so, libggml*.so, llama-server). Reused when
# present: make compiles it once (about 6 minutes on 2 cores).
#
# Each build is also kept in a machine-wide cache (KVREPLAY_BUILD_CACHE, default
# ~/.cache/kvreplay-build) keyed by the sdist's SHA-256, this CPU's flags (the kernels are
# native), the compiler and the build flags, so that a fresh clone on the same machine (a
# CI run) copies it instead of compiling; the binaries find their libraries beside them
# ($ORIGIN), wherever they are copied. A cold cache builds as before.
#
# Kernel families known to crash are never compiled in, whatever the CPU: a native build
# on an Intel CPU with AMX (Sapphire Rapids and later) turns on ggml's AMX kernels, which
# repack the weights and crash in the first matrix product (llama.cpp #20824). GCC lets an
# explicit -mno-* win over what -march=native implies, so the rest stays native.
# tests/integration/test_llamacpp_build.py fails if the build's system info shows AMX.
set -euo pipefail
VERSION=$(sed -n 's/^llama[-_]cpp[-_]python==//p' requirements/lock-hf.txt)
OUT=$PWD/build/llamacpp
SRC=$OUT/src/llama_cpp_python-$VERSION
SDIST=$OUT/src/llama_cpp_python-$VERSION.tar.gz
CACHE=${KVREPLAY_BUILD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvreplay-build}
FLAGS=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=ON -DGGML_OPENMP=ON
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF
  -DCMAKE_BUILD_RPATH_USE_ORIGIN=ON
  "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
mkdir -p "$OUT/src"
if [ ! -f "$SDIST" ]; then
  python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$OUT/src"
fi
[ -d "$SRC" ] || tar -xzf "$SDIST" -C "$OUT/src"
key=$({ sha256sum "$SDIST" | cut -d' ' -f1; grep -m1 '^flags' /proc/cpuinfo || uname -m
  c++ --version | head -n 1; echo "${FLAGS[*]}"; } | sha256sum | cut -c1-16)
cached=$CACHE/llamacpp-$VERSION-$key
if [ -x "$cached/llama-server" ]; then
  mkdir -p "$OUT/cmake/bin"
  cp -a "$cached/." "$OUT/cmake/bin/"
  echo "llama.cpp $VERSION: the build cached at $cached"
  exit 0
fi
# Native kernels: the build runs on the machine that uses it (never copied between CPUs).
cmake -S "$SRC/vendor/llama.cpp" -B "$OUT/cmake" "${FLAGS[@]}" > "$OUT/cmake.log"
cmake --build "$OUT/cmake" --config Release -j "$(nproc)" --target llama llama-server > "$OUT/build.log"
mkdir -p "$CACHE"
staging=$(mktemp -d "$CACHE/.staging.XXXXXX")
cp -a "$OUT/cmake/bin/." "$staging/"
mv -T "$staging" "$cached" 2>/dev/null || rm -rf "$staging"  # another run cached it first
