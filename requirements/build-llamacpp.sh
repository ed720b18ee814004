#!/usr/bin/env bash
# Build llama.cpp once from the llama-cpp-python sdist pinned in requirements/lock-hf.txt:
# the shared libraries its ctypes binding loads and the llama-server binary, from the same
# vendored llama.cpp commit, so that the in-process backend and the server run one build.
# Output: build/llamacpp/cmake/bin (libllama.so, libggml*.so, llama-server). Reused when
# present: make compiles it once (about 6 minutes on 2 cores).
set -euo pipefail
VERSION=$(sed -n 's/^llama[-_]cpp[-_]python==//p' requirements/lock-hf.txt)
OUT=$PWD/build/llamacpp
SRC=$OUT/src/llama_cpp_python-$VERSION
mkdir -p "$OUT/src"
if [ ! -d "$SRC" ]; then
  python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$OUT/src"
  tar -xzf "$OUT/src/llama_cpp_python-$VERSION.tar.gz" -C "$OUT/src"
fi
# Native kernels: the build runs on the machine that uses it (never copied between CPUs).
cmake -S "$SRC/vendor/llama.cpp" -B "$OUT/cmake" -DCMAKE_BUILD_TYPE=Release \
  -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=ON -DGGML_OPENMP=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF > "$OUT/cmake.log"
cmake --build "$OUT/cmake" --config Release -j "$(nproc)" --target llama llama-server > "$OUT/build.log"
